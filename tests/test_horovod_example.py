"""examples/horovod_digits.py, a Horovod script but for its import line, trains under `scaleout run`;
a Horovod script runs under torchrun and (where installed) Open MPI's mpirun; torch.compile with
the DistributedOptimizer trains with no warnings."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness import free_port, machine_notice, scaleout_run

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "horovod_digits.py"


def test_only_the_import_line_names_scaleout() -> None:
    lines = [line for line in EXAMPLE.read_text().splitlines() if "scaleout" in line
             and not line.startswith(("Run with", "      or", "With Horovod"))]
    code = [line for line in lines if not line.lstrip().startswith("#")]
    assert [re.sub(r"\s+#.*", "", line) for line in code] == ["import scaleout.horovod as hvd"]


def test_example_trains_on_two_ranks() -> None:
    pytest.importorskip("sklearn")
    done = scaleout_run("-n", "2", str(EXAMPLE), "--epochs", "3", "--log-interval", "1000")
    accuracies = [float(m) for m in re.findall(r"accuracy ([\d.]+)%", done.stdout)]
    assert len(accuracies) == 3 and accuracies[-1] > 80.0, done.stdout[-2000:]


SCRIPT = """
import torch
import scaleout.horovod as hvd
hvd.init(timeout=60)
total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum).item()
print(f"RESULT rank={hvd.rank()} size={hvd.size()} local={hvd.local_rank()} sum={total}")
"""


def _launch(command: list[str], script: Path) -> list[str]:
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    done = subprocess.run(command + [str(script)], env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # (found anywhere, not line by line: a launcher that merges its ranks' output, as
    # mpirun does, can put two ranks' lines on one)
    return sorted(re.findall(r"RESULT rank=\d+ size=\d+ local=\d+ sum=[\d.]+", done.stdout))


def test_torchrun_launches_a_horovod_script(tmp_path: Path) -> None:
    script = tmp_path / "hvd_script.py"
    script.write_text(SCRIPT)
    got = _launch([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                   "--master_port", str(free_port())], script)
    assert got == ["RESULT rank=0 size=2 local=0 sum=1.0", "RESULT rank=1 size=2 local=1 sum=1.0"]


def test_mpirun_launches_a_horovod_script(tmp_path: Path) -> None:
    import shutil

    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun is not installed (Debian: apt-get install openmpi-bin)")
    script = tmp_path / "hvd_script.py"
    script.write_text(SCRIPT)
    got = _launch([mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2",
                   "-x", "MASTER_ADDR", "-x", "MASTER_PORT", "-x", "PYTHONPATH", sys.executable],
                  script)
    assert got == ["RESULT rank=0 size=2 local=0 sum=1.0", "RESULT rank=1 size=2 local=1 sum=1.0"]


COMPILED = """
import torch, torch.nn as nn
import scaleout.horovod as hvd
hvd.init(timeout=120)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
compiled = torch.compile(model)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), 0)
for step in range(3):
    opt.zero_grad()
    compiled(torch.randn(4, 8) + hvd.rank()).pow(2).mean().backward()
    opt.step()
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
same = hvd.allgather(flat[None])
print(f"RESULT equal={bool((same == same[0]).all())}")
"""


def test_torch_compile_with_the_distributed_optimizer_is_quiet(tmp_path: Path) -> None:
    script = tmp_path / "compiled.py"
    script.write_text(COMPILED)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "scaleout", "run", "-n", "2", str(script)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [line for line in (done.stdout + done.stderr).strip().splitlines()
             if not machine_notice(line)]
    assert sorted(lines) == ["[rank 0] RESULT equal=True", "[rank 1] RESULT equal=True"], lines
