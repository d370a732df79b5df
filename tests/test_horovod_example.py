"""examples/horovod_digits.py, a Horovod script but for its import line, trains under `scaleout run`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "horovod_digits.py"


def test_only_the_import_line_names_scaleout() -> None:
    lines = [line for line in EXAMPLE.read_text().splitlines() if "scaleout" in line
             and not line.startswith(("Run with", "      or", "With Horovod"))]
    code = [line for line in lines if not line.lstrip().startswith("#")]
    assert [re.sub(r"\s+#.*", "", line) for line in code] == ["import scaleout.horovod as hvd"]


def test_example_trains_on_two_ranks() -> None:
    pytest.importorskip("sklearn")
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "scaleout", "run", "-n", "2", str(EXAMPLE), "--epochs", "3",
         "--log-interval", "1000"], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    accuracies = [float(m) for m in re.findall(r"accuracy ([\d.]+)%", done.stdout)]
    assert len(accuracies) == 3 and accuracies[-1] > 80.0, done.stdout[-2000:]
