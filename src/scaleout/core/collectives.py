"""Non-blocking collectives over one communicator (a process group and its ranks).

Every function checks its arguments on the calling rank, starts the operation through
``torch.distributed`` with ``async_op=True`` and returns a :class:`~scaleout.core.request.Request`.
Tensors are laid out by dim 0: a rank's block of an allgather or scatter is a slice of rows.
The communicator and the reductions live in :mod:`scaleout.core.communicator`, the check that
every rank called the same collective in :mod:`scaleout.core.consistency`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as tdist

from scaleout.core import direct
from scaleout.core.checks import check_counts, check_divisible, check_root, overlaps
from scaleout.core.communicator import (
    _TORCH_OPS,
    CHECK_MODES,
    Communicator,
    ReduceOp,
    _start,
    all_gather_single,
    reduce_scatter_single,
)
from scaleout.core.consistency import CallCheck, _same_everywhere, verify_counts, verify_plan
from scaleout.core.pairwise import exchange_blocks, recv_first
from scaleout.core.pairwise import setting as pairwise_setting
from scaleout.core.request import Request

__all__ = [
    "CHECK_MODES", "ReduceOp", "Communicator", "allreduce", "reduce", "bcast", "allgather",
    "allgatherv", "gather", "scatter", "reduce_scatter", "alltoall", "alltoallv", "barrier",
    "verify_plan", "average_into", "all_gather_single", "reduce_scatter_single",
]


def _op(op: object, dtype: torch.dtype, operation: str) -> ReduceOp:
    if not isinstance(op, ReduceOp):
        raise TypeError(f"{operation}: op must be a scaleout.ReduceOp, got {op!r}")
    if op is ReduceOp.AVG and not dtype.is_floating_point:
        raise TypeError(f"{operation}: ReduceOp.AVG needs a floating dtype, got {dtype}")
    return op


def _output(out: object, shape: tuple[int, ...], like: torch.Tensor, operation: str,
            apart: bool = False) -> torch.Tensor:
    """``out`` checked to receive a result of ``shape`` (or a new tensor when it is None);
    ``apart``: it must not overlap ``like`` (a collective that writes blocks of ``out`` while
    it still sends those of ``like``: an overlapping ``out`` came back with wrong data)."""
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
    if apart and overlaps(out, like):
        raise ValueError(f"{operation}: out must not overlap the tensor sent (it would be "
                         f"overwritten while it is sent); pass another buffer")
    return out


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(1) if tensor.dim() == 0 else tensor.contiguous()


def average_into(target: torch.Tensor, summed: torch.Tensor, divisor: float) -> torch.Tensor:
    """``target = summed / divisor`` in one pass: scaleout's one averaging site.

    ``summed`` may be ``target`` itself, another buffer of its dtype, or a narrower float
    (a codec's fp16/bf16 sum, widened exactly and divided in ``target``'s dtype) or a wider
    one (divided before it is narrowed).
    ``divisor`` 1 copies (or does nothing when ``summed`` is ``target``).
    """
    if summed is target and divisor == 1:  # (an in-place sum: nothing to do, no torch call)
        return target
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


def _row_bytes(tensor: torch.Tensor) -> int:
    """Bytes of one row of ``tensor`` (of at least one dimension), however many rows this
    rank holds: the same on every rank, even one that sends none."""
    return math.prod(tensor.shape[1:]) * tensor.element_size()


def _crossing(send_counts: Sequence[int], recv_counts: Sequence[int], rank: int) -> int:
    """The largest block between this rank and another in an all-to-all-v, in rows. At 2
    ranks both ranks see the same two blocks, so they decide alike on it; a rank's block to
    itself, which no other rank sees, does not count."""
    return max((n for j, pair in enumerate(zip(send_counts, recv_counts)) if j != rank
                for n in pair), default=0)


def _blocks(comm: Communicator, name: str, sends: Sequence[torch.Tensor],
            recvs: Sequence[torch.Tensor]) -> list[object]:
    """Start :func:`~scaleout.core.pairwise.exchange_blocks` (gloo, receives posted first)."""
    def start() -> list[object]:  # (alone: it only copies this rank's own block)
        return exchange_blocks(comm.group, comm.ranks, comm.rank, sends, recvs, comm.timeout)

    works = _start(comm, name, start, start)
    return works if isinstance(works, list) else [works]


def allreduce(comm: Communicator, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> Request:
    """Reduce ``tensor`` over the group, in place on every rank (a small CPU tensor on gloo
    in one exchange: :mod:`scaleout.core.direct`)."""
    name = "allreduce"
    with CallCheck(comm, name) as call:
        tensor = call.tensor(tensor)
        op = _op(op, tensor.dtype, name)
        call.describe(tensor, op, *direct.setting())
    buffer = tensor if tensor.is_contiguous() else tensor.contiguous()
    divisor = comm.size if op is ReduceOp.AVG else 1
    if op in _COMBINE and direct.applies(comm.group, buffer, comm.size):
        return _allreduce_direct(comm, name, tensor, buffer, op, divisor)
    work = _start(comm, name, lambda: tdist.all_reduce(
        buffer, op=_TORCH_OPS[op], group=comm.group, async_op=True))
    return comm.request(name, [work], lambda: average_into(tensor, buffer, divisor),
                        _nbytes(buffer))


def _allreduce_direct(comm: Communicator, name: str, tensor: torch.Tensor,
                      buffer: torch.Tensor, op: ReduceOp, divisor: int) -> Request:
    """Every rank's whole ``buffer`` to every other rank in one all-to-all of ``size`` copies
    of it, reduced here in rank order. (Through gloo's own all-to-all: a direct tensor, 96 KB
    at most, is under the receive-first exchange's blocks.)"""
    flat = buffer.reshape(-1)
    received = flat.new_empty((comm.size, flat.numel()))
    send = flat.repeat(comm.size)
    work = _start(comm, name, lambda: tdist.all_to_all_single(
        received.view(-1), send, group=comm.group, async_op=True))

    def finish() -> torch.Tensor:
        direct.reduce_in_rank_order(received, flat, _COMBINE[op])
        return average_into(tensor, buffer, divisor)

    return comm.request(name, [work], finish, _nbytes(buffer))


def reduce(comm: Communicator, tensor: torch.Tensor, root: int,
           op: ReduceOp = ReduceOp.SUM) -> Request:
    """Reduce ``tensor`` onto group rank ``root`` (in place there; others' contents undefined)."""
    name = "reduce"
    with CallCheck(comm, name) as call:
        root = check_root(root, comm.size, name, comm.label)
        tensor = call.tensor(tensor)
        op = _op(op, tensor.dtype, name)
        call.describe(tensor, op, root)
    buffer = tensor if tensor.is_contiguous() else tensor.contiguous()
    work = _start(comm, name, lambda: tdist.reduce(
        buffer, dst=comm.ranks[root], op=_TORCH_OPS[op], group=comm.group, async_op=True))
    divisor = comm.size if op is ReduceOp.AVG and comm.rank == root else 1
    return comm.request(name, [work], lambda: average_into(tensor, buffer, divisor))


def bcast(comm: Communicator, tensor: torch.Tensor, root: int) -> Request:
    """Broadcast group rank ``root``'s ``tensor`` into every rank's ``tensor``."""
    name = "bcast"
    with CallCheck(comm, name) as call:
        root = check_root(root, comm.size, name, comm.label)
        tensor = call.tensor(tensor)
        call.describe(tensor, root)
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
    with CallCheck(comm, name) as call:
        send = _rows(call.tensor(tensor))
        call.describe(send, pairwise_setting())
        out = _output(out, (comm.size * send.shape[0], *send.shape[1:]), send, name)
    if recv_first(comm.group, send, _nbytes(send), ranks=comm.size, gather=True):
        works = _blocks(comm, name, [send] * comm.size, out.split([send.shape[0]] * comm.size))
        return comm.request(name, works, lambda: out, _nbytes(send))
    work = _start(comm, name, lambda: all_gather_single(
        out, send, group=comm.group, async_op=True), lambda: out.copy_(send))
    return comm.request(name, [work], lambda: out, _nbytes(send))


def allgatherv(comm: Communicator, tensor: torch.Tensor, counts: Sequence[int]) -> Request:
    """Concatenate every rank's rows along dim 0, rank ``i`` contributing ``counts[i]`` rows."""
    name = "allgatherv"
    with CallCheck(comm, name) as call:
        counts = check_counts(counts, comm.size, "counts", name)
        send = _rows(call.tensor(tensor))
        call.describe(send, counts, pairwise_setting(), rows_may_differ=True)
        if send.shape[0] != counts[comm.rank]:
            raise ValueError(
                f"{name}: this rank (group rank {comm.rank}) must pass counts[{comm.rank}] = "
                f"{counts[comm.rank]} rows, got a tensor of shape {tuple(send.shape)}"
            )
    if recv_first(comm.group, send, max(counts) * _row_bytes(send), ranks=comm.size,
                  gather=True):  # (counts are the same list everywhere: ranks decide alike)
        # no padding: every block travels at its own size
        out = send.new_empty((sum(counts), *send.shape[1:]))
        works = _blocks(comm, name, [send] * comm.size, out.split(list(counts)))
        return comm.request(name, works, lambda: out, sum(counts) * _row_bytes(send))
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
    with CallCheck(comm, name) as call:
        root = check_root(root, comm.size, name, comm.label)
        send = _rows(call.tensor(tensor))
        call.describe(send, root)
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
    with CallCheck(comm, name) as call:
        root = check_root(root, comm.size, name, comm.label)
        tensor = call.tensor(tensor)
        call.describe(tensor, root)
        rows = check_divisible(tensor, comm.size, name)
        out = _output(out, (rows, *tensor.shape[1:]), tensor, name, apart=True)
    whole = tensor.contiguous()  # (split(0) of an empty tensor gives one part, not size)
    parts = [whole[i * rows:(i + 1) * rows] for i in range(comm.size)] \
        if comm.rank == root else None
    work = _start(comm, name, lambda: tdist.scatter(
        out, parts, src=comm.ranks[root], group=comm.group, async_op=True),
        lambda: out.copy_(parts[0]))
    return comm.request(name, [work], lambda: out)


def reduce_scatter(comm: Communicator, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
                   out: torch.Tensor | None = None) -> Request:
    """Reduce ``tensor`` over the group and give rank i the i-th of ``size`` equal row blocks."""
    name = "reduce_scatter"
    with CallCheck(comm, name) as call:
        tensor = call.tensor(tensor)
        op = _op(op, tensor.dtype, name)
        call.describe(tensor, op, pairwise_setting())
        rows = check_divisible(tensor, comm.size, name)
        out = _output(out, (rows, *tensor.shape[1:]), tensor, name)
    send = tensor.contiguous()
    divisor = comm.size if op is ReduceOp.AVG else 1
    if recv_first(comm.group, send, _nbytes(send) // comm.size, ranks=comm.size):
        return _reduce_scatter_blocks(comm, name, send, out, op, divisor)
    work = _start(comm, name, lambda: reduce_scatter_single(
        out, send, op=_TORCH_OPS[op], group=comm.group, async_op=True), lambda: out.copy_(send))
    return comm.request(name, [work], lambda: average_into(out, out, divisor), _nbytes(send))


_COMBINE = {ReduceOp.SUM: torch.add, ReduceOp.AVG: torch.add, ReduceOp.MIN: torch.minimum,
            ReduceOp.MAX: torch.maximum}


def _reduce_scatter_blocks(comm: Communicator, name: str, send: torch.Tensor,
                           out: torch.Tensor, op: ReduceOp, divisor: int) -> Request:
    """A reduce-scatter as an all-to-all of the blocks (receives posted first), reduced here.

    Torch's gloo ``reduce_scatter_tensor`` all-reduces the whole input and keeps one block:
    ``2 (p-1)/p n`` bytes out of every rank. Sending block ``j`` to rank ``j`` moves the
    textbook ``(p-1)/p n`` (benchmarks/RESULTS.md §1, stop 24). The first peer's block is
    received straight into ``out`` (unless ``out`` overlaps the input), the others into one
    scratch buffer; the blocks are combined in a fixed order once all have arrived.
    """
    size, rank = comm.size, comm.rank
    blocks = send.split(out.shape[0])
    peers = [(rank - i) % size for i in range(1, size)]  # exchange_blocks' receive order
    start, end = send.data_ptr(), send.data_ptr() + _nbytes(send)
    direct = size > 1 and not (out.data_ptr() < end and start < out.data_ptr() + _nbytes(out))
    scratch = list(send.new_empty((size - 1 - direct, *out.shape)).unbind())
    recvs = list(blocks)  # recvs[rank] is this rank's own block: exchange_blocks' copy is a no-op
    for k, peer in enumerate(peers):
        recvs[peer] = out if direct and k == 0 else scratch[k - direct]
    combine = _COMBINE[op]

    def finish() -> torch.Tensor:
        own = blocks[rank]
        if not direct:  # out overlaps the input: nothing was received into it
            out.copy_(own if own.data_ptr() == out.data_ptr() else own.clone())
        for block in scratch:
            combine(out, block, out=out)
        if direct:
            combine(out, own, out=out)
        return average_into(out, out, divisor)

    return comm.request(name, _blocks(comm, name, blocks, recvs), finish, _nbytes(send))


def alltoall(comm: Communicator, tensor: torch.Tensor, out: torch.Tensor | None = None) -> Request:
    """Send row block j of ``tensor`` to rank j; result block i came from rank i."""
    name = "alltoall"
    with CallCheck(comm, name) as call:
        tensor = call.tensor(tensor)
        call.describe(tensor, pairwise_setting())
        check_divisible(tensor, comm.size, name)
        send = tensor.contiguous()
        out = _output(out, tuple(send.shape), send, name, apart=True)
    if recv_first(comm.group, send, _nbytes(send) // comm.size, ranks=comm.size):
        rows = [send.shape[0] // comm.size] * comm.size
        return comm.request(name, _blocks(comm, name, send.split(rows), out.split(rows)),
                            lambda: out, _nbytes(send))
    work = _start(comm, name, lambda: tdist.all_to_all_single(
        out, send, group=comm.group, async_op=True), lambda: out.copy_(send))
    return comm.request(name, [work], lambda: out, _nbytes(send))


def alltoallv(comm: Communicator, tensor: torch.Tensor, send_counts: Sequence[int],
              recv_counts: Sequence[int], out: torch.Tensor | None = None) -> Request:
    """Send ``send_counts[j]`` rows to rank j; receive ``recv_counts[i]`` rows from rank i."""
    name = "alltoallv"
    with CallCheck(comm, name) as call:
        send = _rows(call.tensor(tensor))
        call.describe(send, pairwise_setting(), rows_may_differ=True)
        send_counts = check_counts(send_counts, comm.size, "send_counts", name)
        recv_counts = check_counts(recv_counts, comm.size, "recv_counts", name)
        if send.shape[0] != sum(send_counts):
            raise ValueError(
                f"{name}: tensor must have sum(send_counts) = {sum(send_counts)} rows, "
                f"got shape {tuple(send.shape)}"
            )
        out = _output(out, (sum(recv_counts), *send.shape[1:]), send, name, apart=True)
    if comm.size > 1 and comm.check_consistency == "full":
        verify_counts(comm, name, send_counts, recv_counts)
    # Every rank must take the same path. Each knows only its own row and column of the
    # counts, so the exchange is taken at 2 ranks only, where both see the same blocks.
    if comm.size == 2 and recv_first(
            comm.group, send, _crossing(send_counts, recv_counts, comm.rank) * _row_bytes(send),
            ranks=comm.size):
        works = _blocks(comm, name, send.split(list(send_counts)), out.split(list(recv_counts)))
        return comm.request(name, works, lambda: out)
    work = _start(comm, name, lambda: tdist.all_to_all_single(
        out, send, output_split_sizes=recv_counts, input_split_sizes=send_counts,
        group=comm.group, async_op=True), lambda: out.copy_(send))
    return comm.request(name, [work], lambda: out)


def barrier(comm: Communicator, timeout: float | None = None, *, name: str = "barrier") -> None:
    """Block until every rank of the group arrives (or raise after ``timeout`` seconds).

    ``name`` names the call in errors and in the consistency check: ``finalize()`` meets in
    ``barrier(comm, name="finalize")``, so a rank still in another collective is told apart.
    """
    if comm.size > 1 and comm.needs_check(f"{name}()"):
        _same_everywhere(comm, name, f"{name}()")
    work = _start(comm, name, lambda: tdist.barrier(group=comm.group, async_op=True))
    comm.request(name, [work], lambda: None).wait(timeout)


