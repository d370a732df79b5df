"""How a simulated iteration runs: scheduling, overlap mode, collective algorithm, codec."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from scaleout.scheduler.config import SchedulerConfig
from scaleout.sim.collectives import ALGORITHMS
from scaleout.sim.themis import SCHEDULERS, pipelined_algorithm
from scaleout.sim.workload import finite_number

__all__ = ["MODES", "CodecModel", "CODECS", "codec_model", "IterationConfig"]

MODES = ("sync", "overlap")


@dataclass(frozen=True, kw_only=True)
class CodecModel:
    """A codec as the simulator sees it: how much it shrinks and what it costs.

    Attributes:
        name: ``""`` for exact gradients (then ``ratio`` must be 1).
        ratio: wire bytes / gradient bytes.
        seconds_per_byte: encode + decode compute per gradient byte (measured, e.g.
            docs/compression.md).
        summable: payloads add on the wire (all-reduce); else they are all-gathered.
        multi_round: an exchange takes several rounds, so it owns its lane while in flight
            (the runtime's ``Codec.multi_round``: blockquant, PowerSGD, rows).
        rounds: collectives per exchange (the runtime's ``Codec.rounds``; 1 unless
            ``multi_round``): each round beyond the first costs the exchange one more
            collective's latency (a collective of one byte on the topology) and, on a host that
            pays per message (``IterationConfig.host_s_per_message``), its CPU. Its bytes are
            in ``ratio``.
    """

    name: str = ""
    ratio: float = 1.0
    seconds_per_byte: float = 0.0
    summable: bool = True
    multi_round: bool = False
    rounds: int = 1

    def __post_init__(self) -> None:
        if (isinstance(self.rounds, bool) or not isinstance(self.rounds, int) or self.rounds < 1
                or (self.rounds > 1 and not self.multi_round)):
            raise ValueError(f"codec rounds must be an int >= 1, and above 1 only for a "
                             f"multi_round codec, got {self.rounds!r}")
        if not isinstance(self.ratio, (int, float)) or not 0 < self.ratio <= 1:
            raise ValueError(f"codec ratio must be in (0, 1], got {self.ratio!r}")
        cost = self.seconds_per_byte
        if not finite_number(cost):
            raise ValueError(f"codec seconds_per_byte must be a finite number >= 0, got {cost!r}")
        exact_ok = self.ratio == 1 and not self.seconds_per_byte and self.summable
        if not self.name and not (exact_ok and not self.multi_round):
            raise ValueError(
                "an exact codec (name '') has ratio 1, no cost, is summable and single-round"
            )


_MS_PER_MB = 1e-3 / (1 << 20)
# scaleout's codecs as measured here: ratio = MB/it on the wire / 44.70 MB of ResNet-18's
# gradients (benchmarks/RESULTS.md, resnet18-1gbit-ceilings); cost = the CPU seconds per MB of
# the codec's whole exchange (encode, its rounds, decode) on a world-size-1 group, one thread,
# ResNet-18's 11.2M values (benchmarks/codec_cpu_probe.py, 2026-11-23: cast:fp16 0.20,
# blockquant 1.47, sign 1.28, topk 1.69 ms/MB). These costs were first taken as the codec's
# exchange time minus the exact one's (33 ms) for the 44.70 MB, 2 ranks on loopback, which
# also subtracts the transport of the bytes the codec does not send (blockquant 0.34 ms/MB).
# PowerSGD's cost depends on the layer shapes (a 1-D tensor goes uncompressed): measured on
# ResNet-18's layers in DataParallel's buckets (the probe since stop 41, 2026-11-28: 0.85
# ms/MB, the median of five runs; it was 0.045, that loopback difference, 20x too cheap),
# its ratio too.
CODECS: Mapping[str, CodecModel] = MappingProxyType(
    {
        c.name: c
        for c in (
            CodecModel(
                name="cast:fp16", ratio=22.37 / 44.70, seconds_per_byte=0.20 * _MS_PER_MB
            ),
            CodecModel(
                name="blockquant",
                ratio=11.25 / 44.70,
                seconds_per_byte=1.47 * _MS_PER_MB,
                multi_round=True,
                rounds=2,
            ),
            CodecModel(
                name="sign",
                ratio=1.61 / 44.70,
                seconds_per_byte=1.28 * _MS_PER_MB,
                summable=False,
            ),
            CodecModel(
                name="topk:ratio=0.01",
                ratio=0.93 / 44.70,
                seconds_per_byte=1.69 * _MS_PER_MB,
                summable=False,
            ),
            CodecModel(
                name="powersgd:rank=2",
                ratio=0.33 / 44.70,
                seconds_per_byte=0.85 * _MS_PER_MB,
                multi_round=True,
                rounds=2,
            ),
        )
    }
)


def codec_model(name: str) -> CodecModel:
    """The measured :class:`CodecModel` of scaleout codec ``name`` (``"none"``: exact).

    Raises:
        ValueError: a codec with no measurement here (the known ones are listed).
    """
    if name in ("", "none"):
        return CodecModel()
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(
            f"no measured model for codec {name!r}; known: none, {', '.join(CODECS)}"
        ) from None


@dataclass(frozen=True, kw_only=True)
class IterationConfig:
    """How the iteration is run.

    Attributes:
        scheduler: the runtime's scheduling options (policy, buckets, chunks, credit).
        mode: ``"overlap"`` (scaleout's cross-iteration overlap) or ``"sync"`` (DDP).
        algorithm: collective algorithm, or one per dimension.
        flat: one ring over all NPUs instead of the hierarchical decomposition.
        codec: the codec's byte ratio and cost.
        layer_codecs: layer name -> the codec of that layer's gradients (others: ``codec``),
            as with a per-layer ``CompressionConfig``; items of one codec fuse together
            (the iteration model; the Chakra graph prices every bucket with ``codec``).
        iterations: simulated back to back (>= 3); the steady state is reported.
        trace: keep every span for a Chrome trace.
        pipeline: ``None``: a multi-dimensional all-reduce runs its phases one after the
            other; ``"baseline"`` / ``"themis"``: it is cut into ``pipeline_chunks`` pieces
            whose phases overlap across dimensions, in fixed order or Themis' order
            (:mod:`scaleout.sim.themis`; one algorithm for every dimension).
        pipeline_chunks: pieces per all-reduce when ``pipeline`` is set.
        host_s_per_byte: CPU seconds a rank spends per byte it puts on the wire, on the cores
            its compute uses (a host without offload, e.g. TCP on a shared CPU). A chunk then
            takes at least ``host_s_per_byte x bytes``, and the share of that work done while
            the rank computes lengthens its compute (processor sharing); work done while it
            waits costs nothing more. A codec's compute then runs on those cores too and is
            charged the same way. 0: the network has its own engine.
        host_s_per_message: CPU seconds a rank spends per collective (per chunk sent) on
            those cores, whatever its size: the call and the communication library's threads
            (gloo over TCP: ~1 ms for a 1 KB all-reduce on a 2-core machine, RESULTS.md). It is
            charged like ``host_s_per_byte`` (the autotuner measures it on CPU runs; a
            multi-round codec's later rounds are not counted).
        cycle_s: a background loop that starts collectives only at its cycles (Horovod's
            ``HOROVOD_CYCLE_TIME``, 5 ms by default): a cycle starts what is queued at its
            start, one after the other, and the next one starts ``cycle_s`` after it, or
            when that work ends if later; what arrives meanwhile waits for it. 0: a
            collective starts as soon as the network is free (scaleout's engine, DDP).
        early_chunks: a bucket's chunk leaves once the layers it holds are in
            (:func:`~scaleout.scheduler.chunk_needs`, the runtime's rule since stop 34);
            ``False``: a bucket's chunks all leave when its last layer is in (the runtime
            before: what the testbed rows measured until then ran).
    """

    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    mode: str = "overlap"
    algorithm: str | tuple[str, ...] = "ring"
    flat: bool = False
    codec: CodecModel = field(default_factory=CodecModel)
    layer_codecs: Mapping[str, CodecModel] = field(default_factory=dict)
    iterations: int = 3
    trace: bool = False
    pipeline: str | None = None
    pipeline_chunks: int = 16
    host_s_per_byte: float = 0.0
    host_s_per_message: float = 0.0
    cycle_s: float = 0.0
    early_chunks: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.scheduler, SchedulerConfig):
            raise TypeError(
                f"scheduler must be a SchedulerConfig, got {type(self.scheduler).__name__}"
            )
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        names = (self.algorithm,) if isinstance(self.algorithm, str) else tuple(self.algorithm)
        if not names or any(a not in ALGORITHMS for a in names):
            raise ValueError(f"algorithm must be from {ALGORITHMS}, got {self.algorithm!r}")
        if (
            isinstance(self.iterations, bool)
            or not isinstance(self.iterations, int)
            or self.iterations < 3
        ):
            raise ValueError(f"iterations must be an int >= 3, got {self.iterations!r}")
        if self.pipeline is not None:
            if self.pipeline not in SCHEDULERS:
                raise ValueError(
                    f"pipeline must be None or one of {SCHEDULERS}, got {self.pipeline!r}"
                )
            pipelined_algorithm(self.algorithm, self.flat)
        for name in ("host_s_per_byte", "host_s_per_message", "cycle_s"):
            value = getattr(self, name)
            if not finite_number(value):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not isinstance(self.early_chunks, bool):
            raise TypeError(f"early_chunks must be a bool, got {self.early_chunks!r}")
        chunks = self.pipeline_chunks
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"pipeline_chunks must be an int >= 1, got {chunks!r}")
        if not isinstance(self.codec, CodecModel):
            raise TypeError(f"codec must be a CodecModel, got {type(self.codec).__name__}")
        if not isinstance(self.layer_codecs, Mapping) or not all(
                isinstance(k, str) and isinstance(v, CodecModel)
                for k, v in self.layer_codecs.items()):
            raise TypeError("layer_codecs must map layer names (str) to CodecModel, got "
                            f"{self.layer_codecs!r}")
        object.__setattr__(self, "layer_codecs", MappingProxyType(dict(self.layer_codecs)))

    def codec_of(self, layer: str) -> CodecModel:
        """The codec of layer ``layer``'s gradients."""
        return self.layer_codecs.get(layer, self.codec)
