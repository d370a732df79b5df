"""Train a small CNN on scikit-learn's bundled handwritten digits, data-parallel.

Run with:  scaleout run -n 2 examples/train_digits.py --epochs 10

Every rank reads its shard of each global batch; DataParallel sends gradients as backward
produces them (priority policy) and DistributedOptimizer applies each layer's update just
before that layer runs in the next forward. Rank 0 prints loss, test accuracy and throughput.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import scaleout
from scaleout.pytorch import DataParallel, DistributedOptimizer
from scaleout.workloads import evaluate_accuracy, get_workload, load_digits_data


def progress(text: str, done: int, total: int, width: int = 24) -> str:
    filled = int(width * done / max(total, 1))
    return f"\r{text} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--model", choices=["cnn", "mlp"], default="cnn")
    parser.add_argument("--compression", default=None,
                        help="codec spec, e.g. blockquant, topk:ratio=0.05, cast:bf16")
    parser.add_argument("--mode", choices=["overlap", "sync"], default="overlap")
    parser.add_argument("--stats", action="store_true", help="print per-layer Statistics")
    args = parser.parse_args()
    torch.set_num_threads(1)

    env = scaleout.init()
    dist = env.create_distribution()
    data = load_digits_data()
    shard = data.shard(env.rank, env.world_size)
    if args.epochs < 1:
        parser.error(f"--epochs must be >= 1, got {args.epochs}")
    fewest = len(data.train_inputs) // env.world_size  # (the same verdict on every rank)
    if args.batch < env.world_size or args.batch % env.world_size \
            or args.batch // env.world_size > fewest:
        parser.error(f"--batch must be a multiple of the {env.world_size} ranks, from "
                     f"{env.world_size} to {env.world_size * fewest} (each rank has {fewest} "
                     f"or more training images), got {args.batch}")
    workload = get_workload(f"digits-{args.model}")
    net = workload.build_model(seed=0)
    model = DataParallel(net, dist, compression=args.compression)
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9),
                               model, mode=args.mode)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    local = args.batch // env.world_size
    steps = data.steps_per_epoch(local, env.world_size)  # (the same on every rank)
    if env.rank == 0:
        print(f"digits-{args.model}: {len(data.train_inputs)} train / {len(data.test_inputs)} "
              f"test images, {env.world_size} ranks x {local} per batch, {steps} steps/epoch, "
              f"compression={args.compression or 'none'}, mode={args.mode}", flush=True)
    generator = torch.Generator().manual_seed(env.rank)
    for epoch in range(args.epochs):
        model.train()
        order = torch.randperm(len(shard.train_inputs), generator=generator)
        began, total_loss = time.perf_counter(), 0.0
        for step in range(steps):
            rows = order[step * local:(step + 1) * local]
            loss = workload.loss_fn(model(shard.train_inputs[rows]), shard.train_targets[rows])
            loss.backward()
            opt.step()
            opt.zero_grad()
            total_loss += loss.item()
            if env.rank == 0 and sys.stdout.isatty():
                print(progress(f"epoch {epoch + 1}", step + 1, steps), end="", flush=True)
        sched.step()
        model.synchronize()
        elapsed = time.perf_counter() - began
        accuracy = evaluate_accuracy(net, data.test_inputs, data.test_targets)
        # every rank's mean loss, averaged: the job's training loss, not rank 0's share's
        mean_loss = dist.allreduce(torch.tensor([total_loss / steps]), scaleout.ReduceOp.AVG,
                                   group=scaleout.GroupType.DATA).wait().item()
        if env.rank == 0:
            print(f"{chr(13) if sys.stdout.isatty() else ''}epoch {epoch + 1:2d}/{args.epochs}  loss {mean_loss:.4f}  "
                  f"test accuracy {accuracy:.4f}  {steps * args.batch / elapsed:8.0f} samples/s",
                  flush=True)
    if args.stats and env.rank == 0:
        print(model.statistics.table())
    model.close()
    env.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
