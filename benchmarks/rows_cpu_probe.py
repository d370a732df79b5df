"""CPU seconds per MB of the ``rows`` codec's whole exchange on DLRM's tables, alone.

``scaleout.sim.testbed_cases`` charges the row-sparse exchange its own CPU per byte of the
tables it reads. This measures it as ``benchmarks/codec_cpu_probe.py`` measures the other
codecs (``compressed_allreduce`` on a world-size-1 gloo group: encode, both rounds, decode;
no network; the process's CPU time, one thread, median of 50 runs), on a bucket shaped like
the ``dlrm`` workload's 26 tables with 256 touched rows per table
(``benchmarks/rows_exchange_cpu.py``'s), the dense all-reduce beside it. Run::

    PYTHONPATH=src python3 benchmarks/rows_cpu_probe.py
"""

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as tdist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rows_exchange_cpu import TABLES, gradient  # noqa: E402

from scaleout.compression import compressed_allreduce, make_codec  # noqa: E402
from scaleout.compression.state import CodecState  # noqa: E402
from scaleout.core.communicator import Communicator  # noqa: E402

SPECS = ("none", "rows:dense_above=0.9")


def main(repeats: int = 50, warmup: int = 10) -> None:
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1,
                             timeout=timedelta(seconds=120))
    x = gradient(sum(rows * width for rows, width in TABLES), torch.Generator().manual_seed(0))
    mb = x.numel() * 4 / 2**20
    for spec in SPECS:
        codec, work, state = make_codec(spec), torch.empty_like(x), CodecState()
        comm = Communicator.of_group(name="probe")
        cpu = []
        for index in range(warmup + repeats):
            work.copy_(x)
            began = time.process_time()
            compressed_allreduce(codec, work, state, comm, group=None).wait()
            if index >= warmup:
                cpu.append(time.process_time() - began)
        c = sorted(cpu)[len(cpu) // 2]
        print(f"{spec:22s} {mb:5.2f} MB  cpu {c * 1e3:6.2f} ms  cpu {c * 1e3 / mb:.3f} ms/MB",
              flush=True)
    tdist.destroy_process_group()


if __name__ == "__main__":
    main()
