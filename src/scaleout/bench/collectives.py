"""Collective benchmark: scaleout's collectives vs plain torch.distributed, interleaved.

Run by ``scaleout bench collectives``, which launches the ranks; each rank runs
:func:`main`. For every operation and size, rounds alternate between scaleout's
non-blocking call + ``wait()`` and the equivalent blocking torch.distributed call (each
going first in every other round), so both see the same machine conditions. Rank 0
writes the results as JSON.

Sizes are the whole buffer (nccl-tests convention): the allreduce/bcast/reduce tensor,
the allgather/gather output, the reduce_scatter/scatter input, the alltoall buffer.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.distributed as tdist

import scaleout
from scaleout import GroupType
from scaleout.core.collectives import all_gather_single, reduce_scatter_single
from scaleout.bench.stats import median, parse_sizes

__all__ = ["OPS", "bus_factor", "main"]

OPS = ("allreduce", "reduce_scatter", "allgather", "bcast", "reduce", "alltoall", "gather",
       "scatter")


def bus_factor(op: str, p: int) -> float:
    """busbw = algbw x this factor (nccl-tests): 2(p-1)/p for allreduce, (p-1)/p for
    reduce_scatter/allgather/alltoall/gather/scatter, 1 for bcast/reduce."""
    if op == "allreduce":
        return 2 * (p - 1) / p
    if op in ("bcast", "reduce"):
        return 1.0
    return (p - 1) / p


def _calls(op: str, d: scaleout.Distribution, numel: int,
           device: torch.device) -> tuple[Callable[[], object], Callable[[], object]]:
    """(scaleout call, plain torch.distributed call) moving the same bytes into the same,
    preallocated output buffers on ``device``."""
    p, me = d.size(GroupType.GLOBAL), d.rank(GroupType.GLOBAL)
    g = GroupType.GLOBAL
    pg = d.process_group(g)
    block = max(numel // p, 1)
    full = torch.ones(block * p, device=device)
    part = torch.ones(block, device=device)
    out_full = torch.empty(block * p, device=device)
    parts = [torch.empty(block, device=device) for _ in range(p)]
    ours: dict[str, Callable[[], object]] = {
        "allreduce": lambda: d.allreduce(full, group=g).wait(),
        "reduce_scatter": lambda: d.reduce_scatter(full, group=g, out=part).wait(),
        "allgather": lambda: d.allgather(part, group=g, out=out_full).wait(),
        "bcast": lambda: d.bcast(full, 0, group=g).wait(),
        "reduce": lambda: d.reduce(full, 0, group=g).wait(),
        "alltoall": lambda: d.alltoall(full, group=g, out=out_full).wait(),
        "gather": lambda: d.gather(part, 0, group=g).wait(),
        "scatter": lambda: d.scatter(full, 0, group=g, out=part).wait(),
    }
    theirs: dict[str, Callable[[], object]] = {
        "allreduce": lambda: tdist.all_reduce(full, group=pg),
        "reduce_scatter": lambda: reduce_scatter_single(part, full, group=pg),
        "allgather": lambda: all_gather_single(out_full, part, group=pg),
        "bcast": lambda: tdist.broadcast(full, 0, group=pg),
        "reduce": lambda: tdist.reduce(full, 0, group=pg),
        "alltoall": lambda: tdist.all_to_all_single(out_full, full, group=pg),
        "gather": lambda: tdist.gather(part, parts if me == 0 else None, 0, group=pg),
        "scatter": lambda: tdist.scatter(part, parts if me == 0 else None, 0, group=pg),
    }
    return ours[op], theirs[op]


def _timed(call: Callable[[], object], iters: int, pg: object) -> float:
    """Seconds per call, the slowest rank's (every rank starts together; on a GPU, until the
    device has finished the calls' kernels)."""
    tdist.barrier(group=pg)
    start = time.perf_counter()
    for _ in range(iters):
        call()
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
    tdist.all_reduce(elapsed, op=tdist.ReduceOp.MAX, group=pg)
    return float(elapsed.item())


def _iterations(call: Callable[[], object], pg: object, budget: float) -> int:
    once = _timed(call, 1, pg)
    guess = torch.tensor([budget / max(once, 1e-6)], dtype=torch.float64)
    tdist.broadcast(guess, 0, group=pg)  # every rank must run the same count
    return int(min(max(guess.item(), 2), 1000))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="per-rank worker of `scaleout bench collectives`")
    parser.add_argument("--ops", default="allreduce")
    parser.add_argument("--sizes", default="1K..64M")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--budget", type=float, default=0.05,
                        help="seconds of calls per timed block")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where the buffers live (cuda: this rank's GPU)")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    env = scaleout.init(timeout=120)
    if args.device == "cuda" and env.device.type != "cuda":
        raise ValueError(f"rank {env.rank}: --device cuda, but this rank sees no GPU")
    device = env.device if args.device == "cuda" else torch.device("cpu")
    d = env.create_distribution()
    pg = d.process_group(GroupType.GLOBAL)
    p = env.world_size
    rows = []
    for op in args.ops.split(","):
        for size in parse_sizes(args.sizes):
            numel = max(size // 4, p)
            ours, theirs = _calls(op, d, numel, device)
            ours(), theirs()  # warm up both paths
            iters = _iterations(theirs, pg, args.budget)
            t_ours, t_theirs = [], []
            sides = [(ours, t_ours), (theirs, t_theirs)]
            for round_ in range(args.rounds):  # interleaved, alternating who goes first
                for call, times in (sides if round_ % 2 == 0 else sides[::-1]):
                    times.append(_timed(call, iters, pg))
            nbytes = (numel // p if numel >= p else 1) * p * 4
            row = {
                "op": op, "bytes": nbytes, "ranks": p, "iters": iters, "rounds": args.rounds,
                "time_s": median(t_ours), "torch_time_s": median(t_theirs),
                # paired per round, so drift of the machine cancels out
                "ratio": median([a / b for a, b in zip(t_ours, t_theirs)]),
                "algbw_GBps": nbytes / median(t_ours) / 1e9,
                "busbw_GBps": nbytes / median(t_ours) / 1e9 * bus_factor(op, p),
                "torch_busbw_GBps": nbytes / median(t_theirs) / 1e9 * bus_factor(op, p),
                "times_s": t_ours, "torch_times_s": t_theirs,
            }
            rows.append(row)
            if env.rank == 0:
                print(f"{op:>14} {nbytes:>10} B  {row['time_s'] * 1e3:9.3f} ms  "
                      f"ratio {row['ratio']:.3f}", flush=True)
    if env.rank == 0:
        with open(args.json, "w") as handle:
            json.dump({"ranks": p, "backend": env.backend, "device": str(device), "results": rows},
                      handle, indent=1)
    env.finalize()


if __name__ == "__main__":
    main()
