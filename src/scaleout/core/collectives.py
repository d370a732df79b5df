"""Non-blocking collectives over one communicator (a process group and its ranks).

Every function checks its arguments on the calling rank, starts the operation through
``torch.distributed`` with ``async_op=True`` and returns a :class:`~scaleout.core.request.Request`.
Tensors are laid out by dim 0: a rank's block of an allgather or scatter is a slice of rows.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as tdist

from scaleout.core.checks import check_counts, check_divisible, check_root, check_tensor
from scaleout.core.errors import CommunicationError
from scaleout.core.request import Request, WorkRequest

__all__ = [
    "CHECK_MODES", "ReduceOp", "Communicator", "allreduce", "reduce", "bcast", "allgather",
    "allgatherv", "gather", "scatter", "reduce_scatter", "alltoall", "alltoallv", "barrier",
    "verify_plan", "average_into",
]


CHECK_MODES = ("off", "first", "full")


class ReduceOp(enum.Enum):
    """Reductions. ``AVG`` is a sum divided by the group size (floating dtypes only)."""

    SUM = "sum"
    MIN = "min"
    MAX = "max"
    AVG = "avg"


# torch >= 2.10 names these *_single (the *_tensor names warn); older releases lack them.
all_gather_single = getattr(tdist, "all_gather_single", tdist.all_gather_into_tensor)
reduce_scatter_single = getattr(tdist, "reduce_scatter_single", tdist.reduce_scatter_tensor)

_TORCH_OPS = {
    ReduceOp.SUM: tdist.ReduceOp.SUM,
    ReduceOp.MIN: tdist.ReduceOp.MIN,
    ReduceOp.MAX: tdist.ReduceOp.MAX,
    ReduceOp.AVG: tdist.ReduceOp.SUM,  # divided by the size when the request finishes
}


@dataclass(frozen=True, kw_only=True)
class Communicator:
    """One group of ranks as seen from one member.

    Attributes:
        group: the torch.distributed process group.
        ranks: the global ranks of the members, in group-rank order.
        name: the group's name in error messages (``"data"``, ``"model"``, ``"global"``).
        global_rank: this process's global rank.
        timeout: default seconds a wait may block.
        check_consistency: verify that every member called the same operation with the same
            dtype, shape, reduce op and root (one small extra exchange per checked call):
            ``"full"`` before every call, ``"first"`` the first time each distinct call
            occurs on this communicator (a training loop's repeated calls cost nothing after
            the first iteration), ``"off"``; ``True``/``False`` mean ``"full"``/``"off"``.
    """

    group: Any
    ranks: tuple[int, ...]
    name: str
    global_rank: int
    timeout: float
    check_consistency: bool | str = "off"
    _seen: set[str] = field(default_factory=set, compare=False, repr=False)

    def __post_init__(self) -> None:
        mode = {True: "full", False: "off"}.get(self.check_consistency, self.check_consistency)
        if mode not in CHECK_MODES:
            raise ValueError(f"check_consistency must be one of {CHECK_MODES} or a bool, got "
                             f"{self.check_consistency!r}")
        object.__setattr__(self, "check_consistency", mode)

    def needs_check(self, description: str) -> bool:
        """Whether a call described so must be verified across ranks now (and remember it)."""
        if self.check_consistency == "full":
            return True
        if self.check_consistency == "off" or description in self._seen:
            return False
        self._seen.add(description)
        return True

    def forget(self, description: str) -> None:
        """Drop a call the ranks did not agree on from the remembered ones."""
        self._seen.discard(description)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        return self.ranks.index(self.global_rank)

    def request(self, operation: str, works: Sequence[Any], finish: Callable[[], Any],
                nbytes: int = 0) -> Request:
        return WorkRequest(works, finish, rank=self.global_rank, group=self.label,
                           operation=operation, timeout=self.timeout, nbytes=nbytes)

    @property
    def label(self) -> str:
        return f"{self.name}{list(self.ranks)}"

    @classmethod
    def of_group(cls, group: Any = None, *, name: str = "group",
                 timeout: float = 300.0) -> Communicator:
        """The communicator of a plain torch.distributed process group (``None``: the
        default group), for code outside a scaleout Distribution (torch's DDP hooks, say)."""
        ranks = tuple(tdist.get_process_group_ranks(group or tdist.group.WORLD))
        return cls(group=group, ranks=ranks, name=name, global_rank=tdist.get_rank(),
                   timeout=timeout)

    @classmethod
    def alone(cls, *, timeout: float = 300.0) -> Communicator:
        """A group of this process alone: every collective completes at once, with no
        process group and on any device (to run a codec's exchange by itself)."""
        return cls(group=None, ranks=(0,), name="alone", global_rank=0, timeout=timeout)


class _LocalWork:
    """What a collective on a group of one returns: done at once, no library call (so a
    one-rank group needs no process group at all, and any device, ``meta`` too, works)."""

    def __init__(self) -> None:
        self._future = torch.futures.Future()
        self._future.set_result(None)

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> Any:
        return self._future


def _start(comm: Communicator, operation: str, start: Callable[[], Any],
           local: Callable[[], Any] = lambda: None) -> Any:
    """Start a collective; on a group of one, ``local()`` gives its result instead (for
    in-place collectives the input already is the result)."""
    if comm.size == 1:
        local()
        return _LocalWork()
    try:
        return start()
    except (RuntimeError, ValueError) as err:
        raise CommunicationError(
            f"rank {comm.global_rank}: {operation} on group {comm.label} could not start: {err}",
            rank=comm.global_rank, group=comm.label, operation=operation,
        ) from err


_DESCRIPTION_BYTES = 240


def _same_everywhere(comm: Communicator, operation: str, description: str) -> None:
    """Raise ValueError naming every rank's ``description`` unless all ranks passed the same.

    One 8-byte allgather of a digest; only on a mismatch, a second one of the descriptions
    (UTF-8 in a uint8 tensor, never a pickle) so that the error names each rank's call.
    """
    digest = int.from_bytes(hashlib.blake2b(description.encode(), digest_size=7).digest(), "little")
    mine = torch.tensor([digest], dtype=torch.int64)
    every = torch.empty(comm.size, dtype=torch.int64)
    work = all_gather_single(every, mine, group=comm.group, async_op=True)
    comm.request(f"{operation} (consistency check)", [work], lambda: None).wait()
    if len(set(every.tolist())) == 1:
        return
    comm.forget(description)  # only agreed calls are remembered: the ranks' memories stay equal
    text = torch.zeros(_DESCRIPTION_BYTES, dtype=torch.uint8)
    raw = description.encode()[:_DESCRIPTION_BYTES]
    text[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    texts = torch.empty(comm.size * _DESCRIPTION_BYTES, dtype=torch.uint8)
    work = all_gather_single(texts, text, group=comm.group, async_op=True)
    comm.request(f"{operation} (consistency report)", [work], lambda: None).wait()
    calls = [bytes(part.tolist()).rstrip(b"\0").decode(errors="replace")
             for part in texts.split(_DESCRIPTION_BYTES)]
    listing = "; ".join(f"rank {comm.ranks[i]}: {call}" for i, call in enumerate(calls))
    raise ValueError(f"rank {comm.global_rank}: {operation} on group {comm.label}: the ranks "
                     f"called different collectives (operation, dtype, shape, op or root): "
                     f"{listing}")


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


def _checked(comm: Communicator, operation: str, tensor: object, *extra: object,
             rows_may_differ: bool = False) -> torch.Tensor:
    tensor = check_tensor(tensor, operation)
    if comm.check_consistency != "off" and comm.size > 1:
        _verify_same_call(comm, operation, tensor, extra, rows_may_differ)
    return tensor


def _op(op: object, dtype: torch.dtype, operation: str) -> ReduceOp:
    if not isinstance(op, ReduceOp):
        raise TypeError(f"{operation}: op must be a scaleout.ReduceOp, got {op!r}")
    if op is ReduceOp.AVG and not dtype.is_floating_point:
        raise TypeError(f"{operation}: ReduceOp.AVG needs a floating dtype, got {dtype}")
    return op


def _output(out: object, shape: tuple[int, ...], like: torch.Tensor, operation: str) -> torch.Tensor:
    """``out`` checked to receive a result of ``shape`` (or a new tensor when it is None)."""
    if out is None:
        return like.new_empty(shape)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{operation}: out must be a torch.Tensor, got {type(out).__name__}")
    if out.dtype != like.dtype:
        raise TypeError(f"{operation}: out must have dtype {like.dtype}, got {out.dtype}")
    if tuple(out.shape) != tuple(shape) or not out.is_contiguous():
        raise ValueError(f"{operation}: out must be a contiguous tensor of shape {tuple(shape)}, "
                         f"got shape {tuple(out.shape)}"
                         f"{'' if out.is_contiguous() else ' (not contiguous)'}")
    return out


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(1) if tensor.dim() == 0 else tensor.contiguous()


def average_into(target: torch.Tensor, summed: torch.Tensor, divisor: int) -> torch.Tensor:
    """``target = summed / divisor`` in one pass: scaleout's one averaging site.

    ``summed`` may be ``target`` itself, another buffer of its dtype, or a narrower float
    (a codec's fp16/bf16 sum, widened exactly and divided in ``target``'s dtype) or a wider
    one (divided before it is narrowed).
    ``divisor`` 1 copies (or does nothing when ``summed`` is ``target``).
    """
    summed = summed.reshape(target.shape)
    if divisor == 1:
        if summed.data_ptr() != target.data_ptr() or summed.dtype != target.dtype:
            target.copy_(summed)
    elif summed.dtype == target.dtype:
        torch.div(summed, divisor, out=target)
    elif summed.element_size() < target.element_size():
        target.copy_(summed).div_(divisor)  # widen exactly, divide in the wide type
    else:
        target.copy_(summed / divisor)  # divide in the wider type, then narrow
    return target


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def allreduce(comm: Communicator, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> Request:
    """Reduce ``tensor`` over the group, in place on every rank."""
    name = "allreduce"
    tensor = _checked(comm, name, tensor, op)
    op = _op(op, tensor.dtype, name)
    buffer = tensor if tensor.is_contiguous() else tensor.contiguous()
    work = _start(comm, name, lambda: tdist.all_reduce(
        buffer, op=_TORCH_OPS[op], group=comm.group, async_op=True))
    divisor = comm.size if op is ReduceOp.AVG else 1
    return comm.request(name, [work], lambda: average_into(tensor, buffer, divisor),
                        _nbytes(buffer))


def reduce(comm: Communicator, tensor: torch.Tensor, root: int,
           op: ReduceOp = ReduceOp.SUM) -> Request:
    """Reduce ``tensor`` onto group rank ``root`` (in place there; others' contents undefined)."""
    name = "reduce"
    root = check_root(root, comm.size, name, comm.label)
    tensor = _checked(comm, name, tensor, op, root)
    op = _op(op, tensor.dtype, name)
    buffer = tensor if tensor.is_contiguous() else tensor.contiguous()
    work = _start(comm, name, lambda: tdist.reduce(
        buffer, dst=comm.ranks[root], op=_TORCH_OPS[op], group=comm.group, async_op=True))
    divisor = comm.size if op is ReduceOp.AVG and comm.rank == root else 1
    return comm.request(name, [work], lambda: average_into(tensor, buffer, divisor))


def bcast(comm: Communicator, tensor: torch.Tensor, root: int) -> Request:
    """Broadcast group rank ``root``'s ``tensor`` into every rank's ``tensor``."""
    name = "bcast"
    root = check_root(root, comm.size, name, comm.label)
    tensor = _checked(comm, name, tensor, root)
    buffer = tensor if tensor.is_contiguous() else tensor.contiguous()
    work = _start(comm, name, lambda: tdist.broadcast(
        buffer, src=comm.ranks[root], group=comm.group, async_op=True))
    return comm.request(name, [work], lambda: average_into(tensor, buffer, 1))


def allgather(comm: Communicator, tensor: torch.Tensor, out: torch.Tensor | None = None) -> Request:
    """Concatenate every rank's ``tensor`` along dim 0 (0-d tensors count as one row).

    The result has shape ``(size * tensor.shape[0], *tensor.shape[1:])`` on every rank; it
    is written into ``out`` when given (reuse one buffer across iterations).
    """
    name = "allgather"
    send = _rows(_checked(comm, name, tensor))
    out = _output(out, (comm.size * send.shape[0], *send.shape[1:]), send, name)
    work = _start(comm, name, lambda: all_gather_single(
        out, send, group=comm.group, async_op=True), lambda: out.copy_(send))
    return comm.request(name, [work], lambda: out, _nbytes(send))


def allgatherv(comm: Communicator, tensor: torch.Tensor, counts: Sequence[int]) -> Request:
    """Concatenate every rank's rows along dim 0, rank ``i`` contributing ``counts[i]`` rows."""
    name = "allgatherv"
    counts = check_counts(counts, comm.size, "counts", name)
    send = _rows(_checked(comm, name, tensor, counts, rows_may_differ=True))
    if send.shape[0] != counts[comm.rank]:
        raise ValueError(
            f"{name}: this rank (group rank {comm.rank}) must pass counts[{comm.rank}] = "
            f"{counts[comm.rank]} rows, got a tensor of shape {tuple(send.shape)}"
        )
    longest = max(counts)
    if send.shape[0] != longest:
        padded = send.new_zeros((longest, *send.shape[1:]))
        padded[: send.shape[0]] = send
        send = padded
    out = send.new_empty((comm.size * longest, *send.shape[1:]))
    work = _start(comm, name, lambda: all_gather_single(
        out, send, group=comm.group, async_op=True), lambda: out.copy_(send))

    def finish() -> torch.Tensor:
        if all(c == longest for c in counts):
            return out
        return torch.cat([out[i * longest: i * longest + c] for i, c in enumerate(counts)])

    return comm.request(name, [work], finish, sum(counts) * _nbytes(send[:1]))


def gather(comm: Communicator, tensor: torch.Tensor, root: int) -> Request:
    """Concatenate every rank's ``tensor`` along dim 0 on group rank ``root``.

    ``wait()`` returns the concatenation on the root and ``None`` on the other ranks.
    """
    name = "gather"
    root = check_root(root, comm.size, name, comm.label)
    send = _rows(_checked(comm, name, tensor, root))
    parts = [torch.empty_like(send) for _ in range(comm.size)] if comm.rank == root else None
    work = _start(comm, name, lambda: tdist.gather(
        send, parts, dst=comm.ranks[root], group=comm.group, async_op=True),
        lambda: parts[0].copy_(send))
    return comm.request(name, [work], lambda: torch.cat(parts) if parts is not None else None)


def scatter(comm: Communicator, tensor: torch.Tensor, root: int,
            out: torch.Tensor | None = None) -> Request:
    """Split group rank ``root``'s ``tensor`` into ``size`` equal row blocks; rank i gets block i.

    Every rank passes a tensor of the same shape (only the root's contents are read);
    ``wait()`` returns this rank's block, of shape ``(rows / size, *tensor.shape[1:])``.
    """
    name = "scatter"
    root = check_root(root, comm.size, name, comm.label)
    tensor = _checked(comm, name, tensor, root)
    rows = check_divisible(tensor, comm.size, name)
    out = _output(out, (rows, *tensor.shape[1:]), tensor, name)
    parts = list(tensor.contiguous().split(rows)) if comm.rank == root else None
    work = _start(comm, name, lambda: tdist.scatter(
        out, parts, src=comm.ranks[root], group=comm.group, async_op=True),
        lambda: out.copy_(parts[0]))
    return comm.request(name, [work], lambda: out)


def reduce_scatter(comm: Communicator, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
                   out: torch.Tensor | None = None) -> Request:
    """Reduce ``tensor`` over the group and give rank i the i-th of ``size`` equal row blocks."""
    name = "reduce_scatter"
    tensor = _checked(comm, name, tensor, op)
    op = _op(op, tensor.dtype, name)
    rows = check_divisible(tensor, comm.size, name)
    out = _output(out, (rows, *tensor.shape[1:]), tensor, name)
    send = tensor.contiguous()
    work = _start(comm, name, lambda: reduce_scatter_single(
        out, send, op=_TORCH_OPS[op], group=comm.group, async_op=True), lambda: out.copy_(send))
    divisor = comm.size if op is ReduceOp.AVG else 1
    return comm.request(name, [work], lambda: average_into(out, out, divisor), _nbytes(send))


def alltoall(comm: Communicator, tensor: torch.Tensor, out: torch.Tensor | None = None) -> Request:
    """Send row block j of ``tensor`` to rank j; result block i came from rank i."""
    name = "alltoall"
    tensor = _checked(comm, name, tensor)
    check_divisible(tensor, comm.size, name)
    send = tensor.contiguous()
    out = _output(out, tuple(send.shape), send, name)
    work = _start(comm, name, lambda: tdist.all_to_all_single(
        out, send, group=comm.group, async_op=True), lambda: out.copy_(send))
    return comm.request(name, [work], lambda: out)


def alltoallv(comm: Communicator, tensor: torch.Tensor, send_counts: Sequence[int],
              recv_counts: Sequence[int], out: torch.Tensor | None = None) -> Request:
    """Send ``send_counts[j]`` rows to rank j; receive ``recv_counts[i]`` rows from rank i."""
    name = "alltoallv"
    send_counts = check_counts(send_counts, comm.size, "send_counts", name)
    recv_counts = check_counts(recv_counts, comm.size, "recv_counts", name)
    send = _rows(_checked(comm, name, tensor, rows_may_differ=True))
    if send.shape[0] != sum(send_counts):
        raise ValueError(
            f"{name}: tensor must have sum(send_counts) = {sum(send_counts)} rows, "
            f"got shape {tuple(send.shape)}"
        )
    out = _output(out, (sum(recv_counts), *send.shape[1:]), send, name)
    work = _start(comm, name, lambda: tdist.all_to_all_single(
        out, send, output_split_sizes=recv_counts, input_split_sizes=send_counts,
        group=comm.group, async_op=True), lambda: out.copy_(send))
    return comm.request(name, [work], lambda: out)


def barrier(comm: Communicator, timeout: float | None = None) -> None:
    """Block until every rank of the group arrives (or raise after ``timeout`` seconds)."""
    name = "barrier"
    if comm.needs_check("barrier()"):
        _same_everywhere(comm, name, "barrier()")
    work = _start(comm, name, lambda: tdist.barrier(group=comm.group, async_op=True))
    comm.request(name, [work], lambda: None).wait(timeout)


