"""Training benchmark: scaleout vs DDP and friends on the same emulated network, interleaved.

:func:`run_benchmark` brings up a testbed (one rank per host, links shaped to a rate) or
uses loopback, then, round by round, runs every configuration on its rank processes
(:mod:`scaleout.bench.train_worker`; warm ranks kept from round to round by default,
:mod:`scaleout.bench.train_warm`): ``single`` (one rank alone on host 0, the ideal),
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
import re
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

from scaleout.bench.train_config import AUTO_WARMUP, TrainBenchConfig, split_variant, variant_name
from scaleout.bench.train_failures import BenchFailed, failure_reason
from scaleout.bench.train_progress import ProgressBar
from scaleout.bench.train_warm import WarmRanks
from scaleout.bench.train_setup import steps_per_round
from scaleout.bench.train_worker import PROGRESS_MARK
from scaleout.launch.launcher import LINGERED_SAY, LaunchConfig, RankWrapper, free_port, launch

__all__ = ["AUTO_WARMUP", "run_configuration", "TrainBenchConfig", "BenchFailed", "Placement",
           "run_benchmark", "rotation", "split_variant", "trace_folder", "variant_name"]


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
    return code - 128 in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP) and _launcher_said(
        lines, "scaleout run: got SIG")


def _outstayed(lines: list[str]) -> bool:
    """Whether the launcher stopped ranks that had not exited ``linger`` s after a clean
    exit."""
    return _launcher_said(lines, LINGERED_SAY)


def _launcher_said(lines: list[str], start: str) -> bool:
    """Whether one of the last lines (where the launcher says why it ended) begins so."""
    return any(line.startswith(start) for line in lines[-3:])


#: A warning of scaleout's own in the ranks' output: ``warnings`` prints "file:line:
#: Category: message", the file one of scaleout's (the worker is one too) or the message
#: beginning "scaleout:". Group 1: the message.
OWN_WARNING = re.compile(r"(?:/scaleout/\S*\.py:\d+: \w*Warning: |\w*Warning: (?=scaleout:))(.*)")


class _RankOutput:
    """Receives the ranks' output lines: progress marks drive the bar, the rest is kept.
    scaleout's own warnings (a path that runs other than meant: tables sent whole, say) are
    kept in ``warnings`` for the configuration's results and said on stderr, once per
    message in a benchmark (``said``, shared by its configurations)."""

    def __init__(self, bar: ProgressBar | None, name: str = "",
                 said: set[str] | None = None) -> None:
        self._bar = bar
        self._name = name
        self._said = set() if said is None else said
        self.lines: list[str] = []
        self.warnings: list[str] = []

    def write(self, text: str) -> int:
        for line in text.splitlines():
            if PROGRESS_MARK in line:
                if self._bar is not None:
                    done, total = line.split(PROGRESS_MARK, 1)[1].split()[:2]
                    self._bar.update(int(done) / max(int(total), 1))
            elif line.strip():
                self.lines.append(line)
                if (own := OWN_WARNING.search(line)) is not None:
                    self._warned(own.group(1).strip())
        return len(text)

    def _warned(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)
        if message not in self._said:
            self._said.add(message)
            print(f"\nbench train: configuration {self._name!r} warned: {message}",
                  file=sys.stderr, flush=True)

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


def _launch_config(config: TrainBenchConfig, name: str, place: Placement, *,
                   traces: str | None = None, port: int | None = None) -> LaunchConfig:
    env = {"OMP_NUM_THREADS": str(config.threads)}
    if traces is not None:
        env["SCALEOUT_TRACE"] = traces
    if config.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return LaunchConfig(nprocs=1 if name == "single" else config.ranks,
                        master_addr=place.master_addr, master_port=port, env=env,
                        allocator=config.allocator, linger=LEAVE_S)


def _run_once(config: TrainBenchConfig, name: str, place: Placement, directory: str,
              bar: ProgressBar | None, *, round_index: int = 0,
              said: set[str] | None = None) -> dict[str, object]:
    path = os.path.join(directory, f"{name}.json")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    traces = trace_folder(config, name, round_index)
    launch_config = _launch_config(config, name, place, traces=traces)
    out = _RankOutput(bar, name, said)
    code = launch(_worker_args(config, name, path), launch_config, wrapper=place.wrapper,
                  out=out)  # type: ignore[arg-type]
    if _launcher_stopped(code, out.lines):
        raise Interrupted(code - 128)
    if code != 0 and os.path.exists(path) and _outstayed(out.lines):
        print(f"bench train: configuration {name!r}: its ranks had not left {LEAVE_S:g} s after "
              "the first one did; stopped them (the result was already in)",
              file=sys.stderr, flush=True)
    elif code != 0 or not os.path.exists(path):
        tail = "\n".join(f"    {line}" for line in out.lines[-40:])
        raise BenchFailed(f"configuration {name!r} failed (exit code {code}); its output:\n{tail}",
                          failure_reason(out.lines, code))
    with open(path) as handle:
        result = json.load(handle)
    if traces is not None and os.path.isdir(traces):  # configurations without DataParallel
        result["trace_dir"] = traces                    # (single, ddp, ...) record nothing
    if out.warnings:
        result["warnings"] = out.warnings
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
    warm: dict[str, WarmRanks] = {}
    said: set[str] = set()  # scaleout's warnings already shown
    try:
        with _placement(config) as place, tempfile.TemporaryDirectory() as tmp:
            if config.warm_ranks:
                warm = _start_warm(config, names, place, tmp, bar, runs, failed, said)
            for r in range(config.rounds):
                for order, name in enumerate(rotation(names, r)):
                    bar.start(f"round {r + 1}/{config.rounds}: {name}")
                    if name in failed:
                        bar.finish_run("skipped (failed earlier)")
                        continue
                    try:
                        result = (warm[name].run_round(r, _round_timeout(config)) if warm else
                                  _run_once(config, name, place, tmp, bar, round_index=r,
                                            said=said))
                    except BenchFailed as err:
                        failed.add(name)
                        bar.finish_run("failed")
                        runs.append({"round": r, "order": order, "config": name,
                                     "error": str(err), "reason": err.reason})
                        continue
                    warned = getattr(warm[name].out, "warnings", ()) if warm else ()
                    if warned:  # (warm ranks: said at the set-up of their first round)
                        result["warnings"] = list(warned)
                    throughput = result["batch_per_rank"] * result["ranks"] / result["median_iter_s"]
                    bar.finish_run(f"{throughput:.1f} samples/s")
                    runs.append({**result, "round": r, "order": order, "config": name})
            for name, ranks in warm.items():
                if not ranks.finish(LEAVE_S):
                    print(f"bench train: configuration {name!r}: its ranks had not left "
                          f"{LEAVE_S:g} s after their last round; stopped them (every round's "
                          "result was already in)", file=sys.stderr, flush=True)
    finally:
        for ranks in warm.values():
            ranks.stop()
        bar.close()
    return {"config": config.as_dict(), "network": place.network, "runs": runs,
            "warm_ranks": bool(warm)}


#: How long a configuration's ranks may take to leave once their last result is in (a
#: barrier, the process group's teardown, exit: seconds): warm ranks after their last
#: round, fresh ones after the first rank exited. Beyond it they are stopped: they can no
#: longer change the measurement. The DDP peer's ranks were seen hanging at exit (stops 42
#: and 43: freeing DDP's reducer deadlocked against gloo, see ``train_worker.main``), where
#: the runner used to wait without a bound (fresh ranks) or the whole round timeout (warm).
LEAVE_S = 30.0


def _round_timeout(config: TrainBenchConfig) -> float:
    """The longest one configuration's round may take with warm ranks: each of its
    iterations is bounded by the ranks' collective timeout, plus set-up."""
    return config.timeout_s * (steps_per_round(config.warmup, config.iters) + 2)


def _start_warm(config: TrainBenchConfig, names: tuple[str, ...], place: Placement,
                directory: str, bar: ProgressBar, runs: list[dict[str, object]],
                failed: set[str], said: set[str]) -> dict[str, WarmRanks]:
    """Start every configuration's warm ranks and wait until all of them are idle; a
    configuration that ends before that is recorded as failed."""
    bar.start("starting warm ranks")
    ports: set[int] = set()
    warm = {}
    go_timeout = _round_timeout(config) * len(names) + 60.0
    for name in names:
        while (port := free_port()) in ports:
            pass
        ports.add(port)
        folder = os.path.join(directory, f"{name}.warm")
        os.mkdir(folder)
        result = os.path.join(folder, "result.json")
        warm[name] = WarmRanks(
            name, _worker_args(config, name, result),
            _launch_config(config, name, place, port=port), folder=folder,
            json_path=result, rounds=config.rounds,
            out=_RankOutput(bar, name, said), wrapper=place.wrapper, go_timeout_s=go_timeout)
    deadline = time.monotonic() + config.timeout_s
    waiting = dict(warm)
    while waiting and time.monotonic() < deadline:
        for name, ranks in list(waiting.items()):
            if ranks.ready():
                del waiting[name]
            elif not ranks.alive:
                del waiting[name]
                failed.add(name)
                err = ranks.failure(f"ended (exit code {ranks.code}) before it was ready")
                runs.append({"round": 0, "order": 0, "config": name, "error": str(err),
                             "reason": err.reason})
        time.sleep(0.05)
    for name, ranks in waiting.items():  # still not ready: stop them
        ranks.stop()
        failed.add(name)
        runs.append({"round": 0, "order": 0, "config": name, "reason": "not ready in time",
                     "error": f"configuration {name!r}: ranks not ready within {config.timeout_s:g} s"})
    bar.finish_run("ready")
    return warm
