"""`scaleout --help` and `scaleout run --help` import no torch; help texts carry no RST markup."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")
PROBE = """
import sys
from scaleout.cli.main import main
try:
    main({argv!r})
except SystemExit:
    pass
print("TORCH" if "torch" in sys.modules else "NO-TORCH")
"""


def _run(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], []])
def test_help_imports_no_torch(argv: list[str]) -> None:
    out = _run(PROBE.format(argv=argv))
    assert out.rstrip().endswith("NO-TORCH"), out
    assert "usage: scaleout" in out


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["bench", "--help"],
                                  ["bench", "collectives", "--help"], ["bench", "train", "--help"],
                                  ["testbed", "--help"], ["testbed", "up", "--help"]])
def test_help_has_no_rst_markup(argv: list[str]) -> None:
    out = _run(PROBE.format(argv=argv))
    assert not re.search(r"``|:(func|class|mod|meth):", out), out


def test_version_is_the_package_metadata() -> None:
    from importlib.metadata import version

    import scaleout
    out = _run(PROBE.format(argv=["--version"]))
    assert out.splitlines() == [f"scaleout {scaleout.__version__}", "NO-TORCH"]
    assert version("scaleout") == scaleout.__version__  # pyproject reads it from the package


def test_run_refuses_a_missing_script_once() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "scaleout", "run", "-n", "2", "/no/such.py"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "scaleout run: error: no such script: /no/such.py"]


def test_bench_help_names_every_workload_and_the_auto_warmup() -> None:
    from scaleout.bench.train_config import AUTO_WARMUP, AUTO_WARMUP_DEFAULT
    from scaleout.cli.bench_train import WORKLOADS_HELP
    from scaleout.workloads.registry import workload_names

    assert [w.strip() for w in WORKLOADS_HELP.replace(" or ", ", ").split(",")] == list(
        workload_names())
    out = _run(PROBE.format(argv=["bench", "train", "--help"]))
    assert f"{AUTO_WARMUP}, the least it takes" in " ".join(out.split())
    assert f"{AUTO_WARMUP_DEFAULT} with --compression auto" in " ".join(out.split())
