"""The codec contract and the helpers every codec shares.

A codec turns one gradient into a *payload* (a list of 1-D tensors that go on the
wire) plus a *context* (local metadata needed to decode), and back::

    payload, ctx = codec.encode(tensor, state)   # may update state (error feedback)
    approx = codec.decode(payload, ctx)          # same shape and dtype as tensor

``codec.summable`` says how payloads travel: ``True`` means the elementwise sum of
every rank's payload, decoded with any rank's context, is the sum of the decodes
(so a plain allreduce carries them); ``False`` means payloads must be gathered and
each decoded before summing. A codec that needs more than one round of
communication (PowerSGD, exponent-aligned block quantisation) overrides
:meth:`Codec.exchange`; everything else uses the generic exchange in
:mod:`scaleout.compression.exchange`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Union

import torch

from scaleout.compression.state import CodecState
from scaleout.core.collectives import Communicator
from scaleout.core.request import Request

__all__ = [
    "Codec",
    "step_too_large",
    "ExchangeGenerator",
    "TensorMeta",
    "add_residual",
    "check_number",
    "refuse_bools",
    "bucket_layout",
    "residual_of",
    "checks_are_free",
    "check_compressible",
    "update_buffer",
    "set_residual",
    "store_residual",
    "work_dtype",
]


#: A multi-round exchange: yields one request (or a list of requests) per round,
#: receives what ``wait()`` returned (a tensor or a list of tensors), and finally
#: returns the SUM over ranks of the decoded tensor, flat, in the work dtype (or in a
#: narrower float dtype, which the caller widens while averaging: no extra pass), or the
#: sum already divided, as ``scaleout.compression.exchange.Divided``.
ExchangeGenerator = Generator[Union[Request, Sequence[Request]], Any, torch.Tensor]


@dataclass(frozen=True)
class TensorMeta:
    """What every context carries: the original shape and dtype.

    Attributes:
        shape: Shape of the encoded tensor.
        dtype: Dtype of the encoded tensor (decode returns this dtype).
    """

    shape: torch.Size
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        """Number of elements of the encoded tensor."""
        n = 1
        for d in self.shape:
            n *= d
        return n


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype codecs compute in: float64 stays float64, everything else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def checks_are_free(tensor: torch.Tensor) -> bool:
    """Whether reading ``tensor``'s values on the host is free (a CPU tensor).

    On the CPU a data-dependent branch (``if bool(x.any()):``) costs one reduction and
    saves whole passes; on an accelerator it would stall the host until the device
    catches up, so codecs take the branch-free path there instead (same result).
    docs/compression.md lists the host synchronisations that remain, and why.
    """
    return tensor.device.type == "cpu"


def check_number(owner: str, name: str, value: Any, *, integer: bool = False) -> None:
    """Reject an option of the wrong type at construction: a bool, a string, anything not
    an ``int`` (``integer``) or not an ``int``/``float``.

    Raises:
        TypeError: Naming ``owner`` and the option ``name``.
    """
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        wanted = "an int" if integer else "a number"
        raise TypeError(f"{owner}: {name} must be {wanted}, got {type(value).__name__} {value!r}")


def refuse_bools(owner: str, **options: Any) -> None:
    """Reject an int option given as a bool (``True`` passes ``isinstance(x, int)``).

    Raises:
        TypeError: Naming ``owner`` and the option.
    """
    for name, value in options.items():
        if isinstance(value, bool):
            raise TypeError(f"{owner}: {name} must be an int, not a bool, got {value!r}")


def check_compressible(codec: str, tensor: torch.Tensor) -> None:
    """Raise the TypeError :func:`add_residual` raises for a tensor a codec cannot compress."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"codec {codec!r} expects a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise TypeError(
            f"codec {codec!r} compresses floating-point gradients; got dtype {tensor.dtype}. "
            "Use the 'none' codec for integer tensors."
        )


def add_residual(codec: str, tensor: torch.Tensor, state: CodecState, enabled: bool) -> torch.Tensor:
    """Flatten ``tensor`` to the work dtype and add the error-feedback residual.

    Args:
        codec: Codec name, for error messages.
        tensor: The gradient (any shape, contiguous or not).
        state: Its codec state; ``state.buffers["residual"]`` is read if present.
        enabled: Whether error feedback is on; if off the residual is ignored.

    Returns:
        A 1-D tensor in :func:`work_dtype`: the state's ``"work"`` scratch buffer, which
        the codec owns until its exchange ends (it never aliases ``tensor``).

    Raises:
        TypeError: If ``tensor`` is not a floating-point tensor.
        ValueError: If a stored residual does not match the tensor's size.
    """
    residual = residual_of(codec, tensor, state, enabled)
    source = tensor.detach().reshape(-1)
    flat = state.work_buffer("work", source.numel(), work_dtype(tensor.dtype), device=source.device)
    if residual is None:
        flat.copy_(source)
        return flat
    torch.add(source, residual, out=flat)
    return flat


def residual_of(codec: str, tensor: torch.Tensor, state: CodecState, enabled: bool) -> torch.Tensor | None:
    """The error-feedback residual to add to ``tensor``: flat, in the work dtype, on the
    tensor's device; ``None`` when there is none yet or error feedback is off.

    Raises:
        TypeError: If ``tensor`` is not a floating-point tensor.
        ValueError: If a stored residual does not match the tensor's size.
    """
    check_compressible(codec, tensor)
    residual = state.buffers.get("residual") if enabled else None
    if residual is None:
        return None
    if residual.numel() != tensor.numel():
        raise ValueError(
            f"codec {codec!r}: error-feedback residual has {residual.numel()} elements "
            f"but the tensor has {tensor.numel()}; one CodecState per tensor is required"
        )
    return residual.reshape(-1).to(device=tensor.device, dtype=work_dtype(tensor.dtype))


def store_residual(state: CodecState, compensated: torch.Tensor, sent: torch.Tensor, enabled: bool) -> None:
    """Store the error-feedback residual ``compensated - sent``.

    Elements where the new residual would be NaN/Inf keep their previous residual
    (zero on the first step), so one non-finite gradient cannot poison every later
    step: the step it belongs to is discarded (e.g. by AMP's ``GradScaler``) while
    the memory survives.

    Args:
        state: The tensor's codec state (``buffers["residual"]`` is written).
        compensated: The flat compensated gradient that was encoded (if it is the
            state's work buffer, from :func:`add_residual`, it is overwritten).
        sent: What this rank actually contributed after decoding, same size.
        enabled: Whether error feedback is on; if off nothing is stored.
    """
    if not enabled:
        return
    if compensated is state.scratch.get("work"):
        new = compensated.sub_(sent)
    else:
        new = compensated - sent
    set_residual(state, new)


def set_residual(state: CodecState, new: torch.Tensor, *, masked: bool = False) -> None:
    """Make ``new`` the residual; non-finite elements keep the previous one (see store_residual).

    When ``new`` is the state's work buffer, the previous residual's storage becomes
    the next work buffer (double buffering: no allocation per step). ``masked``: a fused
    kernel already kept the previous values where ``new`` was not finite.
    """
    update_buffer(state, "residual", new, scratch="work", masked=masked)


def update_buffer(state: CodecState, name: str, new: torch.Tensor, *, scratch: str,
                  masked: bool = False) -> None:
    """Make ``new`` the state's buffer ``name``; non-finite elements keep the previous value
    (zero if there was none), unless ``masked`` says that is done already.

    When ``new`` is the scratch buffer ``scratch``, the previous buffer's storage becomes
    that scratch buffer (double buffering: no allocation per step). Codecs replace their
    buffers this way, at the end of an exchange's encoding, and never write into the one
    replaced: its values stay intact until the state's next exchange (a
    :class:`~scaleout.compression.momentum.MomentumCodec` puts them back after a step that
    must leave the state as it was).
    """
    old = state.buffers.get(name)
    if not masked:
        _keep_finite(new, old)
    if new is state.scratch.get(scratch):
        if old is not None and old.dtype == new.dtype and old.numel() == new.numel():
            state.scratch[scratch] = old.reshape(-1)
        else:
            del state.scratch[scratch]
    state.buffers[name] = new


def _keep_finite(new: torch.Tensor, old: torch.Tensor | None) -> None:
    """Where ``new`` is not finite, put ``old`` back (zero without one), in place."""
    if not checks_are_free(new):  # no host sync: always mask (two passes on the device)
        if old is None:
            new.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        else:
            torch.where(torch.isfinite(new), new, old.reshape(-1).to(new.device, new.dtype), out=new)
    elif not bool(torch.isfinite(new.sum())):  # one reduction; exact check only if needed
        keep = torch.zeros_like(new) if old is None else old.reshape(-1).to(new.dtype)
        torch.where(torch.isfinite(new), new, keep, out=new)


def bucket_layout(shapes: Sequence[tuple[int, ...]]) -> list[tuple[int, int, tuple[int, ...]]]:
    """``(offset, numel, shape)`` of each tensor of a fused bucket, back to back."""
    layout, offset = [], 0
    for shape in shapes:
        numel = math.prod(shape)
        layout.append((offset, numel, tuple(shape)))
        offset += numel
    return layout


class Codec(ABC):
    """Base class of every codec.

    Subclasses are frozen keyword-only dataclasses holding the codec's options;
    they carry no per-tensor data (that lives in :class:`CodecState`), so one
    codec instance serves every tensor.
    """

    #: Registry name, also the first word of the codec's spec string.
    name: ClassVar[str]
    #: Whether payloads may be summed elementwise on the wire (see module doc).
    summable: ClassVar[bool]
    #: Most rounds of collectives one exchange takes (the generic exchange takes one).
    rounds: ClassVar[int] = 1

    @abstractmethod
    def encode(self, tensor: torch.Tensor, state: CodecState) -> tuple[list[torch.Tensor], Any]:
        """Compress ``tensor``.

        Args:
            tensor: The gradient, any shape; not modified.
            state: Its codec state; error feedback / momentum are read and updated.

        Returns:
            ``(payload, ctx)``: a list of contiguous 1-D tensors whose shapes depend
            only on ``tensor.shape`` and the codec options (so every rank's payload
            has the same shapes), and the local context :meth:`decode` needs.

        Raises:
            TypeError: If the codec cannot compress this dtype.
        """

    @abstractmethod
    def decode(self, payload: Sequence[torch.Tensor], ctx: Any) -> torch.Tensor:
        """Reconstruct a tensor of the original shape and dtype from ``payload``.

        Args:
            payload: A payload from :meth:`encode` (or, for summable codecs, the
                elementwise sum of several ranks' payloads).
            ctx: The context :meth:`encode` returned.

        Returns:
            The decoded tensor.
        """

    def decode_sum(self, payloads: Sequence[Sequence[torch.Tensor]], ctx: Any) -> torch.Tensor:
        """Sum of the decodes of several ranks' payloads, flat, in the work dtype.

        The default decodes each payload; sparse codecs override it to scatter
        every payload into one buffer.

        Args:
            payloads: One payload per rank.
            ctx: This rank's context (every rank's is equivalent).

        Returns:
            A 1-D tensor: the sum of the decoded tensors.
        """
        total: torch.Tensor | None = None
        for payload in payloads:
            part = self.decode(payload, ctx).reshape(-1).to(work_dtype(ctx.dtype))
            total = part if total is None else total.add_(part)
        if total is None:
            raise ValueError(f"codec {self.name!r}: decode_sum needs at least one payload, got none")
        return total

    def exchange(
        self, tensor: torch.Tensor, state: CodecState, comm: Communicator
    ) -> ExchangeGenerator | None:
        """A codec-specific multi-round exchange, or ``None`` for the generic one.

        Args:
            tensor: The gradient to reduce.
            state: Its codec state.
            comm: The core communicator of the group to reduce over (the codec calls
                :mod:`scaleout.core.collectives` on it).

        Returns:
            ``None`` (use the generic one-round exchange), or an
            :data:`ExchangeGenerator` returning the sum over ranks.
        """
        return None

    def exchange_bucket(
        self, flat: torch.Tensor, shapes: Sequence[tuple[int, ...]], state: CodecState,
        comm: Communicator,
    ) -> ExchangeGenerator | None:
        """The exchange of a fused bucket: tensors of ``shapes`` back to back in ``flat``.

        One state serves the whole bucket. The default treats the bucket as one tensor,
        right for codecs that work element by element or in blocks (none, cast,
        blockquant, sign, top-k); a codec that needs each tensor's shape (PowerSGD)
        overrides it.

        Args:
            flat: The bucket, 1-D.
            shapes: The shape of each tensor in it, in order.
            state: The bucket's codec state.
            comm: The communicator.

        Returns:
            Like :meth:`exchange`.
        """
        return self.exchange(flat, state, comm)

    def unsuited(self, optimizer: Any, *, compresses_momentum: bool = False) -> str | None:
        """Why this codec is not expected to converge with an optimizer, or ``None``.

        Args:
            optimizer: An :class:`~scaleout.compression.advice.OptimizerTraits` (its kind,
                momentum and effective step ``lr / (1 - momentum)``).
            compresses_momentum: The codec carries the momentum (``CompressionConfig(
                momentum=...)``) rather than the gradient.

        Returns:
            A sentence naming the measured problem and what to do instead, or ``None``
            (the default: no known problem). Limits come from the convergence grid of
            ``tests/test_compression_convergence.py``.
        """
        return None

    @property
    def multi_round(self) -> bool:
        """Whether an exchange may take several rounds of collectives (it then owns its lane)."""
        return self.rounds > 1


def step_too_large(optimizer: Any, limit: float, evidence: str, fix: str) -> str | None:
    """A codec's :meth:`Codec.unsuited` answer when SGD momentum's effective step
    ``lr / (1 - momentum)`` (``optimizer.step``) reaches ``limit``: the weights sit that step
    times the unsent residual away from exact training's. ``evidence``: where it was
    measured; ``fix``: what to do instead."""
    if optimizer.momentum > 0 and optimizer.step >= limit:
        return (f"an effective step lr / (1 - momentum) = {optimizer.step:.3g} (>= {limit}) "
                f"displaces the weights by that times the unsent residual ({evidence}); {fix}")
    return None
