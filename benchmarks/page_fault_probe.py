"""What a fresh CPU buffer costs on this machine: first touch (page faults) vs a reused one.

torch's gloo ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` go through a temporary
buffer of the whole size each call (counted on the testbed: 16385 minor page faults per
64 MB call, none for all_reduce, broadcast or all_to_all_single); glibc maps a buffer above
its largest mmap threshold (32 MiB on 64-bit) fresh on every allocation, so each call faults
in every page. This measures, in one process (not a collective), copying ``MB`` into a fresh
tensor and into a reused one; the difference per MB is the fault cost that
``scaleout.sim.collective_cases`` charges. Run::

    python3 benchmarks/page_fault_probe.py [MB] [REPEATS]
"""

import resource
import sys
import time

import torch


def main(mb: int = 64, repeats: int = 7) -> None:
    torch.set_num_threads(1)
    n = mb * 2**20 // 4
    src, kept = torch.ones(n), torch.empty(n)
    kept.copy_(src)
    fresh, reused, faults = [], [], []
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        buf = torch.empty(n)
        buf.copy_(src)
        fresh.append(time.perf_counter() - start)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        del buf
        start = time.perf_counter()
        kept.copy_(src)
        reused.append(time.perf_counter() - start)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    print(f"{mb} MB: fresh {med(fresh) * 1e3:.1f} ms, reused {med(reused) * 1e3:.1f} ms, "
          f"faults {med(faults)}; first touch {(med(fresh) - med(reused)) * 1e3 / mb:.2f} ms/MB")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
