"""The check that every rank called the same collective (operation, dtype, shape, op, root),
and the once-per-plan variant for persistent layouts. No pickle: a digest, and on a mismatch
the ranks' descriptions as UTF-8 bytes."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from scaleout.core.communicator import Communicator, all_gather_single

__all__ = ["exchange_device", "verify_plan", "verify_counts", "text_tensor", "tensor_text"]


_DESCRIPTION_BYTES = 240


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
    error = ValueError(f"rank {comm.global_rank}: {operation} on group {comm.label}: the ranks "
                       f"called different collectives (operation, dtype, shape, op or root): "
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


def _verify_same_call(comm: Communicator, operation: str, tensor: torch.Tensor,
                      extra: tuple[object, ...], rows_may_differ: bool) -> None:
    """Exchange a signature of this call and raise if any member's differs."""
    shape = f"(*, {', '.join(map(str, tensor.shape[1:]))})" if rows_may_differ else \
        str(tuple(tensor.shape))
    args = "".join(f", {getattr(e, 'name', e)}" for e in extra)
    description = f"{operation}({str(tensor.dtype).removeprefix('torch.')}, shape {shape}{args})"
    if comm.needs_check(description):
        _same_everywhere(comm, operation, description)


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
