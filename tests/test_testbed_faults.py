"""Faults on the emulated cluster (root, iproute2; skipped without them, failed under CI=true):
the testbed benchmark cleans up on SIGTERM/SIGHUP/SIGINT (SIGKILL leaves state the next ``up``
removes); a link going down mid-training is named by the survivors; packet loss and a straggler
slow training down but leave it exact."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import require_testbed

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _netns_pids(namespace: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True,
                         text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _bench(tmp_path: Path, *, ranks: int) -> tuple[subprocess.Popen, dict[str, object]]:
    """``scaleout bench train`` on a 2-host testbed, returned once ``ranks`` ranks run in it
    (1: the single-process baseline it runs first; 2: a data-parallel configuration)."""
    states = tmp_path / "testbeds"
    env = {**os.environ, "PYTHONPATH": SRC, "SCALEOUT_TESTBED_DIR": str(states)}
    bench = subprocess.Popen(
        [sys.executable, "-m", "scaleout", "bench", "train", "--workload", "digits-mlp",
         "--ranks", "2", "--rounds", "1", "--iters", "1500", "--warmup", "1", "--vs", "ddp",
         "--no-progress", "--timeout", "30"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True)

    def running() -> dict[str, object] | None:
        files = list(states.glob("*.json")) if states.exists() else []
        if not files:
            return None
        state = json.loads(files[0].read_text())
        names = [h["namespace"] for h in state["hosts"]]
        pids = [_netns_pids(n) for n in names]
        return {"file": files[0], "namespaces": names, "pids": sum(pids, [])} \
            if sum(map(bool, pids)) >= ranks else None

    try:
        found = _wait_for(running, 60, "the benchmark's ranks to run on the testbed")
    except BaseException:
        os.killpg(bench.pid, signal.SIGKILL)
        bench.wait()
        raise
    return bench, found


@pytest.mark.testbed
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_bench_on_testbed_cleans_up_on_sigterm(tmp_path: Path) -> None:
    require_testbed()
    sig = signal.SIGTERM
    bench, found = _bench(tmp_path, ranks=2)
    sent = time.monotonic()
    bench.send_signal(sig)
    try:
        _, err = bench.communicate(timeout=30)
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
    took = time.monotonic() - sent
    assert bench.returncode == 128 + sig, err
    assert f"interrupted ({signal.Signals(sig).name}); ranks stopped and testbed removed" in err
    assert not Path(found["file"]).exists()
    assert not set(found["namespaces"]) & _namespaces()
    assert not [p for p in found["pids"] if _alive(p)]
    print(f"{signal.Signals(sig).name}: clean in {took:.2f} s")


def test_sighup_and_sigint_stop_the_benchmark_like_sigterm() -> None:
    """The same path as SIGTERM, without a testbed: the handler outside the launcher, and
    the launcher's own report of a signal (it takes all three while ranks run)."""
    from scaleout.bench.train import Interrupted, _launcher_stopped
    from scaleout.cli.bench_train import _terminate_as_interrupt

    # the dispositions of a terminal's foreground job, even where the tests run under nohup
    # or in the background of a script (SIGHUP, SIGINT ignored: they would stay so)
    terminal = {signal.SIGHUP: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler,
                signal.SIGTERM: signal.SIG_DFL}
    inherited = {sig: signal.signal(sig, handler) for sig, handler in terminal.items()}
    try:
        for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
            with pytest.raises(Interrupted) as caught:
                with _terminate_as_interrupt():
                    try:
                        os.kill(os.getpid(), sig)
                        time.sleep(5)
                    finally:
                        os.kill(os.getpid(), sig)  # a second one, during clean-up: ignored
            assert caught.value.signum == sig
            name = signal.Signals(sig).name
            assert _launcher_stopped(128 + sig, ["...", f"scaleout run: got {name}; "
                                                    "stopped every rank"])
            # a rank killed by the same signal from outside: a failed configuration, not a stop
            assert not _launcher_stopped(128 + sig, [f"scaleout run: rank 1 failed first, with "
                                                     f"signal {name}"])
        # the launcher took the first signal and the benchmark raised: a second one is ignored
        with pytest.raises(Interrupted) as caught:
            with _terminate_as_interrupt():
                try:
                    raise Interrupted(signal.SIGTERM)
                finally:
                    os.kill(os.getpid(), signal.SIGHUP)
        assert caught.value.signum == signal.SIGTERM
        assert {sig: signal.getsignal(sig) for sig in terminal} == terminal  # restored
    finally:
        for sig, handler in inherited.items():
            signal.signal(sig, handler)


def test_an_ignored_sighup_stays_ignored_by_the_benchmark() -> None:
    """Under nohup (SIGHUP ignored) a closed terminal does not stop ``bench train``, as it
    does not stop ``scaleout run``; the disposition is the same afterwards."""
    from scaleout.cli.bench_train import _terminate_as_interrupt

    hangup = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with _terminate_as_interrupt():
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.2)  # (a handler would have raised by now)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, hangup)


@pytest.mark.testbed
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_killed_leaves_state_the_next_up_removes(tmp_path: Path) -> None:
    require_testbed()
    from scaleout.testbed import Testbed, TestbedConfig

    bench, found = _bench(tmp_path, ranks=1)
    bench.kill()
    bench.wait()
    # the ranks die with their launcher (parent-death signal); the namespaces stay
    _wait_for(lambda: not [p for p in found["pids"] if _alive(p)], 10, "the ranks to exit")
    # Left behind: the state file and namespaces. (One full suite, 2026-11-23, saw one of the
    # three namespaces gone at this point, cause unknown; the claim tested is that what a
    # killed benchmark leaves, the next testbed up removes.)
    assert Path(found["file"]).exists() and set(found["namespaces"]) & _namespaces()
    os.environ["SCALEOUT_TESTBED_DIR"] = str(tmp_path / "testbeds")
    try:
        with Testbed(TestbedConfig(hosts=1, rate="1gbit", name=f"fk{os.getpid() % 10**5}")):
            assert not Path(found["file"]).exists()  # the stale testbed was removed
            assert not set(found["namespaces"]) & _namespaces()
    finally:
        del os.environ["SCALEOUT_TESTBED_DIR"]


# -- faults while training on a testbed -----------------------------------------------------

TRAIN = """
import os, sys, time
import torch
from torch import nn
import scaleout
from scaleout.pytorch import DataParallel, DistributedOptimizer

mode, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
env = scaleout.init(timeout=60)
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))
model = DataParallel(net)
opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), model)
per = 12 // env.world_size
for step in range(steps):
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(12, 32, generator=gen), torch.randn(12, 4, generator=gen)
    if mode == "straggler" and env.rank == 1:
        time.sleep(float(os.environ["STRAGGLE_S"]))  # this rank computes ~3x longer
    mine = slice(env.rank * per, (env.rank + 1) * per)
    (model(x[mine]) - y[mine]).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    if env.rank == 0:
        print(f"step {step} {time.monotonic():.4f}", flush=True)
model.synchronize()
if env.rank == 0:
    torch.save(net.state_dict(), out)
env.finalize()
"""


def _reference(steps: int) -> dict[str, object]:
    """One process on the whole batch: what every exact run must end with."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(12, 32, generator=gen), torch.randn(12, 4, generator=gen)
        (net(x) - y).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return net.state_dict()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    """A 3-host testbed of this test module (its own name and state directory)."""
    require_testbed()
    from scaleout.testbed import Testbed, TestbedConfig

    states = tmp_path_factory.mktemp("testbeds")
    previous = os.environ.get("SCALEOUT_TESTBED_DIR")
    os.environ["SCALEOUT_TESTBED_DIR"] = str(states)
    try:
        with Testbed(TestbedConfig(hosts=3, rate="1gbit", name=f"fa{os.getpid() % 10**5}")) as tb:
            yield tb
    finally:
        if previous is None:
            del os.environ["SCALEOUT_TESTBED_DIR"]
        else:
            os.environ["SCALEOUT_TESTBED_DIR"] = previous


class _Job:
    """``scaleout run --testbed`` of the training script; its output lines with the time
    each arrived."""

    def __init__(self, tb, tmp_path: Path, ranks: int, mode: str, steps: int,
                 env: dict[str, str]) -> None:
        import threading

        script = tmp_path / "train.py"
        script.write_text(TRAIN)
        self.weights = tmp_path / "weights.pt"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "scaleout", "run", "-n", str(ranks), "--testbed",
             tb.config.name, str(script), mode, str(steps), str(self.weights)],
            env={**os.environ, "PYTHONPATH": SRC, **env}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def steps_done(self) -> int:
        return sum(1 for _, line in self.lines if line.startswith("[rank 0] step "))

    def finish(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError("the job did not end in time:\n" + self.text()) from None
        self._reader.join(timeout=5)
        return code

    def step_seconds(self) -> float:
        """Mean seconds per step on rank 0, after the first 3 steps."""
        stamps = [float(line.split()[-1]) for _, line in self.lines
                  if line.startswith("[rank 0] step ")]
        return (stamps[-1] - stamps[3]) / (len(stamps) - 4)

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def _exact(job: _Job, steps: int) -> None:
    import torch

    weights = torch.load(job.weights, weights_only=True)
    for name, value in _reference(steps).items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.testbed
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_link_down_is_named_by_the_survivors(cluster, tmp_path: Path) -> None:
    job = _Job(cluster, tmp_path, 3, "train", 10**6, {"SCALEOUT_HEARTBEAT": "3"})
    _wait_for(lambda: job.steps_done() >= 5 or job.proc.poll() is not None, 90,
              "5 training steps")
    host = cluster.hosts[2]
    down = time.monotonic()
    subprocess.run(["ip", "netns", "exec", host.namespace, "ip", "link", "set", host.ifname,
                    "down"], check=True)
    try:
        code = job.finish(timeout=60)
    finally:
        subprocess.run(["ip", "netns", "exec", host.namespace, "ip", "link", "set",
                        host.ifname, "up"], check=False)
    text = job.text()
    assert code != 0, text
    noticed = [(t - down, line) for t, line in job.lines if "failed: no heartbeat" in line
               or "cannot complete: rank" in line]
    assert noticed, text
    first = noticed[0][0]
    assert first < 30, text
    # rank 1 watches rank 2 and names it; rank 0 reads it from the store within the
    # launcher's settle period; rank 2, cut off, names rank 0; the launcher blames rank 2
    for survivor in (0, 1):
        assert any(line.startswith(f"[rank {survivor}]") and "rank 2 failed" in line
                   for _, line in job.lines), text
    assert "scaleout run: rank 2 failed first" in text, text
    assert not [p for h in cluster.hosts for p in _netns_pids(h.namespace)], "left behind"
    print(f"\nlink down: first named after {first:.2f} s; ended {job.lines[-1][0] - down:.2f} "
          f"s after\n" + "\n".join(line for line in text.splitlines()
                                    if "failed" in line or "scaleout run" in line))


def _iptables(namespace: str, *rule: str) -> None:
    subprocess.run(["ip", "netns", "exec", namespace, "iptables", *rule], check=True,
                   capture_output=True, text=True)


@pytest.mark.testbed
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_packet_loss_leaves_training_exact(cluster, tmp_path: Path) -> None:
    import shutil

    if shutil.which("iptables") is None:  # an extra package, like Open MPI: .ci/run installs
        pytest.skip("needs iptables (apt-get install -y iptables) for random packet drops")
    namespace = cluster.hosts[1].namespace
    rule = ["-m", "statistic", "--mode", "random", "--probability", "0.05", "-j", "DROP"]
    try:
        _iptables(namespace, "-A", "INPUT", *rule)
        _iptables(namespace, "-A", "OUTPUT", *rule)
    except subprocess.CalledProcessError as err:  # a kernel without xt_statistic
        pytest.skip(f"iptables cannot drop packets at random here: {err.stderr.strip()}")
    try:
        job = _Job(cluster, tmp_path, 2, "train", 40, {})
        assert job.finish(timeout=120) == 0, job.text()
    finally:
        _iptables(namespace, "-F", "INPUT")
        _iptables(namespace, "-F", "OUTPUT")
    _exact(job, 40)
    print(f"\n5% loss on host 1: {job.step_seconds() * 1000:.1f} ms/step")


@pytest.mark.testbed
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_straggler_leaves_training_exact(cluster, tmp_path: Path) -> None:
    job = _Job(cluster, tmp_path, 2, "straggler", 30, {"STRAGGLE_S": "0.01"})
    assert job.finish(timeout=120) == 0, job.text()
    _exact(job, 30)
    print(f"\nstraggler (rank 1 sleeps 10 ms a step): {job.step_seconds() * 1000:.1f} ms/step")
