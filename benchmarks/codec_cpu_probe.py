"""CPU seconds per MB of each codec's whole exchange, on this machine (not a collective run).

``scaleout.sim.config.CODECS`` charges a codec its CPU work per input byte. This measures it
the way ``scaleout bench codecs`` timed the exchange until stop 49 (``compressed_allreduce``
on a world-size-1 gloo group: encode, the codec's rounds, decode; no network; the bench now
exchanges on two ranks, where cast, for one, does its work: a group of one skips it), but as the
process's CPU time rather than wall time, so that other load on the machine does not count:
on a 2-core machine shared with other work the wall time reads ~2x the CPU time, and the
simulator already shares the cores between compute and this work (processor sharing). One
thread, median of the timed runs.

``--ranks N`` exchanges on N local processes instead (a FileStore rendezvous), as the codecs
run in training: a group of one skips work (cast neither divides before narrowing nor scales
the sum back). There the process's CPU time would also count gloo's own threads moving the
bytes, which the simulator prices as the link's; the figure is the CPU time of the thread
that calls the codec (``time.thread_time``: encode, decode and the codec's arithmetic between
its rounds), printed beside the process's. Rank 0 prints.

The gradients are a workload's (``resnet18`` by default), fused into the buckets that
DataParallel's default plan makes of them (``scaleout.scheduler.build_plan``, FIFO: 1 MB
first, then 8 MB, in backward order) and passed with their shapes, as DataParallel passes
them. Until stop 41 they went as one 1-D tensor of 11.2M values: the same for the
element-wise codecs, but PowerSGD sends a 1-D tensor uncompressed, so its 0.24 ms/MB was a
copy, not PowerSGD (on the buckets: ~1 ms/MB). Run::

    PYTHONPATH=src python3 benchmarks/codec_cpu_probe.py [--ranks N] [WORKLOAD] [REPEATS] [CODEC ...]
"""

import os
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as tdist
import torch.multiprocessing as tmp

from scaleout.compression import compressed_allreduce, make_codec
from scaleout.compression.state import CodecState
from scaleout.core.communicator import Communicator
from scaleout.scheduler import SchedulerConfig
from scaleout.scheduler.plan import PlanItem, build_plan
from scaleout.workloads import get_workload

CODECS = ("none", "cast:fp16", "blockquant", "sign", "topk:ratio=0.01", "powersgd:rank=2")


def buckets(workload: str) -> list[list[tuple[int, ...]]]:
    """The shapes in each bucket of DataParallel's default plan (FIFO) for ``workload``."""
    shapes = [tuple(p.shape) for p in get_workload(workload).build_model(0).parameters()]
    items = [PlanItem(key=k, numel=max(1, torch.Size(s).numel()), dtype="float32",
                      elem_bytes=4, position=k) for k, s in enumerate(shapes)]
    plan = build_plan(items, SchedulerConfig(policy="fifo"))
    return [[shapes[k] for k in bucket.keys] for bucket in plan]


def main(workload: str = "resnet18", repeats: int = 7, codecs: tuple[str, ...] = CODECS,
         warmup: int = 2, ranks: int = 1) -> None:
    if ranks == 1:
        probe(0, 1, tdist.HashStore(), workload, repeats, codecs, warmup)
        return
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "store")
        tmp.spawn(_rank, (ranks, path, workload, repeats, codecs, warmup), nprocs=ranks)


def _rank(rank: int, ranks: int, path: str, *args: object) -> None:
    probe(rank, ranks, tdist.FileStore(path, ranks), *args)  # type: ignore[arg-type]


def probe(rank: int, ranks: int, store: object, workload: str, repeats: int,
          codecs: tuple[str, ...], warmup: int) -> None:
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", store=store, rank=rank, world_size=ranks,
                             timeout=timedelta(seconds=120))
    plan = buckets(workload)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(sum(torch.Size(s).numel() for s in shapes), generator=gen)
             for shapes in plan]
    mb = sum(g.numel() for g in grads) * 4 / 2**20
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"{workload}: {len(plan)} buckets, {mb:.2f} MB, {ranks} rank(s)", flush=True)
    for spec in codecs:
        codec = make_codec(spec)
        works = [torch.empty_like(g) for g in grads]
        states = [CodecState() for _ in grads]
        comm = Communicator.of_group(name="probe")
        wall, cpu, own = [], [], []
        for index in range(warmup + repeats):
            for work, g in zip(works, grads):
                work.copy_(g)
            tdist.barrier()
            began, began_cpu, began_own = time.perf_counter(), time.process_time(), time.thread_time()
            for work, state, shapes in zip(works, states, plan):
                compressed_allreduce(codec, work, state, comm, group=None, shapes=shapes).wait()
            if index >= warmup:
                wall.append(time.perf_counter() - began)
                cpu.append(time.process_time() - began_cpu)
                own.append(time.thread_time() - began_own)
        w, c, t = (sorted(x)[len(x) // 2] for x in (wall, cpu, own))
        say(f"{spec:16s} {mb:6.2f} MB  wall {w * 1e3:7.1f} ms  cpu {c * 1e3:7.1f} ms  "
            f"cpu {c * 1e3 / mb:.2f} ms/MB  thread {t * 1e3 / mb:.2f} ms/MB", flush=True)
    tdist.destroy_process_group()


if __name__ == "__main__":
    args, ranks = sys.argv[1:], 1
    if args[:1] == ["--ranks"]:
        ranks, args = int(args[1]), args[2:]
    main(args[0] if args else "resnet18", int(args[1]) if len(args) > 1 else 7,
         tuple(args[2:]) or CODECS, ranks=ranks)
