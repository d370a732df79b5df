"""examples/train_digits_tp.py trains on a 1x2 grid, and the plain model gathered from the
shards scores what the grid scores."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness import scaleout_run

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_digits_tp.py"


def test_example_trains_on_a_one_by_two_grid() -> None:
    pytest.importorskip("sklearn")
    done = scaleout_run("-n", "2", str(EXAMPLE), "--model-parts", "2", "--epochs", "4")
    assert "8970 of its 17226 parameters on each rank" in done.stdout, done.stdout[-2000:]
    accuracies = [float(a) for a in re.findall(r"test accuracy ([\d.]+)", done.stdout)]
    assert len(accuracies) == 5 and accuracies[-2] > 0.85, done.stdout[-2000:]
    assert accuracies[-1] == accuracies[-2]  # the gathered plain model: the grid's accuracy
