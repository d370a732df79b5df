"""Where a hybrid DLRM iteration's wall time goes: clock marks on rank 0, medians.

Runs one ``bench train`` configuration of the sharded DLRM (``hybrid``, ``hybrid-lockstep``,
any ``hybrid-*``) for ITERS iterations, as the bench feeds it (each next batch's ids
prefetched), and prints, from the 21st iteration on, the median time since the iteration
began at which each of these happens on rank 0:

* ``fwd`` / ``bwd`` / ``step`` / ``end``: the loop's own phases (``fwd`` comes after the
  prefetch of the next batch's ids);
* ``pre:LAYER<`` / ``>``: DataParallel's forward pre-hook of a dense layer (waits for its
  averaged gradients and applies their update);
* ``rows<`` / ``>``: the collection's forward exchange (waits for the prefetched rows);
* ``rbwd<`` / ``>``: its backward (the rows' gradients, with the next ids), and inside it
  ``ridewait<`` / ``>``: the wait for that exchange;
* ``bdone<`` / ``>``: the end of backward (the next batch's lookup and its exchange).

Marks are taken by wrapping those methods (a few microseconds each). Run it where the bench
runs, e.g. on a testbed (a timing tool, not a test)::

    scaleout testbed up --name t1 --hosts 2 --rate 1gbit
    BUDGET=4m scaleout run -n 2 --testbed t1 benchmarks/hybrid_timeline.py hybrid 100
    BUDGET=4m scaleout run -n 2 --testbed t1 benchmarks/hybrid_timeline.py hybrid-lockstep 100

``BUDGET`` is ``bench train``'s ``--memory-budget`` (the hybrid's plan).
"""

import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from cpu_per_iteration import _budget  # (this folder: the same BUDGET reading)
from scaleout.bench.train_peers import build_setup
from scaleout.bench.train_setup import SetupOptions
from scaleout.pytorch import updates
from scaleout.pytorch.embeddings import lookahead, ride, rows_exchange
from scaleout.workloads import get_workload

SKIP, DISTINCT_BATCHES = 20, 8
MARKS: list[tuple[str, float]] = []
BEGAN = [0.0]


def mark(name: str) -> None:
    MARKS.append((name, time.perf_counter() - BEGAN[0]))


def _marked(original: Callable[..., Any], label: Callable[..., str]) -> Callable[..., Any]:
    """``original`` with its entry (``<``) and exit (``>``) marked as ``label(first, *args)``."""
    def marked(first, *args, **kwargs):
        name = label(first, *args)
        mark(name + "<")
        try:
            return original(first, *args, **kwargs)
        finally:
            mark(name + ">")
    return marked


def wrap(owner: type, method: str, label: Callable[..., str]) -> None:
    setattr(owner, method, _marked(getattr(owner, method), label))


def wrap_static(owner: type, method: str, name: str) -> None:  # (an autograd Function's)
    setattr(owner, method, staticmethod(_marked(getattr(owner, method), lambda *_: name)))


wrap(updates.LazyUpdates, "complete", lambda _self, layer: "pre:" + layer.name)
wrap(lookahead.Lookahead, "_backward_done", lambda _self: "bdone")
wrap(ride.Ride, "_wait", lambda _self: "ridewait")
wrap_static(rows_exchange._Exchange, "forward", "rows")
wrap_static(rows_exchange._Exchange, "backward", "rbwd")


def main(config: str, iters: int) -> None:
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    workload = get_workload("dlrm")
    batch = workload.default_batch_size
    setup = build_setup(config, SetupOptions(workload=workload, batch=batch,
                                             memory_budget=_budget(os.environ.get("BUDGET"))))
    batches = [workload.make_batch(batch * world, step, 0, rank=rank, world_size=world)
               for step in range(DISTINCT_BATCHES)]
    kept: list[list[tuple[str, float]]] = []
    if setup.prefetch is not None:
        setup.prefetch(batches[0][0])
    for step in range(iters):
        inputs, targets = batches[step % DISTINCT_BATCHES]
        MARKS.clear()
        BEGAN[0] = time.perf_counter()
        if setup.prefetch is not None:
            setup.prefetch(batches[(step + 1) % DISTINCT_BATCHES][0])
        mark("fwd")
        loss = workload.loss_fn(setup.model(inputs), targets)
        mark("bwd")
        loss.backward()
        mark("step")
        setup.optimizer.step()
        setup.optimizer.zero_grad(set_to_none=True)
        mark("end")
        if step >= SKIP:
            kept.append(list(MARKS))
    setup.settle()
    if rank == 0:
        times: dict[tuple[str, int], list[float]] = defaultdict(list)
        for marks in kept:  # the n-th occurrence of a mark in an iteration, across iterations
            seen: dict[str, int] = defaultdict(int)
            for name, at in marks:
                seen[name] += 1
                times[name, seen[name]].append(at)
        common = [key for key, values in times.items() if len(values) >= len(kept) // 2]
        print(f"{config}: {len(kept)} iterations, rank 0, median ms since the iteration began")
        for key in sorted(common, key=lambda k: statistics.median(times[k])):
            name, nth = key
            print(f"{statistics.median(times[key]) * 1e3:8.2f}  {name}" + (f" #{nth}" if nth > 1
                                                                          else ""))
    setup.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 100)
