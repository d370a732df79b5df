"""Testbed defects that were documented but left alone (stop 52): each test failed before
its fix. Tests needing root and iproute2 skip without them (fail under ``CI=true``).

- ``scaleout testbed down --all`` removed every ``so-*`` namespace no state file of its own
  state directory claimed: the live testbeds of other state directories too;
- an explicit ``--subnet`` was not checked against the other live testbeds': a second
  testbed came up on the first one's addresses;
- ``scaleout run --testbed T --nnodes 2`` printed a command for node 1 without
  ``--testbed``: node 1's ranks ran off the testbed.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from scaleout.cli.main import main
from scaleout.testbed import Testbed, TestbedConfig, remove_stale
from scaleout.testbed.system import System

from harness import require_testbed

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _name(tag: str) -> str:
    return f"{tag}{os.getpid() % 100000}"


@pytest.fixture
def state_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private state directory, so tests never see a user's testbeds."""
    monkeypatch.setenv("SCALEOUT_TESTBED_DIR", str(tmp_path / "mine"))
    return tmp_path / "mine"


def _namespaces(name: str) -> list[str]:
    return sorted(ns for ns in System().namespaces() if ns.startswith(f"so-{name}-"))


class _Blinkered(System):
    """The machine's namespaces as the testbed code sees them, but only those of the given
    testbed names: whatever ``down --all`` would reach, it never reaches a testbed that
    another session on this machine runs meanwhile (the code before the fix would have)."""

    names: tuple[str, ...] = ()

    def namespaces(self) -> list[str]:
        return [ns for ns in super().namespaces()
                if ns.startswith(tuple(f"so-{name}-" for name in self.names))]


@pytest.mark.testbed
def test_down_all_leaves_other_state_directories_testbeds(
        state_directory: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require_testbed()
    import scaleout.testbed.testbed as testbed_module

    mine, theirs = _name("bm"), _name("bt")
    monkeypatch.setattr(_Blinkered, "names", (mine, theirs))
    monkeypatch.setattr(testbed_module, "System", _Blinkered)
    other = Testbed(TestbedConfig(hosts=1, rate="1gbit", name=theirs), directory=tmp_path / "o")
    with other:
        with Testbed(TestbedConfig(hosts=1, rate="1gbit", name=mine)) as tb:
            tb.state  # (up)
            assert main(["testbed", "down", "--all"]) == 0
            assert _namespaces(mine) == []
            # before: so-<theirs>-h0 and -sw were removed too, under the other's feet
            assert _namespaces(theirs) == [f"so-{theirs}-h0", f"so-{theirs}-sw"]
            assert remove_stale() == []  # the Python default reaches no further
            assert _namespaces(theirs) == [f"so-{theirs}-h0", f"so-{theirs}-sw"]
        assert main(["testbed", "down", "--orphans", "--json"]) == 0
        assert _namespaces(theirs) == []  # asked for: every unclaimed so-* namespace


def test_remove_stale_refuses_two_orphan_scopes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="give one of them"):
        remove_stale(directory=tmp_path, orphans_of="tb", all_orphans=True)


def test_a_subnet_overlap_names_the_other_testbed() -> None:
    from scaleout.testbed.naming import check_subnet_free

    check_subnet_free("10.213.1.0/24", {"a": "10.213.0.0/24"})
    with pytest.raises(ValueError, match=r"subnet: 10.213.0.0/25 overlaps 10.213.0.0/24, the "
                                         r"subnet of testbed 'a', which is up"):
        check_subnet_free("10.213.0.0/25", {"a": "10.213.0.0/24"})


@pytest.mark.testbed
def test_an_explicit_subnet_in_use_is_refused(state_directory: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    require_testbed()
    first, second = _name("sa"), _name("sb")
    with Testbed(TestbedConfig(hosts=1, rate="1gbit", name=first)) as tb:
        subnet = tb.config.subnet
        assert main(["testbed", "up", "--hosts", "1", "--rate", "1gbit", "--name", second,
                     "--subnet", str(subnet)]) == 2
        err = capsys.readouterr().err
        assert f"overlaps {subnet}, the subnet of testbed {first!r}" in err
        assert _namespaces(second) == [] and not (state_directory / f"{second}.json").exists()


SHOW_NAMESPACE = """
import os, subprocess
ns = subprocess.run(["ip", "netns", "identify", str(os.getpid())], capture_output=True,
                    text=True).stdout.strip()
print("netns=" + ns, flush=True)
"""


@pytest.mark.testbed
def test_the_other_nodes_command_runs_them_on_the_testbed(state_directory: Path,
                                                          tmp_path: Path) -> None:
    require_testbed()
    name = _name("bn")
    script = tmp_path / "show_namespace.py"
    script.write_text(SHOW_NAMESPACE)
    env = {**os.environ, "PYTHONPATH": SRC, "SCALEOUT_JOB_TOKEN": "the job's secret"}
    with Testbed(TestbedConfig(hosts=2, rate="1gbit", name=name)):
        node0 = subprocess.run(
            [sys.executable, "-m", "scaleout", "run", "-n", "1", "--nnodes", "2",
             "--master-port", "29517", "--testbed", name, str(script)],
            env=env, capture_output=True, text=True, timeout=60)
        assert node0.returncode == 0, node0.stdout + node0.stderr
        assert f"netns=so-{name}-h0" in node0.stdout
        line = next(line for line in node0.stdout.splitlines()
                    if line.strip().startswith("scaleout run "))
        argv = shlex.split(line)
        assert argv[argv.index("--testbed") + 1] == name, line  # before: no --testbed
        node1 = subprocess.run([sys.executable, "-m", "scaleout", *argv[1:]], env=env,
                               capture_output=True, text=True, timeout=60)
        assert node1.returncode == 0, node1.stdout + node1.stderr
        assert f"netns=so-{name}-h1" in node1.stdout, node1.stdout
