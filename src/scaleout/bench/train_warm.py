"""Warm ranks for ``scaleout bench train``: each configuration's processes live for every round.

Fresh ranks per round pay the interpreter's start-up, torch's import, the rendezvous and
the model's construction every round (a few seconds to ~15 s on a loaded 2-core machine).
Warm ranks pay them once. Fairness is kept by construction:

- every configuration gets warm ranks (the same treatment for scaleout and each peer);
- all of them are started before round 0 and the runner waits until every rank of every
  configuration has imported and is idle (``ready.<rank>`` files), so no start-up overlaps
  a timed run; a configuration builds its model only at its first turn, as fresh ranks do;
- at any moment one configuration runs; the others sleep in a file poll (a ``stat`` every
  20 ms) holding their memory, the same for all;
- every round still runs the warm-up iterations before the timed ones.

The turn signal is a file (``go.<round>``) in a folder of the configuration: the ranks may
run in testbed namespaces, which share the file system but not the runner's sockets. A rank
that sees no turn within its timeout leaves with an error; a rank whose runner dies is
killed with it (:mod:`scaleout.launch.lifeline`).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO

from scaleout.bench.train_failures import BenchFailed, failure_reason
from scaleout.bench.train_worker import GO_POLL_S, go_file, ready_file, round_json
from scaleout.launch.launcher import LaunchConfig, RankWrapper, launch

__all__ = ["WarmRanks"]


class WarmRanks:
    """One configuration's ranks, started once and told round by round to run.

    Args:
        name: the configuration.
        argv: the worker's argv, without the warm-rank flags (added here).
        config: the launch layout (its ``master_port`` must differ between configurations
            that are alive at once).
        folder: an empty folder for the turn and ready files and the results.
        json_path: the worker's ``--json`` path (results land at ``<path>.round<r>``).
        rounds: rounds the ranks run.
        out: where the ranks' output goes (a stream with ``lines``, as the runner's).
        wrapper: per local rank, an argv prefix and environment (the testbed's hosts).
        go_timeout_s: how long an idle rank waits for its next turn before leaving.
    """

    def __init__(self, name: str, argv: Sequence[str], config: LaunchConfig, *, folder: str,
                 json_path: str, rounds: int, out: IO[str], wrapper: RankWrapper | None,
                 go_timeout_s: float) -> None:
        self.name = name
        self.folder = folder
        self.json_path = json_path
        self.nprocs = config.nprocs
        self.out = out
        self.code: int | None = None
        self._stop = threading.Event()
        target = [*argv, "--rounds", str(rounds), "--go", folder,
                  "--go-timeout", str(go_timeout_s)]
        self._thread = threading.Thread(
            target=self._launch, args=(target, config, wrapper), daemon=True,
            name=f"scaleout-bench-{name}")
        self._thread.start()

    def _launch(self, target: list[str], config: LaunchConfig,
                wrapper: RankWrapper | None) -> None:
        self.code = launch(target, config, wrapper=wrapper, out=self.out, stop=self._stop)

    @property
    def alive(self) -> bool:
        """Whether the ranks are still running (or idle, waiting for a turn)."""
        return self._thread.is_alive()

    def ready(self) -> bool:
        """Whether every rank has started and waits for its first turn."""
        return all(os.path.exists(ready_file(self.folder, r)) for r in range(self.nprocs))

    def run_round(self, round_index: int, timeout_s: float,
                  on_wait: Callable[[], None] | None = None) -> dict[str, object]:
        """Start round ``round_index`` and return what rank 0 wrote for it.

        Args:
            round_index: the round (the ranks run them in order).
            timeout_s: how long the round may take.
            on_wait: called while waiting (every poll), e.g. to keep a display alive.

        Raises:
            BenchFailed: the ranks ended without the round's result, or it took longer than
                ``timeout_s`` (the ranks are then stopped).
        """
        path = round_json(self.json_path, round_index)
        with open(go_file(self.folder, round_index), "w"):
            pass
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(path):
            if not self.alive:
                raise self.failure(f"ended (exit code {self.code}) before round {round_index}'s result")
            if time.monotonic() > deadline:
                self.stop()
                raise self.failure(f"gave no result for round {round_index} within {timeout_s:g} s")
            if on_wait is not None:
                on_wait()
            time.sleep(GO_POLL_S)
        with open(path) as handle:
            return json.load(handle)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the ranks (as on SIGTERM) and wait for the launch to end."""
        self._stop.set()
        self._thread.join(timeout_s)

    def finish(self, timeout_s: float) -> bool:
        """After the last round: let the ranks leave by themselves within ``timeout_s``, else
        stop them; whether they left by themselves."""
        self._thread.join(timeout_s)
        if not self.alive:
            return True
        self.stop()
        return False

    def failure(self, what: str) -> BenchFailed:
        """A :class:`BenchFailed` saying ``what`` happened, with the ranks' last output."""
        lines = getattr(self.out, "lines", [])
        tail = "\n".join(f"    {line}" for line in lines[-40:])
        return BenchFailed(f"configuration {self.name!r} {what}; its output:\n{tail}",
                           failure_reason(lines, self.code if self.code is not None else 1))
