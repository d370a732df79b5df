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


HELPS = [["--help"], ["run", "--help"], ["bench", "--help"], ["bench", "collectives", "--help"],
         ["bench", "train", "--help"], ["testbed", "--help"], ["testbed", "up", "--help"]]
#: Every HELPS command in turn, each output after a line that names it.
PROBES = """
import sys
from scaleout.cli.main import main
for argv in {argvs!r}:
    print("@@help " + repr(argv), flush=True)
    try:
        main(argv)
    except SystemExit:
        pass
    sys.stdout.flush()
"""


@pytest.fixture(scope="module")
def helps() -> dict[str, str]:
    """repr(argv) -> its help, for every HELPS command, from one process rather than one
    each (the bench commands' help imports torch: about 3 s a process here)."""
    out = _run(PROBES.format(argvs=HELPS))
    parts = re.split(r"^@@help (.*)\n", out, flags=re.M)[1:]  # name, help, name, help, ...
    found = dict(zip(parts[::2], parts[1::2]))
    assert list(found) == [repr(argv) for argv in HELPS], out
    return found


@pytest.mark.parametrize("argv", HELPS)
def test_help_has_no_rst_markup(argv: list[str], helps: dict[str, str]) -> None:
    out = helps[repr(argv)]
    assert out.startswith("usage: scaleout"), out  # (the command's own help, whole)
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


def test_bench_help_names_every_workload_and_the_auto_warmup(helps: dict[str, str]) -> None:
    from scaleout.bench.train_config import AUTO_WARMUP, AUTO_WARMUP_DEFAULT
    from scaleout.cli.bench_train import WORKLOADS_HELP
    from scaleout.workloads.registry import workload_names

    assert [w.strip() for w in WORKLOADS_HELP.replace(" or ", ", ").split(",")] == list(
        workload_names())
    out = helps[repr(["bench", "train", "--help"])]
    assert f"{AUTO_WARMUP}, the least it takes" in " ".join(out.split())
    assert f"{AUTO_WARMUP_DEFAULT} with --compression auto" in " ".join(out.split())
