"""Record a single-rank trace of a ``bench train`` workload for the simulator's testbed rows.

``scaleout.sim.testbed_cases`` splits each testbed row's single-rank iteration time over the
layers by the shares of such a trace (``src/scaleout/sim/testbed_traces/<workload>.json``):
one rank, one torch thread, DataParallel with ``trace=`` (nothing to communicate at one rank),
the workload's default batch and the bench's SGD. The per-layer forward and backward samples
are the medians over the iterations (the first one included: the median ignores it). Run::

    torchrun --nproc_per_node 1 benchmarks/record_single_trace.py dlrm 60 [OUT.json]

OUT defaults to ``src/scaleout/sim/testbed_traces/<workload>.json``; the full trace, with
every span, goes to ``$TMPDIR/scaleout-trace-<workload>/trace.0.json``.
"""

import os
import sys
import tempfile
from dataclasses import replace

import torch

import scaleout
from scaleout.pytorch import DataParallel, DistributedOptimizer
from scaleout.sim.trace import read_trace, write_trace
from scaleout.workloads import get_workload

HERE = os.path.dirname(os.path.abspath(__file__))


def main(name: str, iters: int, out: str | None = None) -> None:
    torch.set_num_threads(1)
    env = scaleout.init(timeout=120)
    if env.world_size != 1:
        raise SystemExit("record_single_trace.py: run it on one rank (--nproc_per_node 1)")
    workload = get_workload(name)
    net = workload.build_model(0)
    folder = os.path.join(tempfile.gettempdir(), f"scaleout-trace-{name}")
    model = DataParallel(net, env.create_distribution(), trace=folder)
    optimizer = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9),
                                     model)
    for step in range(iters):
        inputs, targets = workload.make_batch(workload.default_batch_size, step, 0)
        workload.loss_fn(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    model.synchronize()
    full = model.write_trace()
    model.close()
    env.finalize()
    out = out or os.path.join(HERE, "..", "src", "scaleout", "sim", "testbed_traces",
                              f"{name}.json")
    recorded = replace(read_trace(full), name=name, batch_size=workload.default_batch_size)
    write_trace(out, recorded, device="cpu, 1 thread",
                command=f"torchrun --nproc_per_node 1 benchmarks/record_single_trace.py {name} "
                        f"{iters}")
    print(out)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *(sys.argv[3:4]))
