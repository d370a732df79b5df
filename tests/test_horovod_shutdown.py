"""``hvd.shutdown()`` (also run at exit) meets the other ranks in a signature exchange of its
own. Horovod's face turns the core's consistency check off, so before, a rank that skipped a
collective met its peer's signature exchange in ``finalize()`` unchecked: it left with exit
code 0 while the peer failed. An error in the at-exit shutdown was printed by Python and
ignored, with exit code 0 too."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import torch
    import scaleout.horovod as hvd

    hvd.init(timeout=20)
    try:
        for step in range(3):
            if not (hvd.rank() == 1 and step == 1):  # rank 1 skips one all-reduce
                hvd.allreduce(torch.ones(3), name="x")
    except Exception as err:
        print(f"CAUGHT {type(err).__name__}: {err}", flush=True)
    print(f"DONE {hvd.rank()}", flush=True)
""")


def test_a_rank_that_skipped_a_collective_fails_at_shutdown(tmp_path: Path) -> None:
    script = tmp_path / "skip.py"
    script.write_text(SCRIPT)
    src = str(Path(__file__).resolve().parent.parent / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "scaleout", "run", "-n", "2", str(script)],
                          env=env, capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    # rank 0 met rank 1's shutdown in its third all-reduce; rank 1 (its loop done) was told too
    assert "CAUGHT TensorMismatchError" in out and "this rank: allreduce" in out, out
    assert "rank 1: hvd.shutdown() at exit failed" in out and "this rank: shutdown" in out, out
    assert "rank 1 failed first, with exit code 1" in out, out
