"""The built-in communication hooks of a :class:`~scaleout.session.bucket.GradBucket`.

Each is ``hook(state, bucket) -> Request`` with the result averaged over the bucket's group
(DDP's comm-hook contract), so a user's hook — or one of torch's
``torch.distributed.algorithms.ddp_comm_hooks`` — can take any of their places.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from scaleout.compression import Codec, CodecState, NoneCodec, compressed_allreduce
from scaleout.core import collectives
from scaleout.core.collectives import ReduceOp
from scaleout.core.request import Request
from scaleout.session.bucket import GradBucket

__all__ = ["allreduce_hook", "reduce_scatter_hook", "codec_hook", "CodecHookState", "codec_identity",
           "other_codec"]

_EXACT = NoneCodec()


def allreduce_hook(state: Any, bucket: GradBucket) -> Request:
    """Exact gradients: a SUM allreduce of the buffer, averaged. Works element by element,
    so the engine may send a bucket in chunks (each chunk is a bucket view)."""
    return bucket.averaged(collectives.allreduce(bucket.comm, bucket.buffer(), ReduceOp.SUM))


allreduce_hook.elementwise = True  # type: ignore[attr-defined]
allreduce_hook.prescaled = True  # type: ignore[attr-defined]


def reduce_scatter_hook(state: Any, bucket: GradBucket) -> Request:
    """The sharded (distributed) update: each rank receives its owned slice, averaged.

    The buffer is padded to ``owned_count * group size``; rank i owns block i.
    """
    return bucket.averaged(collectives.reduce_scatter(bucket.comm, bucket.buffer(), ReduceOp.SUM))


reduce_scatter_hook.prescaled = True  # type: ignore[attr-defined]


@dataclass(eq=False)
class CodecHookState:
    """A compressed bucket's codec (chosen once, at commit) and its error-feedback state.

    Attributes:
        codec: the codec.
        shapes: the members' shapes, for codecs that need matrices (PowerSGD).
        warmup_steps: the first exchanges go exact (the residual starts afterwards).
        codec_state: residuals, momentum, PowerSGD's Q; checkpointed with the model.
    """

    codec: Codec
    shapes: list[tuple[int, ...]]
    warmup_steps: int = 0
    codec_state: CodecState = field(default_factory=CodecState)


def codec_identity(codec: Codec) -> str:
    """What a checkpoint records of the codec that made a bucket's state: its ``repr`` (class
    and options) for a dataclass codec, as every built-in one is, else its class's name (a
    ``repr`` with an address would differ in every process)."""
    if dataclasses.is_dataclass(codec):
        return repr(codec)
    return f"{type(codec).__module__}.{type(codec).__qualname__}"


def other_codec(saved: dict[str, Any], bucket: Any) -> bool:
    """Whether the codec state ``saved`` (a :meth:`Session.compression_state_dict` entry)
    was saved by another codec, or other options, than the one ``bucket`` runs (state saved
    before stop 49 names none: taken as this one's)."""
    return "codec" in saved and saved["codec"] != codec_identity(bucket.state.codec)


def codec_hook(state: CodecHookState, bucket: GradBucket) -> Request:
    """A codec's exchange of the whole bucket (exact during warm-up), averaged (by the
    exchange itself, in the same pass that widens a narrow sum)."""
    codec = _EXACT if state.codec_state.step < state.warmup_steps else state.codec
    return compressed_allreduce(codec, bucket.buffer(), state.codec_state, bucket.comm,
                                average=True, shapes=state.shapes)
