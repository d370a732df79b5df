"""Host cost of the row-sparse exchange against a dense all-reduce, on DLRM's tables.

Each rank fills a bucket shaped like the ``dlrm`` workload's 26 embedding tables (5.0 MB)
with 256 touched rows per table (as a batch of 256 touches at most), then calls
``compressed_allreduce`` with the ``rows`` codec and, interleaved, a dense all-reduce of the
same bucket, 200 times each after 20 warm-up calls; rank 0 prints the wall time and the
process's CPU (every thread: gloo's included) per call. Run over loopback::

    torchrun --nproc_per_node 2 benchmarks/rows_exchange_cpu.py

Over loopback the dense bytes are memory copies, so this is the codec's host work beside a
dense exchange that costs the wire nothing (benchmarks/RESULTS.md, stop 33).
"""

import time

import torch

import scaleout
from scaleout.compression import CodecState, compressed_allreduce, make_codec
from scaleout.core import collectives
from scaleout.core.grid import GroupType

TABLES = [(20000, 16), (10000, 16), (5000, 16), (2000, 16), (1000, 16), (500, 16), (200, 16),
          (100, 16), (50, 16), (20, 16), (10, 16), (5, 16), (3, 16)] * 2
CALLS, WARMUP = 200, 20


def gradient(numel: int, generator: torch.Generator) -> torch.Tensor:
    flat, offset = torch.zeros(numel), 0
    for rows, width in TABLES:
        table = flat[offset:offset + rows * width].view(rows, width)
        offset += rows * width
        table[torch.randint(0, rows, (256,), generator=generator)] = torch.randn(
            256, width, generator=generator)
    return flat


def main() -> None:
    torch.set_num_threads(1)
    env = scaleout.init(timeout=60)
    comm = env.create_distribution(env.world_size, 1).communicator(GroupType.DATA)
    numel = sum(rows * width for rows, width in TABLES)
    generator = torch.Generator().manual_seed(env.rank)
    grads = [gradient(numel, generator) for _ in range(4)]
    codec, state, bucket = make_codec("rows:dense_above=0.9"), CodecState(), torch.empty(numel)

    def rows(i: int) -> None:
        bucket.copy_(grads[i % 4])
        compressed_allreduce(codec, bucket, state, comm, shapes=TABLES).wait(timeout=30)

    def dense(i: int) -> None:
        bucket.copy_(grads[i % 4])
        collectives.allreduce(comm, bucket).wait(timeout=30)

    for name, call in (("rows", rows), ("dense", dense), ("rows", rows), ("dense", dense)):
        for i in range(WARMUP):
            call(i)
        cpu, wall = time.process_time(), time.perf_counter()
        for i in range(CALLS):
            call(i)
        if env.rank == 0:
            print(f"{name}: {(time.perf_counter() - wall) / CALLS * 1e3:.2f} ms wall, "
                  f"{(time.process_time() - cpu) / CALLS * 1e3:.2f} ms process CPU per call",
                  flush=True)
    env.finalize()


if __name__ == "__main__":
    main()
