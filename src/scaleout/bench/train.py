"""Training benchmark: scaleout vs DDP and friends on the same emulated network, interleaved.

:func:`run_benchmark` brings up a testbed (one rank per host, links shaped to a rate) or
uses loopback, then, round by round, runs every configuration as fresh rank processes
(:mod:`scaleout.bench.train_worker`): ``single`` (one rank alone on host 0, the ideal),
``scaleout``, and each peer. The order of configurations rotates every round, so slow
drifts of a shared machine spread over all of them. The raw result feeds
:mod:`scaleout.bench.train_report`.

Example:
    >>> cfg = TrainBenchConfig(workload="digits-mlp", ranks=2, peers=("ddp",), rounds=1,
    ...                        iters=3, warmup=1, testbed=False)
    >>> cfg.configurations
    ('single', 'scaleout', 'ddp')
    >>> raw = run_benchmark(cfg)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from scaleout.bench.train_failures import BenchFailed, failure_reason
from scaleout.bench.train_peers import AUTO, PEERS, is_configuration
from scaleout.bench.train_progress import ProgressBar
from scaleout.bench.train_worker import PROGRESS_MARK
from scaleout.launch.launcher import LaunchConfig, RankWrapper, launch
from scaleout.pytorch.optimizer import MODES
from scaleout.scheduler.config import POLICIES

__all__ = ["AUTO_WARMUP", "run_configuration", "TrainBenchConfig", "BenchFailed", "Placement", "run_benchmark", "rotation", "trace_folder"]


#: The fewest warm-up iterations with ``compression="auto"`` (plan, measure, run the tuned plan).
AUTO_WARMUP = 3


@dataclass(frozen=True, kw_only=True)
class TrainBenchConfig:
    """What ``scaleout bench train`` measures.

    Attributes:
        workload: a name from :func:`scaleout.workloads.workload_names`.
        ranks: data-parallel ranks (one per testbed host), at least 2.
        rate: link rate per direction of every testbed host (ignored with ``testbed=False``).
        peers: configurations to compare against, from
            :data:`scaleout.bench.train_peers.PEERS`.
        rounds: interleaved rounds; every configuration runs once per round.
        iters: timed iterations per run.
        warmup: untimed iterations before them.
        batch: samples per rank (``None``: the workload's default).
        compression: scaleout variants to measure, one per codec spec (``"cast:bf16"``);
            ``"none"`` is exact gradients. Each variant is its own configuration,
            ``scaleout`` for ``"none"`` and ``scaleout+SPEC`` otherwise; ``"auto"``
            (``scaleout+auto``) tunes itself during the warm-up (``DataParallel(tune="lossy")``,
            the policy and codecs its own choice; ``"auto-exact"`` the same without codecs);
            it tunes before the last warm-up iteration,
            so ``warmup`` must be >= :data:`AUTO_WARMUP`).
        policy: scaleout's scheduling policy, ``"priority"``, ``"fifo"`` or ``"default"``
            (``SchedulerConfig(policy=None)``: priority, fifo for CUDA tensors over gloo).
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

    def __post_init__(self) -> None:
        from scaleout.workloads import get_workload

        get_workload(self.workload)  # raises ValueError listing the names
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
                             f"{AUTO_WARMUP} (one iteration builds the plan, one is measured, one "
                             f"runs the tuned plan), got {self.warmup}")
        for spec in self.compression:
            if spec not in AUTO:
                make_codec(spec)  # raises ValueError naming the valid codecs
        if self.testbed:
            from scaleout.testbed import TestbedConfig

            TestbedConfig(hosts=self.ranks, rate=self.rate)  # validates the rate
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device: expected 'cpu' or 'cuda', got {self.device!r}")
        if self.timeout_s <= 0:
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

    def as_dict(self) -> dict[str, object]:
        """A JSON-ready dict of the fields, with ``batch`` resolved."""
        return {**asdict(self), "peers": list(self.peers), "compression": list(self.compression),
                "batch": self.batch_per_rank}


def variant_name(spec: str) -> str:
    """The configuration name of scaleout with codec ``spec``: ``scaleout[+SPEC]``."""
    return "scaleout" if spec == "none" else f"scaleout+{spec}"


def split_variant(name: str) -> tuple[str, str | None]:
    """``"scaleout+blockquant"`` -> ``("scaleout", "blockquant")``; peers -> ``(name, None)``."""
    base, _, spec = name.partition("+")
    return base, (spec or None)


def rotation(names: tuple[str, ...], round_index: int) -> tuple[str, ...]:
    """The order of round ``round_index``: ``names`` rotated left by the round number.

    Example:
        >>> rotation(("single", "scaleout", "ddp"), 1)
        ('scaleout', 'ddp', 'single')
    """
    k = round_index % len(names)
    return names[k:] + names[:k]


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where ranks run: a launcher wrapper (``None``: plainly here) and the rendezvous.

    Attributes:
        wrapper: per local rank, the argv prefix and environment (a testbed host).
        master_addr: host 0's address.
        network: a JSON-ready description for the report.
    """

    wrapper: RankWrapper | None
    master_addr: str
    network: dict[str, object]


@contextlib.contextmanager
def _placement(config: TrainBenchConfig) -> Iterator[Placement]:
    """A testbed with one host per rank (removed on exit, error or Ctrl-C), or loopback."""
    if not config.testbed:
        yield Placement(wrapper=None, master_addr="127.0.0.1",
                        network={"testbed": False, "hosts": 1, "rate": None,
                                 "description": "loopback, no testbed: no rate limit, "
                                                "ranks share this machine's network stack"})
        return
    from scaleout.testbed import Testbed, TestbedConfig

    name = f"bt{os.getpid() % 10**8}"
    with Testbed(TestbedConfig(hosts=config.ranks, rate=config.rate, name=name)) as tb:
        hosts = tb.hosts

        def wrapper(local_rank: int) -> tuple[list[str], dict[str, str]]:
            host = hosts[local_rank]
            return list(host.prefix), dict(host.env())

        yield Placement(wrapper=wrapper, master_addr=tb.master_addr,
                        network={"testbed": True, "name": name, "hosts": config.ranks,
                                 "rate": config.rate, "mtu": tb.config.mtu,
                                 "description": f"testbed: {config.ranks} hosts, one rank "
                                                f"each, links at {config.rate}"})


class Interrupted(KeyboardInterrupt):
    """The benchmark got SIGINT, SIGTERM or SIGHUP (it stops like Ctrl-C: ranks stopped,
    testbed removed). ``signum`` is the signal."""

    def __init__(self, signum: int = signal.SIGINT) -> None:
        super().__init__(signum)
        self.signum = int(signum)


def _launcher_stopped(code: int, lines: list[str]) -> bool:
    """Whether the launcher stopped the ranks because *it* got a signal (it says so, exit code
    128 + N); a rank killed by that signal from outside exits with the same code but is a
    failed configuration."""
    return code - 128 in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP) and any(
        line.startswith("scaleout run: got SIG") for line in lines[-3:])


class _RankOutput:
    """Receives the ranks' output lines: progress marks drive the bar, the rest is kept."""

    def __init__(self, bar: ProgressBar | None) -> None:
        self._bar = bar
        self.lines: list[str] = []

    def write(self, text: str) -> int:
        for line in text.splitlines():
            if PROGRESS_MARK in line:
                if self._bar is not None:
                    done, total = line.split(PROGRESS_MARK, 1)[1].split()[:2]
                    self._bar.update(int(done) / max(int(total), 1))
            elif line.strip():
                self.lines.append(line)
        return len(text)

    def flush(self) -> None:
        return None


def _worker_args(config: TrainBenchConfig, name: str, path: str) -> list[str]:
    base, spec = split_variant(name)
    args = ["-m", "scaleout.bench.train_worker", "--config", base,
            "--workload", config.workload, "--batch", str(config.batch_per_rank),
            "--warmup", str(config.warmup), "--iters", str(config.iters),
            "--threads", str(config.threads), "--seed", str(config.seed),
            "--policy", config.policy, "--mode", config.mode,
            "--timeout", str(config.timeout_s), "--device", config.device, "--json", path]
    if spec is not None:
        args += ["--compression", spec]
    if config.memory_budget is not None:
        args += ["--memory-budget", str(config.memory_budget)]
    return args


def trace_folder(config: TrainBenchConfig, name: str, round_index: int) -> str | None:
    """Where configuration ``name``'s ranks record their traces in round ``round_index``
    (absolute: the ranks may start elsewhere); ``None`` without ``config.trace``."""
    if config.trace is None:
        return None
    return os.path.join(os.path.abspath(config.trace), name, f"round{round_index}")


def _run_once(config: TrainBenchConfig, name: str, place: Placement, directory: str,
              bar: ProgressBar | None, *, round_index: int = 0) -> dict[str, object]:
    path = os.path.join(directory, f"{name}.json")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    nprocs = 1 if name == "single" else config.ranks
    env = {"OMP_NUM_THREADS": str(config.threads)}
    traces = trace_folder(config, name, round_index)
    if traces is not None:
        env["SCALEOUT_TRACE"] = traces
    if config.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    launch_config = LaunchConfig(nprocs=nprocs, master_addr=place.master_addr, env=env)
    out = _RankOutput(bar)
    code = launch(_worker_args(config, name, path), launch_config, wrapper=place.wrapper,
                  out=out)  # type: ignore[arg-type]
    if _launcher_stopped(code, out.lines):
        raise Interrupted(code - 128)
    if code != 0 or not os.path.exists(path):
        tail = "\n".join(f"    {line}" for line in out.lines[-40:])
        raise BenchFailed(f"configuration {name!r} failed (exit code {code}); its output:\n{tail}",
                          failure_reason(out.lines, code))
    with open(path) as handle:
        result = json.load(handle)
    if traces is not None and os.path.isdir(traces):  # configurations without DataParallel
        result["trace_dir"] = traces                    # (single, ddp, ...) record nothing
    return result


def run_configuration(config: TrainBenchConfig, name: str, *,
                      progress: bool = True) -> dict[str, object]:
    """Run one configuration once (no rounds, no peers): what its rank 0 wrote.

    Raises:
        BenchFailed: it failed (the message holds its output).
        TestbedUnavailable, Interrupted: as :func:`run_benchmark`.
    """
    bar = ProgressBar(total=1, enabled=progress)
    try:
        with _placement(config) as place, tempfile.TemporaryDirectory() as tmp:
            bar.start(name)
            result = _run_once(config, name, place, tmp, bar)
            bar.finish_run("done")
    finally:
        bar.close()
    return {**result, "network": place.network}


def run_benchmark(config: TrainBenchConfig, *, progress: bool = True) -> dict[str, object]:
    """Run every configuration ``config.rounds`` times, interleaved, and return raw results.

    Args:
        config: what to measure.
        progress: draw a progress bar on stderr.

    Returns:
        ``{"config": ..., "network": ..., "runs": [...]}``; each run holds ``round``,
        ``config``, ``order`` (its place in the round), the worker's per-iteration times
        and, for scaleout, its statistics. A configuration that fails is recorded once, as
        a run with ``error`` (its output) and ``reason`` (one line), and not run again;
        the others go on.

    Raises:
        TestbedUnavailable: ``config.testbed`` but this machine cannot host one.
        Interrupted: on Ctrl-C, SIGTERM or SIGHUP (a KeyboardInterrupt), after every rank and
            the testbed are gone.
    """
    names = config.configurations
    bar = ProgressBar(total=config.rounds * len(names), enabled=progress)
    runs: list[dict[str, object]] = []
    failed: set[str] = set()
    try:
        with _placement(config) as place, tempfile.TemporaryDirectory() as tmp:
            for r in range(config.rounds):
                for order, name in enumerate(rotation(names, r)):
                    bar.start(f"round {r + 1}/{config.rounds}: {name}")
                    if name in failed:
                        bar.finish_run("skipped (failed earlier)")
                        continue
                    try:
                        result = _run_once(config, name, place, tmp, bar, round_index=r)
                    except BenchFailed as err:
                        failed.add(name)
                        bar.finish_run("failed")
                        runs.append({"round": r, "order": order, "config": name,
                                     "error": str(err), "reason": err.reason})
                        continue
                    throughput = result["batch_per_rank"] * result["ranks"] / result["median_iter_s"]
                    bar.finish_run(f"{throughput:.1f} samples/s")
                    runs.append({"round": r, "order": order, **result, "config": name})
    finally:
        bar.close()
    return {"config": config.as_dict(), "network": place.network, "runs": runs}
