import contextlib
import io
import os
import sys
from pathlib import Path

import pytest

# Where torch is asked about CUDA in this process, it asks NVML rather than the CUDA driver:
# the driver initialised here would make CUDA unusable in the ranks the harness forks.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import torch  # noqa: E402

# Forked ranks inherit this process; keep its intra-op pool single-threaded so that
# forking after torch work is safe and ranks do not oversubscribe the cores.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))

from harness import cuda_available  # noqa: E402


def _no_gpu_reason() -> str | None:
    """Why ``gpu`` tests cannot run here, or ``None`` when CUDA is available."""
    if cuda_available():
        return None
    if not torch.backends.cuda.is_built():
        return f"needs CUDA: this torch ({torch.__version__}) is built without CUDA"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hidden = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
    return f"needs CUDA: torch {torch.__version__} sees no CUDA device{hidden}"


def pytest_runtest_setup(item: pytest.Item) -> None:
    """``gpu`` tests skip without CUDA, saying why; with SCALEOUT_REQUIRE_GPU=1 they fail."""
    if item.get_closest_marker("gpu") is None:
        return
    reason = _no_gpu_reason()
    if reason is None:
        return
    if os.environ.get("SCALEOUT_REQUIRE_GPU", "0") not in ("", "0"):
        pytest.fail(f"SCALEOUT_REQUIRE_GPU=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(autouse=True, scope="module")
def _no_process_group_left_behind(request: pytest.FixtureRequest):
    """A test module that initialises torch.distributed in this process must finalize it:
    the ranks later tests fork would inherit the group and refuse to initialise their own.
    (Per module: a module-scoped fixture may keep one group for its tests.)"""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail(f"{request.node.nodeid} left torch.distributed initialised in the test "
                    "process (call env.finalize())", pytrace=False)


@pytest.fixture(scope="session")
def cold_bench(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, Path]:
    """``scaleout bench train`` of digits-mlp beside ddp over loopback, 2 rounds of fresh
    ranks (--cold), every scaleout run traced (--trace FOLDER/traces): its exit code, what it
    printed, FOLDER (its JSON: FOLDER/out.json). One run for two tests, the cold smoke test
    of test_bench_train.py and test_sim_bench_trace.py's, rather than one each: each of its
    6 launches starts ranks (about 3 s here)."""
    from scaleout.cli.main import main

    folder = tmp_path_factory.mktemp("cold-bench")
    src = str(Path(__file__).resolve().parents[1] / "src")
    path = os.environ.get("PYTHONPATH")
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setenv("PYTHONPATH", src if not path else f"{src}{os.pathsep}{path}")
        patch.delenv("SCALEOUT_TRACE", raising=False)
        code = main(["bench", "train", "--workload", "digits-mlp", "--ranks", "2", "--rounds", "2",
                     "--iters", "3", "--warmup", "1", "--vs", "ddp", "--no-progress",
                     "--no-testbed", "--cold", "--trace", str(folder / "traces"),
                     "--json", str(folder / "out.json")])
    return code, printed.getvalue(), folder
