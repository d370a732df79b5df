"""The benchmarks on CUDA, through the real commands (ranks are fresh processes, so this
process never initialises CUDA). ``gpu``: skipped without CUDA, failures under
``SCALEOUT_REQUIRE_GPU=1``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import cuda_available
from scaleout.cli.main import main


@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_bench_collectives_on_cuda(tmp_path: Path) -> None:
    out = tmp_path / "coll.json"
    # allreduce only: torch's own side would call gloo's allgather on CUDA tensors, which
    # torch documents as unsupported (scaleout's codecs' allgathers are tested elsewhere).
    assert main(["bench", "collectives", "-n", "2", "--device", "cuda", "--ops",
                 "allreduce,bcast", "--sizes", "64K", "--rounds", "2", "--budget", "0.01",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["device"].startswith("cuda") and report["backend"] == "gloo"  # 2 ranks, 1 GPU
    assert all(r["time_s"] > 0 for r in report["results"])


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_bench_train_on_cuda(tmp_path: Path) -> None:
    out = tmp_path / "train.json"
    code = main(["bench", "train", "--workload", "digits-mlp", "--device", "cuda", "--rounds", "1",
                 "--iters", "3", "--warmup", "1", "--vs", "ddp,ddp-powersgd", "--no-testbed",
                 "--no-progress", "--json", str(out)])
    report = json.loads(out.read_text())
    failed = {r["config"]: r["reason"] for r in report["runs"] if "error" in r}
    assert code == 0 and not failed, failed
    assert all(r["device"].startswith("cuda") for r in report["runs"])


def test_bench_codecs_on_cuda_is_refused_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    if cuda_available():
        pytest.skip("CUDA is available here")
    assert main(["bench", "codecs", "--device", "cuda", "--sizes", "4K"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_bench_codecs_on_cuda(tmp_path: Path) -> None:
    """In a fresh process: the codec bench initialises CUDA in the process that runs it."""
    import subprocess
    import sys

    out = tmp_path / "codecs.json"
    subprocess.run([sys.executable, "-m", "scaleout.cli.main", "bench", "codecs", "--device", "cuda",
                    "--sizes", "1M", "--repeats", "3", "--json", str(out)], check=True, timeout=170)
    report = json.loads(out.read_text())
    assert report["device"].startswith("cuda")
    assert not [r for r in report["results"] if "error" in r]
