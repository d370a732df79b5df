"""CPU seconds per MB of the ``rows`` codec's whole exchange on DLRM's tables, alone.

``scaleout.sim.testbed_cases`` charges the row-sparse exchange its own CPU per byte of the
tables it reads. This measures it as ``benchmarks/codec_cpu_probe.py`` measures the other
codecs (``compressed_allreduce`` on a world-size-1 gloo group: encode, both rounds, decode;
no network; the process's CPU time, one thread, median of 50 runs), on a bucket shaped like
the ``dlrm`` workload's 26 tables with 256 touched rows per table
(``benchmarks/rows_exchange_cpu.py``'s), passed with the tables' shapes as DataParallel passes
a bucket, beside the dense all-reduce. Two row-sparse variants: the exchange searches the
gradient for the touched rows, or it is handed them as a ``ROWS_TOUCHED`` hint built from the
batch's ids (``scaleout.pytorch.lookup_ids``, since stop 39; building it is timed too, the
forward's graph walk is not). Run::

    PYTHONPATH=src python3 benchmarks/rows_cpu_probe.py

Until stop 40 the bucket was passed without its shapes, as one 1-D tensor, which the codec
sends whole: its 0.15 ms/MB (stop 34) was the codec's copies of a dense exchange, not a
row-sparse one (benchmarks/RESULTS.md, stop 40).
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
from scaleout.compression.rows import ROWS_TOUCHED  # noqa: E402
from scaleout.compression.state import CodecState  # noqa: E402
from scaleout.core.communicator import Communicator  # noqa: E402

#: (label, codec spec, whether the exchange gets the touched rows as a ``ROWS_TOUCHED`` hint,
#: as DataParallel hands them over from the forward's ids since stop 39)
VARIANTS = (("none", "none", False), ("rows (search)", "rows:dense_above=0.9", False),
            ("rows (ids)", "rows:dense_above=0.9", True))


def main(repeats: int = 50, warmup: int = 10) -> None:
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1,
                             timeout=timedelta(seconds=120))
    x = gradient(sum(rows * width for rows, width in TABLES), torch.Generator().manual_seed(0))
    mb = x.numel() * 4 / 2**20
    touched = x.view(-1, TABLES[0][1]).ne(0).any(dim=1)  # (every table is 16 wide)
    ids = touched.nonzero().view(-1)  # the rows the batch looked up, tables back to back
    for label, spec, hinted in VARIANTS:
        codec, work, state = make_codec(spec), torch.empty_like(x), CodecState()
        comm = Communicator.of_group(name="probe")
        cpu = []
        for index in range(warmup + repeats):
            work.copy_(x)
            began = time.process_time()
            if hinted:  # the flags as LookupRows builds them from the forward's ids
                flags = state.scratch[ROWS_TOUCHED] = torch.zeros(touched.numel(),
                                                                  dtype=torch.bool)
                flags[ids] = True
            compressed_allreduce(codec, work, state, comm, group=None, shapes=TABLES).wait()
            if index >= warmup:
                cpu.append(time.process_time() - began)
        c = sorted(cpu)[len(cpu) // 2]
        print(f"{label:14s} {mb:5.2f} MB  cpu {c * 1e3:6.2f} ms  cpu {c * 1e3 / mb:.3f} ms/MB",
              flush=True)
    tdist.destroy_process_group()


if __name__ == "__main__":
    main()
