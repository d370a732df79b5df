"""Wall and CPU time of one allreduce: gloo's own (``torch.distributed.all_reduce``, a
pipelined ring) against scaleout's (``scaleout.core.collectives.allreduce``: one direct
exchange within ``scaleout.core.direct``'s bounds, gloo's ring above), in the
same processes, interleaved, several rounds; medians. Run with torchrun (one process per
rank), on loopback or inside a testbed's namespaces::

    torchrun --nproc_per_node 2 benchmarks/allreduce_probe.py [SIZES_KB] [ROUNDS]

e.g. ``64,256,512,1024,4096 5``. Rank 0 prints one line per size: each side's median wall
time per call, its median CPU time per call (``getrusage``: every thread of the process,
gloo's included) and the ratio gloo / scaleout (> 1: scaleout faster). Where the size is
above the direct bounds both sides make the same call: their ratio is this machine's noise
(an A/A check). With ``PROBE_JSON=PATH`` rank 0 also writes the figures as JSON.
"""

import json
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as tdist

import scaleout
from scaleout.core import collectives, direct


def _timed(call, iters: int) -> tuple[float, float]:
    """(wall, CPU) seconds per call over ``iters`` calls, after a barrier."""
    tdist.barrier()
    before, began = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(iters):
        call()
    wall = time.perf_counter() - began
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return wall / iters, cpu / iters


def main(sizes_kb: list[int], rounds: int) -> None:
    torch.set_num_threads(1)
    env = scaleout.init(timeout=120)
    comm = env.create_distribution().communicator(scaleout.GroupType.DATA)
    results = []
    for kb in sizes_kb:
        x = torch.randn(kb * 1024 // 4)
        iters = max(10, min(200, 20_000 // max(kb, 1)))
        sides = {"gloo": lambda: tdist.all_reduce(x, group=comm.group),
                 "scaleout": lambda: collectives.allreduce(comm, x).wait()}
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
        for _ in range(rounds):
            for name, call in sides.items():  # interleaved, the same order every round
                for _ in range(5):
                    call()
                times[name].append(_timed(call, iters))
        row = {"kb": kb, "ranks": env.world_size,
               "direct": direct.applies(comm.group, x, env.world_size)}
        for name, pairs in times.items():
            row[f"{name}_wall_ms"] = 1e3 * statistics.median(w for w, _ in pairs)
            row[f"{name}_cpu_ms"] = 1e3 * statistics.median(c for _, c in pairs)
        row["ratio"] = row["gloo_wall_ms"] / row["scaleout_wall_ms"]
        results.append(row)
        if env.rank == 0:
            print(f"{env.world_size} ranks {kb:6d} KB direct={row['direct']!s:5}: gloo "
                  f"{row['gloo_wall_ms']:.2f} ms ({row['gloo_cpu_ms']:.2f} CPU), scaleout "
                  f"{row['scaleout_wall_ms']:.2f} ms ({row['scaleout_cpu_ms']:.2f} CPU), "
                  f"gloo/scaleout {row['ratio']:.2f}x", flush=True)
    if env.rank == 0 and os.environ.get("PROBE_JSON"):
        with open(os.environ["PROBE_JSON"], "w") as handle:
            json.dump({"command": " ".join(sys.argv), "rounds": rounds, "rows": results},
                      handle, indent=1)
    env.finalize()


if __name__ == "__main__":
    main([int(s) for s in (sys.argv[1] if len(sys.argv) > 1 else "64,256,512,1024,4096")
          .split(",")], int(sys.argv[2]) if len(sys.argv) > 2 else 5)
