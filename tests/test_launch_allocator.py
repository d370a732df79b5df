"""The launcher's allocator settings: what ranks get, and that glibc then reuses freed memory."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from scaleout.launch.allocator import KEEP_TUNABLES, TUNABLES_VAR, allocator_env
from scaleout.launch.launcher import LaunchConfig

KEEP = ":".join(f"{name}={value}" for name, value in KEEP_TUNABLES)
GLIBC = platform.libc_ver()[0] == "glibc"


def test_keep_sets_both_thresholds_on_glibc() -> None:
    assert allocator_env("keep", {}, libc="glibc") == {TUNABLES_VAR: KEEP}
    assert KEEP == ("glibc.malloc.trim_threshold=1073741824:"
                    "glibc.malloc.mmap_threshold=1073741824")


def test_the_users_tunables_win_and_are_kept() -> None:
    mine = "glibc.malloc.mmap_threshold=65536:glibc.cpu.hwcaps=-AVX512F"
    assert allocator_env("keep", {TUNABLES_VAR: mine}, libc="glibc") == {
        TUNABLES_VAR: mine + ":glibc.malloc.trim_threshold=1073741824"}
    both = "glibc.malloc.trim_threshold=0:glibc.malloc.mmap_threshold=0"
    assert allocator_env("keep", {TUNABLES_VAR: both}, libc="glibc") == {}


def test_system_and_other_c_libraries_set_nothing() -> None:
    assert allocator_env("system", {}, libc="glibc") == {}
    assert allocator_env("keep", {}, libc="") == {}  # musl, macOS: the variable means nothing


@pytest.mark.parametrize("bad", ["jemalloc", "", None])
def test_an_unknown_allocator_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="allocator must be one of keep, system"):
        allocator_env(bad, {})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="allocator must be one of keep, system"):
        LaunchConfig(nprocs=1, allocator=bad)  # type: ignore[arg-type]


def test_scaleout_run_refuses_an_unknown_allocator() -> None:
    result = _run("--allocator", "tcmalloc", "-n", "1", "-c", "pass")
    assert result.returncode == 2
    assert "invalid choice: 'tcmalloc'" in result.stderr


# A rank that allocates, touches and frees 64 MiB eight times and prints the minor page
# faults of the last seven and its GLIBC_TUNABLES. 64 MiB is above the largest threshold glibc
# picks by itself (32 MiB), so with its defaults every round maps fresh pages.
_CHURN = textwrap.dedent("""
    import os, resource
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for i in range(8):
        if i == 1:
            start = faults()
        block = bytearray(64 << 20)  # zero-filled: every page touched
        del block
    print(f"faults={faults() - start} tunables={os.environ.get('GLIBC_TUNABLES', '-')}")
""")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    env.pop(TUNABLES_VAR, None)
    return subprocess.run([sys.executable, "-m", "scaleout", "run", *args], env=env,
                          capture_output=True, text=True, timeout=60)


def _churn(tmp_path: Path, *allocator: str) -> tuple[int, str]:
    script = tmp_path / "churn.py"
    script.write_text(_CHURN)
    result = _run(*allocator, "-n", "1", "--no-prefix", str(script))
    assert result.returncode == 0, result.stdout + result.stderr
    line = next(x for x in result.stdout.splitlines() if x.startswith("faults="))
    faults, tunables = (part.split("=", 1)[1] for part in line.split(" ", 1))
    return int(faults), tunables


@pytest.mark.skipif(not GLIBC, reason="GLIBC_TUNABLES is glibc's")
def test_ranks_reuse_freed_memory_with_keep(tmp_path: Path) -> None:
    kept, tunables = _churn(tmp_path)  # the default
    assert tunables == KEEP
    returned, tunables = _churn(tmp_path, "--allocator", "system")
    assert tunables == "-"
    pages = 7 * (64 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert returned > pages // 2, returned  # each round faulted its 64 MiB in again
    assert kept < pages // 20, kept  # the first round's pages, reused


def test_the_other_nodes_get_the_same_allocator() -> None:
    from scaleout.launch.launcher import node_command

    token = {"SCALEOUT_JOB_TOKEN": "the job's secret"}
    config = LaunchConfig(nprocs=2, nnodes=2, master_addr="node0", master_port=29500,
                          env=token, allocator="system")
    assert node_command(["train.py"], config, 1) == (
        "scaleout run -n 2 --nnodes 2 --node-rank 1 --master-addr node0 --master-port 29500 "
        "--allocator system train.py")
    default = LaunchConfig(nprocs=2, nnodes=2, master_addr="node0", master_port=29500,
                           env=token)
    assert "--allocator" not in node_command(["train.py"], default, 1)
