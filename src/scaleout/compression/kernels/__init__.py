"""Fused device kernels for the codecs whose torch paths take many passes (Triton).

On a GPU, blockquant and sign as sequences of torch kernels make 12-20 passes over the
gradient (19x and 62x one device-to-device copy of 25M fp32 values on an H100); fused, each
step is one or two passes (docs/compression.md). Triton ships with PyTorch's CUDA wheels,
so the fused path costs no new dependency there; without Triton, or for float64, or for a
block size that is not a power of two, the codecs run their torch path (same results).

``SCALEOUT_FUSED_CODECS=0`` turns the kernels off (for comparisons). With
``TRITON_INTERPRET=1`` (set before this package is first used) Triton runs the kernels on
CPU tensors, slowly, which lets the CPU suite check them against the torch path.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

import torch

__all__ = ["kernels_for"]

_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def kernels_for(codec: str, device: torch.device, dtype: torch.dtype, block: int) -> ModuleType | None:
    """The kernel module of ``codec`` (``"blockquant"`` or ``"sign"``) if it serves tensors
    of ``dtype`` on ``device`` in blocks of ``block`` values, else ``None`` (the caller runs
    its torch path).

    Serves: float32, float16 and bfloat16 on a CUDA device (or on the CPU under
    ``TRITON_INTERPRET=1``), blocks of a power of two from 8 to 8192 values, Triton
    importable, and ``SCALEOUT_FUSED_CODECS`` not ``0``.
    """
    if os.environ.get("SCALEOUT_FUSED_CODECS", "1") == "0" or dtype not in _FUSED_DTYPES:
        return None
    if not 8 <= block <= 8192 or block & (block - 1):
        return None
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if not (device.type == "cuda" or (interpreted and device.type == "cpu")):
        return None
    return _load(codec)


@functools.lru_cache(maxsize=None)
def _load(codec: str) -> ModuleType | None:
    """Import the kernels once; ``None`` where Triton is missing or cannot load."""
    try:
        return importlib.import_module(f"scaleout.compression.kernels.{codec}")
    except ImportError:
        return None
