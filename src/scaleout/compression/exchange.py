"""Compressed allreduce: encode, exchange, decode, and count the bytes.

:func:`compressed_allreduce` is the one entry point. It runs the codec's own
multi-round exchange if it has one (:meth:`Codec.exchange`), else the generic
one: a SUM allreduce of every payload tensor for summable codecs, or one
allgather of the payload bytes followed by :meth:`Codec.decode_sum` for the rest.
Codecs call :mod:`scaleout.core.collectives` on the group's core communicator; every
collective is non-blocking, and :class:`CompressedRequest` (a core
:class:`~scaleout.core.request.Request`) drives the rounds from ``test()`` (progress
without blocking, for a progress engine) or ``wait()``. Bytes are counted from the
requests each round yields (:mod:`scaleout.core.traffic`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from scaleout.compression.base import Codec, ExchangeGenerator
from scaleout.compression.state import CodecState
from scaleout.core import collectives
from scaleout.core.collectives import Communicator
from scaleout.core.distribution import Distribution
from scaleout.core.request import Deadline, Request, countdown
from scaleout.core.traffic import total_wire_bytes, wire_bytes

__all__ = ["CompressedRequest", "Divided", "ExchangeStats", "average_target",
           "compressed_allreduce", "gather_payloads", "generic_exchange", "wire_bytes"]


@dataclass(frozen=True)
class Divided:
    """What an exchange returns instead of the sum when it wrote the sum divided by ``by``
    (the group's average, for ``by`` its size) while decoding: averaging then costs no pass
    of its own (PowerSGD writes ``P (Q / p)^T`` straight into the bucket, sign and top-k sum
    each rank's share divided by ``p``; see :func:`average_target`).

    Attributes:
        tensor: The divided sum, flat (it may be the tensor being reduced).
        by: What the sum was divided by.
    """

    tensor: torch.Tensor
    by: int


def average_target(tensor: torch.Tensor, dtype: torch.dtype, state: CodecState) -> torch.Tensor:
    """Where an exchange writes the average it returns as :class:`Divided`: ``tensor`` itself,
    flat, when it is contiguous and of ``dtype`` (the work dtype: no copy afterwards), else
    the state's ``"result"`` scratch (the request copies it over). The codec must have read
    all it needs of ``tensor`` before it writes there."""
    if tensor.is_contiguous() and tensor.dtype == dtype:
        return tensor.view(-1)
    return state.work_buffer("result", tensor.numel(), dtype, device=tensor.device)


@dataclass(frozen=True, kw_only=True)
class ExchangeStats:
    """Bytes of one compressed exchange, as seen by one rank.

    Attributes:
        codec: Codec name.
        ranks: Group size.
        dense_bytes: Bytes of the uncompressed tensor.
        payload_bytes: Bytes this rank handed to collectives (its contribution).
        wire_bytes: Ring-model estimate of the bytes this rank sent.
        collectives: ``(kind, bytes)`` for each collective, in order.
    """

    codec: str
    ranks: int
    dense_bytes: int
    payload_bytes: int
    wire_bytes: float
    collectives: tuple[tuple[str, int], ...]

    @property
    def compression_ratio(self) -> float:
        """``dense_bytes / payload_bytes`` (inf when nothing was sent)."""
        return self.dense_bytes / self.payload_bytes if self.payload_bytes else float("inf")

    @property
    def wire_ratio(self) -> float:
        """Wire bytes of a dense allreduce over this exchange's wire bytes."""
        dense = wire_bytes("allreduce", self.dense_bytes, self.ranks)
        return dense / self.wire_bytes if self.wire_bytes else float("inf")


def generic_exchange(
    codec: Codec, tensor: torch.Tensor, state: CodecState, comm: Communicator
) -> ExchangeGenerator:
    """The one-round exchange used by codecs without their own.

    Summable codecs: SUM-allreduce each payload tensor, decode once. Others:
    concatenate the payload's bytes, allgather them (one collective), split per
    rank and :meth:`Codec.decode_sum`.

    Args:
        codec: The codec.
        tensor: The gradient.
        state: Its codec state.
        comm: The communicator of the group.

    Returns:
        A generator returning the sum over ranks (``tensor.numel()`` elements).
    """
    payload, ctx = codec.encode(tensor, state)
    if codec.summable:
        reqs = [collectives.allreduce(comm, piece) for piece in payload]
        summed = yield reqs
        return codec.decode(summed, ctx)
    payloads = yield from gather_payloads(payload, comm)
    return codec.decode_sum(payloads, ctx)


def gather_payloads(
    payload: Sequence[torch.Tensor], comm: Communicator
) -> Generator[Request, Any, list[list[torch.Tensor]]]:
    """Allgather every rank's payload (tensors of the same shapes on every rank) as bytes,
    in one collective; use with ``yield from`` in an exchange.

    Returns:
        One payload per rank, in rank order, each a list like ``payload``.
    """
    wire = torch.cat([piece.reshape(-1).view(torch.uint8) for piece in payload])
    gathered = yield collectives.allgather(comm, wire)
    per_rank = gathered.view(comm.size, -1)
    payloads = []
    for row in per_rank:
        pieces, offset = [], 0
        for piece in payload:
            nbytes = piece.numel() * piece.element_size()
            pieces.append(row[offset : offset + nbytes].clone().view(piece.dtype))
            offset += nbytes
        payloads.append(pieces)
    return payloads


class CompressedRequest(Request):
    """A compressed allreduce in flight (a core :class:`~scaleout.core.request.Request`).

    The result (sum or average over the group, per ``average``) is written into the tensor
    given to :func:`compressed_allreduce`, which ``wait()`` returns.
    """

    def __init__(self, *, tensor: torch.Tensor, generator: ExchangeGenerator | None,
                 codec: str, comm: Communicator, average: bool) -> None:
        super().__init__(rank=comm.global_rank, group=comm.label,
                         operation=f"compressed allreduce (codec {codec!r})",
                         timeout=comm.timeout)
        self._tensor = tensor
        self._gen = generator
        self._codec = codec
        self._ranks = comm.size
        self._average = average
        self._pending: list[Request] = []
        self._single = True
        self._round = 0
        self._calls: list[tuple[str, int]] = []
        self._error: BaseException | None = None
        self._stats: ExchangeStats | None = None
        if generator is None:
            self._finish(None)
        else:
            self._advance(None, first=True)

    @property
    def stats(self) -> ExchangeStats:
        """Bytes of this exchange.

        Raises:
            RuntimeError: If the exchange has not completed.
        """
        if self._stats is None:
            raise RuntimeError(f"compressed allreduce ({self._codec}) has not completed; wait() first")
        return self._stats

    def when_done(self, callback: Callable[[Request], None]) -> None:
        """Call ``callback(self)`` once the current round's collectives completed.

        The caller then calls :meth:`test` (which starts the next round, if any) on its own
        thread, and registers again while ``test()`` is False. Called at once when complete.
        """
        pending = list(self._pending)
        if self._stats is not None or not pending:
            callback(self)
            return
        one_done = countdown(len(pending), lambda: callback(self))
        for request in pending:
            request.when_done(one_done)

    def test(self) -> bool:
        """Advance as far as possible without blocking; True when complete."""
        self._raise_if_failed()
        while self._stats is None:
            if not all(req.test() for req in self._pending):
                return False
            self._advance([req.wait() for req in self._pending])
        self.wait()
        return True

    def _wait(self, deadline: Deadline) -> torch.Tensor:
        self._raise_if_failed()
        while self._stats is None:
            self.operation = f"compressed allreduce (codec {self._codec!r}, round {self._round})"
            self._advance([req.wait_until(deadline) for req in self._pending])
        return self._tensor

    # -- internals -----------------------------------------------------------

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"compressed allreduce (codec {self._codec!r}) failed earlier") from self._error

    def _advance(self, results: list[Any] | None, first: bool = False) -> None:
        assert self._gen is not None
        value: Any = None if first else (results[0] if self._single else results)
        try:
            nxt = next(self._gen) if first else self._gen.send(value)
        except StopIteration as stop:
            self._finish(stop.value)
            return
        except BaseException as err:
            self._error = err
            raise
        self._round += 1
        self._single = not isinstance(nxt, (list, tuple))
        self._pending = [nxt] if self._single else list(nxt)
        self._calls += [(req.operation, req.nbytes) for req in self._pending]

    def _finish(self, summed: torch.Tensor | Divided | None) -> None:
        tensor = self._tensor
        divisor: float = self._ranks if self._average else 1
        if isinstance(summed, Divided):  # divided already: what is left of the division
            summed, divisor = summed.tensor, divisor / summed.by
        collectives.average_into(tensor, tensor if summed is None else summed, divisor)
        calls = tuple(self._calls)
        self._pending = []
        self.nbytes = sum(n for _, n in calls)
        self._stats = ExchangeStats(
            codec=self._codec,
            ranks=self._ranks,
            dense_bytes=tensor.numel() * tensor.element_size(),
            payload_bytes=self.nbytes,
            wire_bytes=total_wire_bytes(calls, self._ranks),
            collectives=calls,
        )


def compressed_allreduce(
    codec: Codec,
    tensor: torch.Tensor,
    state: CodecState,
    comm: Communicator | Distribution,
    *,
    group: Any = None,
    average: bool = True,
    shapes: Sequence[tuple[int, ...]] | None = None,
) -> CompressedRequest:
    """Start a compressed allreduce of ``tensor`` over a group; non-blocking.

    Every rank of the group must call this with the same codec, shape and dtype,
    in the same order. On completion ``tensor`` holds, on every rank, the same
    value: the SUM over ranks of each rank's decoded contribution, divided by
    the group size when ``average`` is true (the default, what data-parallel
    SGD wants). ``state.step`` is incremented.

    Args:
        codec: The codec (see :func:`scaleout.compression.make_codec`).
        tensor: The gradient; overwritten with the result. Don't touch it until
            the request completes.
        state: This tensor's codec state (one per tensor, same on every call).
        comm: The group's core communicator, or a ``scaleout`` Distribution with ``group``.
        group: With a Distribution, the group to reduce over (e.g. ``GroupType.DATA``).
        average: Divide the sum by the group size.
        shapes: ``tensor`` is a fused bucket (1-D) holding tensors of these shapes back
            to back (:meth:`Codec.exchange_bucket`); ``None``: one tensor.

    Returns:
        A :class:`CompressedRequest`; ``wait()`` returns ``tensor``,
        ``stats`` gives the bytes sent.

    Raises:
        TypeError: For a wrong argument type, or ``average`` on an integer tensor.
        ValueError: ``shapes`` that do not add up to a 1-D ``tensor``.

    Example:
        >>> codec = make_codec("topk:ratio=0.01")                 # doctest: +SKIP
        >>> state = CodecState()                                  # doctest: +SKIP
        >>> req = compressed_allreduce(codec, p.grad, state, d, group=GroupType.DATA)  # +SKIP
        >>> req.wait(timeout=60); req.stats.wire_ratio            # doctest: +SKIP
        42.7
    """
    if not isinstance(codec, Codec):
        raise TypeError(f"codec must be a scaleout.compression Codec, got {type(codec).__name__}")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if not isinstance(state, CodecState):
        raise TypeError(f"state must be a CodecState, got {type(state).__name__}")
    if average and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(f"average=True needs a floating-point tensor, got {tensor.dtype}; pass average=False")
    if shapes is not None:
        shapes = [tuple(int(d) for d in shape) for shape in shapes]
        total = sum(math.prod(shape) for shape in shapes)
        if tensor.dim() != 1 or total != tensor.numel():
            raise ValueError(f"a bucket must be 1-D with as many elements as its shapes hold: "
                             f"shapes {shapes} hold {total}, tensor has shape {tuple(tensor.shape)}")
    if isinstance(comm, Distribution):
        comm = comm.communicator(group)
    elif not isinstance(comm, Communicator):
        raise TypeError(f"comm must be a scaleout Communicator or Distribution, got "
                        f"{type(comm).__name__}")
    generator = None
    if tensor.numel():
        if shapes is None:
            generator = codec.exchange(tensor, state, comm)
        else:
            generator = codec.exchange_bucket(tensor, shapes, state, comm)
        if generator is None:
            generator = generic_exchange(codec, tensor, state, comm)
    request = CompressedRequest(tensor=tensor, generator=generator, codec=codec.name, comm=comm,
                                average=average)
    state.step += 1
    return request
