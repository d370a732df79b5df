"""What ``scaleout bench train`` measures: :class:`TrainBenchConfig` and configuration names."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from scaleout.bench.train_peers import AUTO, PEERS, POWERSGD_START, is_configuration
from scaleout.bench.train_setup import AUTO_WARMUP, AUTO_WARMUP_DEFAULT, LEAD_IN, tune_windows
from scaleout.core.checks import check_cuda_asked
from scaleout.launch.allocator import DEFAULT_ALLOCATOR, check_allocator
from scaleout.pytorch.optimizer import MODES
from scaleout.scheduler.config import POLICIES

__all__ = ["AUTO_WARMUP", "AUTO_WARMUP_DEFAULT", "TrainBenchConfig", "split_variant",
           "tune_windows", "variant_name"]


@dataclass(frozen=True, kw_only=True)
class TrainBenchConfig:
    """What ``scaleout bench train`` measures.

    Attributes:
        workload: a name from :func:`scaleout.workloads.workload_names`.
        ranks: data-parallel ranks (one per testbed host), at least 2.
        rate: link rate per direction of every testbed host (ignored with ``testbed=False``).
        peers: configurations to compare against, from
            :data:`scaleout.bench.train_peers.PEERS` (the ``hybrid`` ones DLRM's only).
        rounds: interleaved rounds; every configuration runs once per round.
        iters: timed iterations per run.
        warmup: untimed iterations before them (then one lead-in iteration, timed and
            recorded but not counted: :data:`~scaleout.bench.train_setup.LEAD_IN`);
            ``ddp-powersgd`` needs at least :data:`~scaleout.bench.train_peers.POWERSGD_START`
            (torch's hook runs plain allreduce before that iteration; the command raises it).
        batch: samples per rank (``None``: the workload's default).
        compression: scaleout variants to measure, one per codec spec (``"cast:bf16"``);
            ``"none"`` is exact gradients. Each variant is its own configuration,
            ``scaleout`` for ``"none"`` and ``scaleout+SPEC`` otherwise; ``"auto"``
            (``scaleout+auto``) tunes itself during the warm-up (``DataParallel(tune="lossy")``,
            the policy and codecs its own choice; ``"auto-exact"`` the same without codecs);
            it tunes before the last warm-up iteration,
            so ``warmup`` must be >= :data:`AUTO_WARMUP`).
        policy: scaleout's scheduling policy, ``"priority"``, ``"fifo"`` or ``"default"``
            (``SchedulerConfig(policy=None)``: priority, fifo for CUDA tensors over gloo, over
            loopback and for a plan with nothing to pre-empt).
        mode: scaleout's optimizer mode, ``"overlap"`` or ``"sync"``.
        threads: torch intra-op threads per rank.
        seed: model and data seed (the same for every configuration).
        testbed: run on an emulated cluster (needs root, ``ip``, ``tc``); ``False`` runs
            over loopback with no rate limit.
        timeout_s: rendezvous and collective timeout of the ranks.
        device: ``"cpu"`` or ``"cuda"`` (each rank on GPU ``LOCAL_RANK % GPUs``). CPU runs
            hide CUDA from the ranks (``CUDA_VISIBLE_DEVICES=``): same backends as on a
            machine without a GPU, and torch's PowerSGD hook, which synchronises CUDA
            whenever it is available, works on CPU tensors.
        memory_budget: bytes of parameters one rank may hold: the ``hybrid`` configuration
            plans its tables under it, every configuration reports whether it fits.
        trace: a folder; every run of a configuration that trains with scaleout's
            ``DataParallel`` records per-rank traces (``SCALEOUT_TRACE``) into
            ``trace/<configuration>/round<r>/trace.<rank>.json`` (``None``: no traces).
        warm: keep each configuration's ranks alive from round to round
            (:mod:`scaleout.bench.train_warm`) instead of fresh ranks every round. Used when
            there are several rounds and no ``trace`` (a trace is per process and round):
            :attr:`warm_ranks`.
        allocator: every configuration's ranks get the same host allocator settings,
            ``"keep"`` or ``"system"`` (``scaleout run --allocator``;
            :mod:`scaleout.launch.allocator`).

    Raises:
        ValueError: a field is out of range or names something unknown.
    """

    workload: str
    ranks: int = 2
    rate: str = "1gbit"
    peers: tuple[str, ...] = ("ddp",)
    rounds: int = 5
    iters: int = 10
    warmup: int = 2
    batch: int | None = None
    compression: tuple[str, ...] = ("none",)
    policy: str = "default"
    mode: str = "overlap"
    threads: int = 1
    seed: int = 0
    testbed: bool = True
    timeout_s: float = 300.0
    device: str = "cpu"
    memory_budget: int | None = None
    trace: str | None = None
    warm: bool = True
    allocator: str = DEFAULT_ALLOCATOR

    def __post_init__(self) -> None:
        from scaleout.workloads import DLRMWorkload, get_workload

        workload = get_workload(self.workload)  # raises ValueError listing the names
        for name, low in (("ranks", 1), ("rounds", 1), ("iters", 1), ("warmup", 0),
                          ("threads", 1), ("seed", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")
        if self.batch is not None and (not isinstance(self.batch, int) or self.batch < 1):
            raise ValueError(f"batch: expected samples per rank >= 1, got {self.batch!r}")
        if not self.peers:
            raise ValueError(f"peers: expected at least one of {', '.join(PEERS)}")
        unknown = [p for p in self.peers
                   if p not in PEERS and not (p.startswith("ddp-tuned:") and is_configuration(p))]
        if unknown:
            raise ValueError(f"peers: unknown {', '.join(map(repr, unknown))}; choose from "
                             f"{', '.join(PEERS)} or ddp-tuned:MB (MB an int >= 1)")
        if len(set(self.peers)) != len(self.peers):
            raise ValueError(f"peers: each peer once, got {', '.join(self.peers)}")
        hybrid = [p for p in self.peers if p.startswith("hybrid")]
        if hybrid and not isinstance(workload, DLRMWorkload):  # (before the other runs)
            raise ValueError(f"peers: the hybrid configurations ({', '.join(hybrid)}) shard "
                             f"embedding tables, and the workload {self.workload!r} has none "
                             "(use --workload dlrm)")
        if self.policy not in (*POLICIES, "default"):
            raise ValueError(f"policy: expected one of {', '.join(POLICIES)}, default, got "
                             f"{self.policy!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {self.mode!r}")
        if isinstance(self.compression, str) or not self.compression:
            raise ValueError(f"compression: expected a non-empty tuple of codec specs, got "
                             f"{self.compression!r}")
        if len(set(self.compression)) != len(self.compression):
            raise ValueError(f"compression: each codec once, got {', '.join(self.compression)}")
        from scaleout.compression import make_codec

        if set(AUTO) & set(self.compression) and self.warmup < AUTO_WARMUP:
            raise ValueError(f"compression 'auto' tunes during the warm-up: warmup must be >= "
                             f"{AUTO_WARMUP} (one iteration builds the plan, one is measured, the "
                             f"choice, its runner-up and the choice again each run one to "
                             f"settle and one, two and one timed, one runs what was kept), got "
                             f"{self.warmup}")
        if "ddp-powersgd" in self.peers and self.warmup < POWERSGD_START:
            raise ValueError(f"peers: ddp-powersgd compresses from iteration {POWERSGD_START} "
                             f"(torch's start_powerSGD_iter; plain allreduce before it), so "
                             f"with warmup {self.warmup} it would time uncompressed "
                             f"iterations: give warmup >= {POWERSGD_START}")
        for spec in self.compression:
            if spec not in AUTO:
                make_codec(spec)  # raises ValueError naming the valid codecs
        if self.testbed:
            from scaleout.testbed import TestbedConfig

            TestbedConfig(hosts=self.ranks, rate=self.rate)  # validates the rate
        check_allocator(self.allocator)
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device: expected 'cpu' or 'cuda', got {self.device!r}")
        check_cuda_asked(self.device)
        if not self.timeout_s > 0 or not math.isfinite(self.timeout_s):  # (nan too)
            raise ValueError(f"timeout_s: expected seconds > 0, got {self.timeout_s!r}")
        if self.memory_budget is not None and (isinstance(self.memory_budget, bool) or not
                                               isinstance(self.memory_budget, int) or
                                               self.memory_budget < 1):
            raise ValueError(f"memory_budget: expected bytes >= 1, got {self.memory_budget!r}")
        if self.trace is not None and (not isinstance(self.trace, str) or not self.trace):
            raise ValueError(f"trace: expected a folder name, got {self.trace!r}")

    @property
    def configurations(self) -> tuple[str, ...]:
        """``("single", *scaleout variants, *peers)``: every configuration a round runs."""
        return ("single", *(variant_name(c) for c in self.compression), *self.peers)

    @property
    def batch_per_rank(self) -> int:
        """Samples per rank (the workload's default when ``batch`` is ``None``)."""
        from scaleout.workloads import get_workload

        return self.batch if self.batch is not None else get_workload(self.workload).default_batch_size

    @property
    def warm_ranks(self) -> bool:
        """Whether the ranks stay warm from round to round: ``warm`` asked, several rounds,
        no ``trace``."""
        return self.warm and self.rounds > 1 and self.trace is None

    def as_dict(self) -> dict[str, object]:
        """A JSON-ready dict of the fields as they ran: ``batch`` resolved, ``warm`` whether
        the ranks stayed warm (``warm_asked``: the field), ``rate`` ``None`` without a
        testbed (loopback shapes nothing), and ``lead_in``."""
        return {**asdict(self), "peers": list(self.peers), "compression": list(self.compression),
                "batch": self.batch_per_rank, "warm": self.warm_ranks, "warm_asked": self.warm,
                "rate": self.rate if self.testbed else None, "lead_in": LEAD_IN}


def variant_name(spec: str) -> str:
    """The configuration name of scaleout with codec ``spec``: ``scaleout[+SPEC]``."""
    return "scaleout" if spec == "none" else f"scaleout+{spec}"


def split_variant(name: str) -> tuple[str, str | None]:
    """``"scaleout+blockquant"`` -> ``("scaleout", "blockquant")``; peers -> ``(name, None)``."""
    base, _, spec = name.partition("+")
    return base, (spec or None)
