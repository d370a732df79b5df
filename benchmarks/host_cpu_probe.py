"""What moving gradient bytes costs a host on this machine, apart from any trainer.

``scaleout.sim.testbed_cases`` takes the testbed's link and CPU per collective and per byte
from this probe (``benchmarks/results/stop25/host-probe.json``). Until stop 25 it charged a
CPU per MB fitted on ResNet-18's ``lockstep`` and ``lockstep-traffic`` rows at 1 Gbit/s,
which could not say whether the cost follows the bytes (copies, sums, the kernel's
per-packet path) or the time a transfer lasts (threads and timers busy while a shaped link
drains), and read ten times what this probe measures. Each rank times a
fixed stretch of compute (a small conv net's forward and backward, one torch thread) alone
and with one allreduce of SIZE bytes started on its own process group just before it and
waited for after it, and the allreduce alone, the three interleaved, and prints the medians
and the compute's difference. Beside it, the process's CPU time (every thread's) for the
allreduce alone and for a 1 KB allreduce (the CPU per collective), and the link as the
autotuner measures it (``scaleout.pytorch.tune_measure.measure_link``: the best of three
all-reduces of 1 KB and of 4 MiB, and the CPU per 1 KB one; medians of seven calls). Run
it on a testbed at several rates with one size: a cost per byte stays put, a cost per second
scales with 1 / rate::

    scaleout testbed up --name cal --hosts 2 --rate 1gbit
    scaleout run -n 2 --testbed cal benchmarks/host_cpu_probe.py 8 11 8   (as recorded)
    scaleout testbed down --name cal

Arguments: MB (1e6 bytes, default 4), trials (default 21), compute steps (default 6), and
a workload whose training step is the compute (``resnet18``, ``dlrm``, ...; default a toy
conv net).
"""

import json
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as tdist
from torch import nn

from scaleout.core.communicator import Communicator
from scaleout.pytorch.tune_measure import PROBE_BYTES, measure_link

SMALL_CALLS = 20  # 1 KB all-reduces per trial, for the CPU one collective takes
LINK_CALLS = 7  # the autotuner's link measurement, repeated; the medians are reported


def _toy() -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    net = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
    )
    batch = torch.randn(8, 3, 64, 64)
    return net, lambda: net(batch).sum()


def _workload(name: str) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    from scaleout.workloads import get_workload

    wl = get_workload(name)
    net = wl.build_model(seed=0)
    inputs, targets = wl.make_batch(wl.default_batch_size, step=0, seed=0)
    return net, lambda: wl.loss_fn(net(inputs), targets)


def _compute(net: nn.Module, loss: Callable[[], torch.Tensor], steps: int) -> None:
    for _ in range(steps):
        net.zero_grad(set_to_none=True)
        loss().backward()


def main(mb: float = 4.0, trials: int = 21, steps: int = 6, workload: str = "") -> None:
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", timeout=timedelta(seconds=120))
    traffic = tdist.new_group(backend="gloo")
    torch.manual_seed(0)
    net, loss = _workload(workload) if workload else _toy()
    payload = torch.zeros(int(mb * 1e6) // 4)
    alone, loaded, waits, bare, bare_cpu, small_cpu = [], [], [], [], [], []
    small = torch.zeros(256)
    tdist.all_reduce(payload, group=traffic)  # connect and warm both groups
    _compute(net, loss, steps)
    for trial in range(3 * trials):
        with_traffic = trial % 3 == 1
        tdist.barrier()
        if trial % 3 == 2:  # the transfer with nothing else to do, then 1 KB ones
            began, began_cpu = time.perf_counter(), time.process_time()
            tdist.all_reduce(payload, group=traffic)
            bare.append(time.perf_counter() - began)
            bare_cpu.append(time.process_time() - began_cpu)
            began_cpu = time.process_time()
            for _ in range(SMALL_CALLS):
                tdist.all_reduce(small, group=traffic)
            small_cpu.append((time.process_time() - began_cpu) / SMALL_CALLS)
            continue
        began = time.perf_counter()
        work = tdist.all_reduce(payload, group=traffic, async_op=True) if with_traffic else None
        _compute(net, loss, steps)
        ended = time.perf_counter()
        if work is not None:
            work.wait()
            waits.append(time.perf_counter() - ended)
        (loaded if with_traffic else alone).append(ended - began)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    comm = Communicator.of_group(name="probe")
    links = [measure_link(comm, torch.device("cpu")) for _ in range(LINK_CALLS)]
    small_s, large_s, link_cpu = (med([link[i] for link in links]) for i in range(3))
    row = {
        "rank": tdist.get_rank(),
        "mb": mb,
        "compute": workload or "toy conv net",
        "steps": steps,
        "trials": trials,
        "compute_alone_ms": med(alone) * 1e3,
        "compute_with_traffic_ms": med(loaded) * 1e3,
        "cost_ms": (med(loaded) - med(alone)) * 1e3,
        "cost_ms_per_mb": (med(loaded) - med(alone)) * 1e3 / mb,
        "wait_after_compute_ms": med(waits) * 1e3,
        "transfer_alone_ms": med(bare) * 1e3,
        "transfer_alone_cpu_ms": med(bare_cpu) * 1e3,
        "small_allreduce_cpu_ms": med(small_cpu) * 1e3,
        "cpu_ms_per_mb": (med(bare_cpu) - med(small_cpu)) * 1e3 / mb,
        "link": {"probe_bytes": list(PROBE_BYTES), "seconds": [small_s, large_s],
                 "cpu_s_per_message": link_cpu},
        "rate": os.environ.get("SCALEOUT_PROBE_RATE", ""),
    }
    print(json.dumps(row), flush=True)
    tdist.destroy_process_group()


if __name__ == "__main__":
    args = sys.argv[1:]
    main(*(float(a) for a in args[:1]), *(int(a) for a in args[1:3]), *args[3:4])
