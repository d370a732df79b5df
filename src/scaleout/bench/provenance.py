"""What a benchmark's JSON records to be reproduced: the machine, the code and the settings
from the environment (``bench train``, ``bench collectives`` and ``bench codecs`` alike).

* ``machine``: CPU model and count (and how many this process may use), the GPUs' names
  (from ``nvidia-smi``, which leaves this process's CUDA state alone: the CPU benchmarks
  hide CUDA from torch, which must not have looked yet), the load average, platform,
  Python and torch versions;
* ``source``: the scaleout source in use (its folder), the git commit it is at, and whether
  that folder has uncommitted changes (``dirty``, with the changed paths); ``git: null``
  when the source is not a git checkout (an installed wheel) or git is missing;
* ``scaleout_env``: every ``SCALEOUT_*`` environment variable set.

Example:
    >>> facts = run_facts()
    >>> sorted(facts)
    ['machine', 'scaleout_env', 'source']
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

__all__ = ["cpu_model", "gpu_names", "machine_facts", "run_facts", "scaleout_env",
           "source_facts"]

#: Seconds a helper command (git, nvidia-smi) may take before its fact is left out.
COMMAND_TIMEOUT_S = 10.0
#: Changed paths listed at most (a dirty tree's count is always given).
MAX_CHANGED = 50


def _run(argv: list[str], cwd: str | None = None) -> str | None:
    """A command's stdout, or ``None`` when it is missing, fails or hangs."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def cpu_model() -> str | None:
    """The CPU's model name (``/proc/cpuinfo``, else the platform's), or ``None``."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def gpu_names() -> list[str]:
    """The names of the GPUs ``nvidia-smi`` lists (none without it)."""
    out = _run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"])
    return [line.strip() for line in (out or "").splitlines() if line.strip()]


def machine_facts() -> dict[str, object]:
    """Facts that matter when reading the numbers later: CPU and GPUs, load, versions."""
    import torch

    facts: dict[str, object] = {
        "cpus": os.cpu_count(), "cpu_model": cpu_model(), "gpus": gpu_names(),
        "platform": platform.platform(), "machine": platform.machine(),
        "python": platform.python_version(), "torch": torch.__version__,
    }
    if hasattr(os, "sched_getaffinity"):
        facts["cpus_usable"] = len(os.sched_getaffinity(0))
    if hasattr(os, "getloadavg"):
        facts["loadavg"] = list(os.getloadavg())
    return facts


def source_facts() -> dict[str, Any]:
    """The scaleout source in use: ``path``, ``git`` (``commit``, ``dirty``, ``changed``)
    or ``None`` when it is not a git checkout."""
    import scaleout

    folder = str(Path(scaleout.__file__).resolve().parent)
    facts: dict[str, Any] = {"path": folder, "version": getattr(scaleout, "__version__", None),
                             "git": None}
    commit = _run(["git", "rev-parse", "HEAD"], cwd=folder)
    if commit is None:
        return facts
    status = _run(["git", "status", "--porcelain", "--", "."], cwd=folder)
    changed = [line[3:] for line in (status or "").splitlines() if line.strip()]
    facts["git"] = {"commit": commit.strip(), "dirty": bool(changed) if status is not None
                    else None, "changed": changed[:MAX_CHANGED], "changed_count": len(changed)}
    return facts


def scaleout_env() -> dict[str, str]:
    """Every ``SCALEOUT_*`` variable of this process's environment (what the ranks inherit)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("SCALEOUT_")}


def run_facts() -> dict[str, Any]:
    """``{"machine": ..., "source": ..., "scaleout_env": ...}`` for a benchmark's JSON."""
    return {"machine": machine_facts(), "source": source_facts(), "scaleout_env": scaleout_env()}
