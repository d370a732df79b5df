"""DDP communication hooks of several rounds, made safe on gloo for the ``ddp-*`` peers.

torch's ``powerSGD_hook`` sends a bucket in three rounds (the uncompressed tensors, then
``P``, then ``Q``), each issued from the callback of the round before. With gloo those
callbacks run on gloo's threads when each round completes, so bucket ``k``'s next round and
bucket ``k + 1``'s first one reach the process group in whichever order the threads happen
to run, which differs between ranks: gloo then aborts the job ("Received data size doesn't
match expected size") or the ranks hang. On the 2-core machine, ResNet-18 at 100 Mbit/s
died this way in round 0 of every run (benchmarks/RESULTS.md, stop 16); on NCCL the peer
runs torch's hook unwrapped (not re-checked here: no GPU).

:func:`one_bucket_at_a_time` starts each bucket's hook only once the previous bucket's
future completed, from that future's callback, so every rank issues the same collectives
in the same order; backward is never blocked. (scaleout's engine does the same for its own
multi-round codecs: an ``exclusive`` job holds its lane.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["one_bucket_at_a_time"]

Hook = Callable[[Any, Any], "torch.futures.Future[torch.Tensor]"]


def one_bucket_at_a_time(hook: Hook) -> Hook:
    """``hook``, each bucket started after the previous bucket's result is complete.

    Example:
        >>> from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
        >>> safe = one_bucket_at_a_time(powerSGD_hook.powerSGD_hook)
        >>> callable(safe)
        True
    """
    tail: torch.futures.Future[Any] | None = None  # the last bucket's result

    # (no annotations: DDP's register_comm_hook rejects a bucket annotated other than
    # dist.GradBucket, and this module's annotations are strings)
    def ordered(state, bucket):  # type: ignore[no-untyped-def]
        nonlocal tail  # (DDP's reducer calls its hook from one thread at a time)
        result: torch.futures.Future[torch.Tensor] = torch.futures.Future()

        def start(_previous: Any = None) -> None:
            try:
                inner = hook(state, bucket)
            except Exception as err:  # noqa: BLE001 - handed to DDP through the future
                result.set_exception(err)
                return

            def finish(done: torch.futures.Future[torch.Tensor]) -> None:
                try:
                    value = done.value()
                except Exception as err:  # noqa: BLE001 - as above
                    result.set_exception(err)
                    return
                result.set_result(value)
            inner.add_done_callback(finish)

        previous, tail = tail, result
        if previous is None:
            start()
        else:
            previous.add_done_callback(start)  # runs at once if it is already complete
        return result

    return ordered
