"""What a lone collective takes, as training calls it: one at a time, the median call.

The autotuner measures the link as the best of three all-reduces called back to back
(``scaleout.pytorch.tune_measure.measure_link``; ``host_cpu_probe.py`` records it). Training
calls a bucket's collective on its own, and in overlap mode while the ranks compute, on the
same cores: each round needs every rank's communication threads scheduled. This probe times
all-reduces of 1 KB, 64 KB, 1 MiB and 4 MiB (the autotuner's two sizes among them) called one
at a time, a pause apart, on a process group of their own: first with every rank's main
thread idle, then while it runs a small conv net's training step in a loop (one torch
thread, as ``host_cpu_probe.py``), the two phases interleaved over the trials. It prints, per
rank, one JSON line: each size's median call idle and computing (``scaleout.sim.
testbed_cases`` takes the idle medians, the slower rank's, as the testbed's link)::

    scaleout testbed up --name cal --hosts 3 --rate 1gbit
    SCALEOUT_PROBE_RATE=1gbit scaleout run -n 3 --testbed cal benchmarks/lone_call_probe.py
    scaleout testbed down --name cal

Arguments: trials (default 5), calls per trial and size (default 15), the pause between
calls in ms (default 3).
"""

import json
import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as tdist
from torch import nn

from scaleout.pytorch.tune_measure import PROBE_BYTES

SIZES = (PROBE_BYTES[0], 64 << 10, 1 << 20, PROBE_BYTES[1])  # bytes per all-reduce


def _compute_step(net: nn.Module, batch: torch.Tensor) -> None:
    net.zero_grad(set_to_none=True)
    net(batch).sum().backward()


def _calls(group: tdist.ProcessGroup, tensor: torch.Tensor, calls: int, pause_s: float,
           out: list[float]) -> None:
    for _ in range(calls):
        began = time.perf_counter()
        tdist.all_reduce(tensor, group=group)
        out.append(time.perf_counter() - began)
        time.sleep(pause_s)


def main(trials: int = 5, calls: int = 15, pause_ms: float = 3.0) -> None:
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", timeout=timedelta(seconds=120))
    traffic = tdist.new_group(backend="gloo")
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
    )
    batch = torch.randn(8, 3, 64, 64)
    tensors = {size: torch.zeros(size // 4) for size in SIZES}
    for tensor in tensors.values():  # connect and warm the group
        tdist.all_reduce(tensor, group=traffic)
    _compute_step(net, batch)
    idle = {size: [] for size in SIZES}
    loaded = {size: [] for size in SIZES}
    steps = []
    for _ in range(trials):
        for size, tensor in tensors.items():
            tdist.barrier()
            _calls(traffic, tensor, calls, pause_ms / 1e3, idle[size])
            tdist.barrier()
            side = threading.Thread(target=_calls, args=(traffic, tensor, calls, pause_ms / 1e3,
                                                         loaded[size]))
            side.start()
            while side.is_alive():  # the main thread computes while the calls run
                began = time.perf_counter()
                _compute_step(net, batch)
                steps.append(time.perf_counter() - began)
            side.join()
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    row = {
        "rank": tdist.get_rank(),
        "ranks": tdist.get_world_size(),
        "trials": trials,
        "calls": calls,
        "pause_ms": pause_ms,
        "compute_step_ms": med(steps) * 1e3,
        "sizes": {
            str(size): {
                "idle_ms": med(idle[size]) * 1e3,
                "loaded_ms": med(loaded[size]) * 1e3,
                "extra_ms": (med(loaded[size]) - med(idle[size])) * 1e3,
            }
            for size in SIZES
        },
        "rate": os.environ.get("SCALEOUT_PROBE_RATE", ""),
    }
    print(json.dumps(row), flush=True)
    tdist.destroy_process_group()


if __name__ == "__main__":
    args = sys.argv[1:]
    main(*(int(a) for a in args[:2]), *(float(a) for a in args[2:3]))
