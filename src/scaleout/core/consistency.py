"""The check that every rank called the same collective (operation, dtype, shape, op, root)
and that none refused its arguments, and the once-per-plan variant for persistent layouts. No pickle: a digest, and on a mismatch
the ranks' descriptions as UTF-8 bytes."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from scaleout.core import progress
from scaleout.core.checks import check_tensor
from scaleout.core.communicator import Communicator, all_gather_single
from scaleout.core.errors import ScaleoutError

__all__ = ["CallCheck", "exchange_device", "control_tensor", "verify_plan", "verify_counts",
           "text_tensor", "tensor_text"]


_DESCRIPTION_BYTES = 480
_REFUSED = "refused here:"


def _same_everywhere(comm: Communicator, operation: str, description: str) -> None:
    """Raise ValueError naming every rank's ``description`` unless all ranks passed the same.

    One 8-byte allgather of a digest; only on a mismatch, a second one of the descriptions
    (UTF-8 in a uint8 tensor, never a pickle) so that the error names each rank's call.
    """
    if comm.size == 1:
        return
    device = exchange_device(comm.group)
    digest = int.from_bytes(hashlib.blake2b(description.encode(), digest_size=7).digest(), "little")
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    every = torch.empty(comm.size, dtype=torch.int64, device=device)
    work = all_gather_single(every, mine, group=comm.group, async_op=True)
    comm.request(f"{operation} (consistency check)", [work], lambda: None).wait()
    if len(set(every.tolist())) == 1:
        return
    comm.forget(description)  # only agreed calls are remembered: the ranks' memories stay equal
    text = text_tensor(description, _DESCRIPTION_BYTES).to(device)
    texts = torch.empty(comm.size * _DESCRIPTION_BYTES, dtype=torch.uint8, device=device)
    work = all_gather_single(texts, text, group=comm.group, async_op=True)
    comm.request(f"{operation} (consistency report)", [work], lambda: None).wait()
    calls = [tensor_text(part) for part in texts.split(_DESCRIPTION_BYTES)]
    listing = "; ".join(f"rank {comm.ranks[i]}: {call}" for i, call in enumerate(calls))
    refusing = [str(comm.ranks[i]) for i, call in enumerate(calls) if _REFUSED in call]
    what = (f"rank{'s' * (len(refusing) > 1)} {', '.join(refusing)} refused the call's "
            f"arguments" if refusing else "the ranks called different collectives "
            "(operation, dtype, shape, op or root)")
    error = ValueError(f"rank {comm.global_rank}: {operation} on group {comm.label}: {what}: "
                       f"{listing}")
    error.collective_mismatch = True  # type: ignore[attr-defined]  # (uncaught: a quick exit)
    raise error


def text_tensor(text: str, nbytes: int) -> torch.Tensor:
    """``text`` as UTF-8 in a zero-padded uint8 tensor of ``nbytes`` (cut there): text that
    travels in a collective, never a pickle."""
    out = torch.zeros(nbytes, dtype=torch.uint8)
    raw = text.encode()[:nbytes]
    if raw:  # (frombuffer refuses an empty buffer)
        out[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return out


def tensor_text(tensor: torch.Tensor) -> str:
    """The text of a :func:`text_tensor` (a cut character becomes U+FFFD)."""
    return bytes(tensor.tolist()).rstrip(b"\0").decode(errors="replace")


def exchange_device(group: Any = None) -> torch.device:
    """Where a small control tensor exchanged on torch process group ``group`` (``None``: the
    default group) must live: the current GPU on a group that only NCCL serves (it has no CPU
    backend), else the CPU."""
    try:
        backend = str(dist.get_backend(group))
    except (RuntimeError, ValueError):  # not a torch process group (a group of one)
        return torch.device("cpu")
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def control_tensor(comm: Communicator, values: Sequence[Any],
                   dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``values`` (counts, lengths, flags) as a tensor where a collective on ``comm`` can
    carry it (:func:`exchange_device`: the GPU on a group that only NCCL serves)."""
    return torch.tensor(values, dtype=dtype, device=exchange_device(comm.group))


class CallCheck:
    """A collective's argument checks, and the check that every rank called the same one.

    Use as ``with CallCheck(comm, name) as call:`` around all of a call's argument checks;
    :meth:`tensor` checks the tensor, :meth:`describe` names the call once its arguments
    that every rank must share are known. On leaving, every member's description is compared
    when ``comm`` checks this call (:meth:`Communicator.needs_check`). A TypeError or
    ValueError raised inside travels too: where the other ranks check this call, this rank
    takes part in their exchange with its refusal in its description, so they raise a
    ValueError naming it instead of waiting in a collective this rank never starts (and a
    later call of this rank does not meet theirs in gloo). Then the refusal itself is raised
    here. Where they do not check (``"first"`` and a call made before, ``"off"``), it is
    raised here alone; the heartbeats carry it, so their timeouts name it.
    """

    def __init__(self, comm: Communicator, operation: str) -> None:
        self.comm, self.operation = comm, operation
        self.description: str | None = None

    def tensor(self, tensor: object) -> torch.Tensor:
        """``tensor`` checked, below autograd (as torch's collectives: the results land in its
        memory; an ``nn.Parameter``'s small all-reduce failed, its AVG too)."""
        tensor = check_tensor(tensor, self.operation)
        return tensor.detach() if tensor.requires_grad else tensor

    def describe(self, tensor: torch.Tensor, *extra: object,
                 rows_may_differ: bool = False) -> None:
        """Name the call by ``tensor``'s dtype and shape (rows left out when they may differ
        between the ranks) and ``extra`` (reduce op, root, counts, path settings)."""
        if self.comm.check_consistency == "off" or self.comm.size == 1:
            return  # (nothing compares it)
        shape = f"(*, {', '.join(map(str, tensor.shape[1:]))})" if rows_may_differ else \
            str(tuple(tensor.shape))
        args = "".join(f", {getattr(e, 'name', e)}" for e in extra)
        self.description = \
            f"{self.operation}({str(tensor.dtype).removeprefix('torch.')}, shape {shape}{args})"

    def __enter__(self) -> CallCheck:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        comm, description = self.comm, self.description
        if error is None:
            if description is not None and comm.size > 1 and comm.needs_check(description):
                _same_everywhere(comm, self.operation, description)
        elif isinstance(error, (TypeError, ValueError)):
            self._refused(error)

    def _refused(self, error: Exception) -> None:
        comm, description = self.comm, self.description
        progress.refused(comm.label, str(error))
        if comm.size == 1:
            return
        if (description is None and comm.check_consistency != "full") or \
                (description is not None and not comm.would_check(description)):
            # The others may be inside the call: an uncaught refusal exits at once (a teardown
            # that met their collective in gloo would abort).
            error.collective_mismatch = True  # type: ignore[attr-defined]
            return
        try:
            _same_everywhere(comm, self.operation,
                             f"{description or self.operation + '(...)'} {_REFUSED} {error}")
        except ValueError:
            pass  # (the others' call differs from this refusal: they raise it too)
        except ScaleoutError as failure:  # (they never came: the refusal stays the error)
            error.add_note(f"(telling the other ranks failed: {failure})")


def verify_plan(comm: Communicator, name: str, layout: object) -> None:
    """Check once that every rank of ``comm`` built the same plan (bucket layout, sizes, ...).

    For persistent plans: verifying the layout when it is built catches what a per-call
    check would catch, at the cost of one small exchange per plan instead of per call.
    Every rank must call it at the same point.

    Args:
        comm: the communicator the plan will run on.
        name: what the plan is, for the error message ("bucket plan").
        layout: a value whose ``repr`` describes the plan (equal on every rank).

    Raises:
        ValueError: the ranks' layouts differ; names every rank's layout.
    """
    _same_everywhere(comm, name, f"{name} {layout!r}")


def verify_counts(comm: Communicator, name: str, send_counts: Sequence[int],
                  recv_counts: Sequence[int]) -> None:
    """Raise ValueError on every rank unless what each rank sends each other is what that
    one expects from it (one allgather of ``2 * size`` ints; ``"full"`` checks only: counts
    change with every call, and ``"first"`` checks each distinct call once). Unchecked, a
    rank that expects one row more gets a row of uninitialised memory, silently."""
    device = exchange_device(comm.group)
    mine = torch.tensor([*send_counts, *recv_counts], dtype=torch.int64, device=device)
    every = torch.empty(2 * comm.size * comm.size, dtype=torch.int64, device=device)
    work = all_gather_single(every, mine, group=comm.group, async_op=True)
    comm.request(f"{name} (counts check)", [work], lambda: None).wait()
    table = every.view(comm.size, 2, comm.size).tolist()  # [rank][sends, expects][peer]
    for i in range(comm.size):
        for j in range(comm.size):
            if table[i][0][j] != table[j][1][i]:
                raise ValueError(f"rank {comm.global_rank}: {name} on group {comm.label}: "
                                 f"group rank {i} sends {table[i][0][j]} rows to group rank "
                                 f"{j}, which expects {table[j][1][i]} (send_counts and "
                                 f"recv_counts must match across the ranks)")
