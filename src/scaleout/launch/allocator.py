"""The host allocator's settings a launcher gives its ranks (``scaleout run --allocator``).

A training iteration allocates and frees the same large tensors every time (activations,
gradients, the optimizer's temporaries). With glibc's defaults, freed memory at the top of
the heap beyond ``M_TRIM_THRESHOLD`` goes back to the kernel and blocks above
``M_MMAP_THRESHOLD`` (128 KiB, growing with use to at most 32 MiB; the trim threshold
follows at twice it) are mapped fresh, so the next iteration page-faults the same memory in
again, zeroed by the kernel: 23,000-35,000 minor faults per ResNet-18 iteration on 2 ranks
(90-140 MB), 60-105 ms of system time per iteration (benchmarks/RESULTS.md, "The
allocator keeps freed memory").

``keep`` (the default) raises both thresholds to 1 GiB through ``GLIBC_TUNABLES``, which
glibc reads when a process starts: freed memory stays in the process and is reused, and
the faults fall to a few hundred per iteration. The price is that a rank keeps its peak
heap (up to 1 GiB freed at its top) instead of returning it. ``system`` leaves glibc's
defaults. Tunables the user already set in ``GLIBC_TUNABLES`` win; where the C library is
not glibc nothing is set. torch's own launcher sets ``OMP_NUM_THREADS`` the same way.
"""

from __future__ import annotations

import platform
from collections.abc import Mapping

__all__ = ["ALLOCATORS", "DEFAULT_ALLOCATOR", "KEEP_TUNABLES", "TUNABLES_VAR", "allocator_env",
           "check_allocator"]

#: ``--allocator`` choices.
ALLOCATORS = ("keep", "system")
#: What a launch gets unless told otherwise.
DEFAULT_ALLOCATOR = "keep"
#: glibc reads its tunables from this variable at start-up.
TUNABLES_VAR = "GLIBC_TUNABLES"
#: What ``keep`` sets: no trimming and no fresh mappings below 1 GiB.
KEEP_TUNABLES = (("glibc.malloc.trim_threshold", str(1 << 30)),
                 ("glibc.malloc.mmap_threshold", str(1 << 30)))


def check_allocator(allocator: object) -> None:
    """Raise ``ValueError`` unless ``allocator`` is one of :data:`ALLOCATORS`."""
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator must be one of {', '.join(ALLOCATORS)}, got {allocator!r}")


def allocator_env(allocator: str, environ: Mapping[str, str],
                  libc: str | None = None) -> dict[str, str]:
    """The variables to add to a rank's environment for ``allocator``.

    Args:
        allocator: one of :data:`ALLOCATORS`.
        environ: the environment the rank would get otherwise (its ``GLIBC_TUNABLES``, if
            any, is kept, with ``keep``'s tunables added for the names it does not set).
        libc: the C library's name (``None``: this Python's, by ``platform.libc_ver``).

    Raises:
        ValueError: an unknown ``allocator``.

    Example:
        >>> allocator_env("keep", {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"},
        ...               libc="glibc")
        {'GLIBC_TUNABLES': 'glibc.malloc.trim_threshold=0:glibc.malloc.mmap_threshold=1073741824'}
    """
    check_allocator(allocator)
    libc = platform.libc_ver()[0] if libc is None else libc
    if allocator == "system" or libc != "glibc":
        return {}
    current = [item for item in environ.get(TUNABLES_VAR, "").split(":") if item]
    named = {item.split("=", 1)[0] for item in current}
    added = [f"{name}={value}" for name, value in KEEP_TUNABLES if name not in named]
    return {TUNABLES_VAR: ":".join(current + added)} if added else {}
