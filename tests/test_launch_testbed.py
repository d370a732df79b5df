"""``scaleout run --testbed NAME``: one rank per host (more ranks are refused), each on a
machine of its own (``one_machine`` is false), and no c10d hostname warning (the hosts
resolve by name inside their namespaces). Needs root, iproute2."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness import require_testbed
from scaleout.testbed import Testbed, TestbedConfig
from scaleout.testbed.hostnames import NETNS_ETC

SRC = str(Path(__file__).parents[1] / "src")

JOB = """
    import os, sys, torch, scaleout
    env = scaleout.init(timeout=30)
    d = env.create_distribution()
    total = d.allreduce(torch.ones(1), group=scaleout.GroupType.DATA).wait()
    print(f"rank={env.rank} total={total.item():g} one_machine={env.launch.one_machine}")
    env.finalize()
    sys.stdout.flush()
    os._exit(0)  # see _TEARDOWN in test_launcher.py
"""


@pytest.mark.testbed
def test_run_on_testbed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require_testbed()
    monkeypatch.setenv("SCALEOUT_TESTBED_DIR", str(tmp_path / "testbeds"))
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    name = f"lr{os.getpid() % 100000}"
    env = {**os.environ, "PYTHONPATH": SRC}
    run = [sys.executable, "-m", "scaleout", "run", "--testbed", name]
    with Testbed(TestbedConfig(hosts=2, rate="1gbit", name=name)) as tb:
        namespaces = [host.namespace for host in tb.hosts]
        hosts = (NETNS_ETC / namespaces[1] / "hosts").read_text()
        assert f"::ffff:{tb.hosts[0].address} {namespaces[0]}\n" in hosts
        ok = subprocess.run([*run, "-n", "2", str(script)], env=env, capture_output=True,
                            text=True, timeout=90)
        assert ok.returncode == 0, ok.stdout + ok.stderr
        # each host is a machine of its own (an open policy keeps priority there), though
        # the launcher that started both ranks counts them as local
        assert "[rank 1] rank=1 total=2 one_machine=False" in ok.stdout
        assert "cannot be retrieved" not in ok.stdout + ok.stderr
        many = subprocess.run([*run, "-n", "3", str(script)], env=env, capture_output=True,
                              text=True, timeout=30)
        assert many.returncode == 2
        assert many.stderr == (f"scaleout run: error: testbed {name!r} has 2 hosts and runs one "
                               "rank per host: give -n 2 or fewer, or bring up a testbed with "
                               "--hosts 3\n")
    assert not any((NETNS_ETC / ns).exists() for ns in namespaces)
