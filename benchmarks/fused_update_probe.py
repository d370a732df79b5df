"""The tables' backward and update alone: sparse gradients + SGD step vs the update in backward.

One process, one thread: one rank's 13 tables of the ``dlrm`` workload (the bench's plan:
one of each size) as a table batch, ``IDS`` requested rows spread over them; each repetition
looks them up and runs the backward, then either steps ``torch.optim.SGD`` on the 13 sparse
gradients (``unfused``: what ``hybrid-unfused`` does) or lets the backward apply
``FusedSGD`` to the batched weight (``fused``: the bench's ``hybrid``). The two alternate,
``ROUNDS`` times ``REPEATS``; medians and minima in ms. Run::

    python3 benchmarks/fused_update_probe.py [IDS] [REPEATS] [ROUNDS]
"""

import statistics
import sys
import time

import torch
from torch import nn

from scaleout.pytorch import FusedSGD
from scaleout.pytorch.embeddings.batched import TableBatch

SIZES = (20000, 10000, 5000, 2000, 1000, 500, 200, 100, 50, 20, 10, 5, 3)
DIM = 16


def build(fused: bool) -> tuple[TableBatch, list[torch.Tensor], torch.optim.Optimizer | None]:
    batch = TableBatch([(0, rows) for rows in SIZES], SIZES, DIM, torch.float32)
    weights = []
    for j, rows in enumerate(SIZES):
        table = nn.Embedding(rows, DIM, sparse=True)
        table.weight.data = batch.view(j)
        weights.append(table.weight)
    if fused:
        batch.update = FusedSGD(lr=0.01)
        return batch, weights, None
    return batch, weights, torch.optim.SGD(weights, lr=0.01)


def main(ids: int = 3957, repeats: int = 300, rounds: int = 4) -> None:
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    table = torch.randint(0, len(SIZES), (ids,), generator=generator)
    wanted = (torch.rand(ids, generator=generator) * torch.tensor(SIZES)[table]).long()
    grad = torch.randn(ids, DIM, generator=generator)
    times: dict[str, list[float]] = {"unfused": [], "fused": []}
    setups = {name: build(name == "fused") for name in times}
    for _ in range(rounds):
        for name, (batch, weights, optimizer) in setups.items():
            rows = batch.rows(wanted, table)
            for i in range(repeats + 20):
                start = time.perf_counter()
                batch.look_up(rows, table, weights).backward(grad)
                if optimizer is not None:
                    optimizer.step()
                    optimizer.zero_grad()
                if i >= 20:  # (the first ones warm the allocator)
                    times[name].append(time.perf_counter() - start)
    for name, values in times.items():
        print(f"{name:8s} median {statistics.median(values) * 1e3:.3f} ms, "
              f"min {min(values) * 1e3:.3f} ms ({len(values)} repetitions, lookup included)")


if __name__ == "__main__":
    main(*map(int, sys.argv[1:4]))
