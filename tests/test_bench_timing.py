"""What ``bench train``'s worker times (``scaleout.bench.train_worker``): a lead-in iteration
before ``--iters``, recorded and left out of the figures, in every round; batches cycled by
the model's step over every round; a prefetching set-up (``hybrid``) prefetching before
every iteration, the last one of a round too.

The worker runs here in this process as ``single`` (no process group), on a set-up made up
by the test that records what the loop does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from scaleout.bench import train_worker
from scaleout.bench.train_setup import LEAD_IN, Setup, nothing, sgd


class _Recorder(nn.Module):
    """digits-mlp's shape of model, writing down each batch it is called with."""

    def __init__(self, seen: list[tuple[str, int]]) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
        self.seen = seen

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        self.seen.append(("forward", inputs.data_ptr()))
        return self.net(inputs)


def _worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, rounds: int, iters: int,
            warmup: int) -> tuple[list[dict], list[tuple[str, int]]]:
    """Run the worker with a recording set-up; each round's JSON, and what happened."""
    seen: list[tuple[str, int]] = []

    def build(name: str, options: object) -> Setup:
        model = _Recorder(seen)
        return Setup(model=model, optimizer=sgd(model.parameters()),
                     settle=lambda: seen.append(("settle", 0)),
                     reset=nothing, statistics=None, close=nothing, details={},
                     prefetch=lambda inputs: seen.append(("prefetch", inputs.data_ptr())))

    monkeypatch.setattr(train_worker, "build_setup", build)
    go = tmp_path / "go"
    go.mkdir()
    for r in range(rounds):
        (go / f"go.{r}").touch()
    out = tmp_path / "r.json"
    train_worker.main(["--config", "single", "--workload", "digits-mlp", "--batch", "4",
                       "--iters", str(iters), "--warmup", str(warmup), "--json", str(out),
                       "--rounds", str(rounds), "--go", str(go)])
    results = [json.loads(Path(f"{out}.round{r}").read_text()) for r in range(rounds)]
    return results, seen


def test_a_lead_in_is_timed_and_left_out(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    results, _ = _worker(tmp_path, monkeypatch, rounds=2, iters=3, warmup=2)
    assert LEAD_IN == 1
    for r, result in enumerate(results):
        times = result["iter_s"]
        assert len(times) == 3 + LEAD_IN and result["lead_in"] == LEAD_IN
        assert result["median_iter_s"] == sorted(times[LEAD_IN:])[1]  # the lead-in is out
        assert result["steps"] == (r + 1) * (2 + LEAD_IN + 3)  # the model's steps so far
        (digest,) = result["digests"]  # single: one rank
        assert set(digest) == {"net.1.weight", "net.1.bias"} and digest["net.1.bias"][0] == 10
        assert digest["net.1.bias"][4] > 0  # it moved


def test_a_prefetching_set_up_prefetches_before_every_iteration(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hybrid configurations' last timed iteration did not prefetch (less work than the
    others); now every iteration prefetches the next batch, cyclically, and the batch
    prefetched last in a round is the one the next round starts with."""
    rounds, steps = 2, 1 + LEAD_IN + 3
    _, seen = _worker(tmp_path, monkeypatch, rounds=rounds, iters=3, warmup=1)
    forwards = [ptr for what, ptr in seen if what == "forward"]
    assert len(forwards) == rounds * steps
    batches = forwards[:train_worker.DISTINCT_BATCHES]
    assert len(set(batches)) == train_worker.DISTINCT_BATCHES
    assert forwards == [batches[s % len(batches)] for s in range(rounds * steps)]  # cycled
    pending: list[int] = []  # prefetched, oldest first
    step = 0
    for what, ptr in seen:
        if what == "prefetch":
            pending.append(ptr)
        elif what == "forward":  # it takes what was prefetched for it, and the next batch
            assert pending.pop(0) == ptr  # is on its way: the last iteration of a round too
            step += 1
            assert pending == [batches[step % len(batches)]], (step, seen)
    assert step == rounds * steps


def test_an_idle_warm_rank_leaves_when_no_turn_comes(tmp_path: Path) -> None:
    with pytest.raises(TimeoutError, match="round 0 was not started within 0.2 s"):
        train_worker.main(["--config", "single", "--workload", "digits-mlp", "--batch", "4",
                           "--json", str(tmp_path / "r.json"), "--rounds", "2",
                           "--go", str(tmp_path), "--go-timeout", "0.2"])
    assert (tmp_path / "ready.0").exists()
    with pytest.raises(SystemExit, match="needs --go"):
        train_worker.main(["--config", "single", "--workload", "digits-mlp", "--batch", "4",
                           "--json", str(tmp_path / "r.json"), "--rounds", "2"])
