"""Train DLRM on synthetic click data, data-parallel or hybrid (sharded tables).

Run with:  scaleout run -n 2 examples/train_dlrm_hybrid.py --parallel hybrid --steps 200
           scaleout run -n 2 examples/train_dlrm_hybrid.py --parallel data --steps 200

``data``: every rank holds every table, DataParallel averages all gradients (tables too).
``hybrid``: the planner spreads the tables over the ranks (EmbeddingCollection: ids and
lookups travel by alltoallv), DataParallel averages only the dense MLPs' gradients; the loader
is wrapped in ``prefetching`` (each next batch's ids travel while a batch trains) and the
next batch's rows leave once the tables' optimizer has stepped (``look_up_after``);
``--fused`` updates the tables in the lookups' backward instead (``update_in_backward``:
one update of all of a rank's tables, no optimizer step for them). Both use SGD with
momentum for the dense layers and row-wise Adagrad for the tables, so they compute the same
model (tests/test_sharded_embeddings.py checks it to float precision); rank 0 prints the
held-out loss, parameter bytes per rank and time per step.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

import scaleout
from scaleout.pytorch import (DataParallel, EmbeddingCollection, FusedRowWiseAdagrad,
                              RowWiseAdagrad, prefetching)
from scaleout.workloads import get_workload


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parallel", choices=["data", "hybrid"], default="hybrid")
    parser.add_argument("--workload", choices=["dlrm", "dlrm-large"], default="dlrm")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=512, help="global batch size")
    parser.add_argument("--fused", action="store_true",
                        help="hybrid: update the tables in backward (no optimizer step)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    env = scaleout.init()
    dist = env.create_distribution()
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.batch < env.world_size:
        parser.error(f"--batch must be at least one sample per rank ({env.world_size}), got "
                     f"{args.batch}")
    workload = get_workload(args.workload)
    net = workload.build_model(0)
    if args.parallel == "hybrid":
        # each rank's share of a batch at most: its ids' counts and ids travel in one round,
        # with the rows' gradients of the batch before
        per_rank = -(-args.batch // env.world_size)
        net.embeddings = EmbeddingCollection.from_embeddings(
            list(net.embeddings), dist, max_batch=per_rank, ids_with_gradients=True)
    tables = [p for n, p in net.named_parameters() if n.startswith("embeddings.")]
    dense = [p for n, p in net.named_parameters() if not n.startswith("embeddings.")]
    model = DataParallel(net, dist)  # no DistributedOptimizer: averaged .grad after backward
    dense_opt = torch.optim.SGD(dense, lr=0.05, momentum=0.9)
    table_opt = None if args.fused else RowWiseAdagrad(tables, lr=0.05)
    if args.fused:  # the tables have no .grad then: nothing else to step
        if args.parallel != "hybrid":
            parser.error("--fused needs --parallel hybrid")
        net.embeddings.update_in_backward(FusedRowWiseAdagrad(lr=0.05))
    eval_x, eval_y = workload.make_batch(args.batch, 10**6, 1, rank=env.rank,
                                         world_size=env.world_size)
    batches = (workload.make_batch(args.batch, step, 0, rank=env.rank, world_size=env.world_size)
               for step in range(args.steps))
    if args.parallel == "hybrid":
        batches = prefetching(batches, net.embeddings, ids=lambda batch: batch[0].sparse)
        net.embeddings.look_up_after(table_opt or dense_opt)
    began = time.perf_counter()
    for x, y in batches:
        F.binary_cross_entropy_with_logits(model(x), y).backward()
        dense_opt.step()
        if table_opt is not None:
            table_opt.step()
            table_opt.zero_grad()
        dense_opt.zero_grad()
    model.synchronize()
    per_step = (time.perf_counter() - began) / args.steps
    model.eval()
    with torch.no_grad():  # (summed over every sample: the shards may differ by one)
        total = F.binary_cross_entropy_with_logits(model(eval_x), eval_y, reduction="sum")
    sums = dist.allreduce(torch.stack([total, torch.tensor(float(eval_y.numel()))]),
                          scaleout.ReduceOp.SUM, group=scaleout.GroupType.DATA).wait()
    loss = sums[0] / sums[1]
    held = sum(p.numel() * p.element_size() for p in net.parameters())
    if env.rank == 0:
        print(f"{args.workload} {args.parallel}: held-out loss {loss.item():.5f} after "
              f"{args.steps} steps, {per_step * 1e3:.1f} ms/step, {held / 2**20:.2f} MiB of "
              f"parameters on rank 0")
    model.close()
    env.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
