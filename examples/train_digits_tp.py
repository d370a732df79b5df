"""Train an MLP on scikit-learn's bundled digits on a data x model grid: its hidden layers
split across the model group (tensor parallel), its batches across the data group.

Run with:  scaleout run -n 2 examples/train_digits_tp.py --model-parts 2     (a 1x2 grid)
      or:  scaleout run -n 4 examples/train_digits_tp.py --model-parts 2     (2x2)

``tensor_parallel`` turns the plain model's first two linears into a column/row pair (each
rank holds half of the hidden layer: one allreduce forward, one backward); the last linear
stays replicated. DataParallel averages gradients over the DATA group only. Every rank of a
model group must see the same samples, so the data are sharded by DATA rank. At the end,
``full_state_dict`` gathers the plain model's state dict, which loads into the unsplit MLP.
"""

from __future__ import annotations

import argparse
import sys

import torch

import scaleout
from scaleout import GroupType
from scaleout.pytorch import DataParallel, DistributedOptimizer, full_state_dict, tensor_parallel
from scaleout.workloads import evaluate_accuracy, get_workload, load_digits_data


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-parts", type=int, default=2,
                        help="ranks per model group (the hidden layer is split across them)")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()
    torch.set_num_threads(1)

    env = scaleout.init()
    if args.model_parts < 1 or env.world_size % args.model_parts:
        parser.error(f"--model-parts must divide the {env.world_size} ranks, got "
                     f"{args.model_parts}")
    dist = env.create_distribution(env.world_size // args.model_parts, args.model_parts)
    data_parts, data_rank = dist.size(GroupType.DATA), dist.rank(GroupType.DATA)
    if args.epochs < 1 or args.batch < data_parts or args.batch % data_parts:
        parser.error(f"--epochs must be >= 1 and --batch a multiple of the {data_parts} data "
                     f"parts, got {args.epochs} and {args.batch}")
    data = load_digits_data()
    shard = data.shard(data_rank, data_parts)  # by DATA rank: a model group shares its samples
    local = args.batch // data_parts
    steps = data.steps_per_epoch(local, data_parts)  # (the same on every rank)
    if steps < 1:  # (a batch larger than a shard: no step at all)
        fewest = len(data.train_inputs) // data_parts
        parser.error(f"--batch must be at most {data_parts * fewest} ({fewest} or more training "
                     f"images per data part), got {args.batch}")

    workload = get_workload("digits-mlp")
    plain_size = sum(p.numel() for p in workload.build_model(seed=0).parameters())
    try:
        net = tensor_parallel(workload.build_model(seed=0), dist)
    except ValueError as err:  # a hidden layer that does not split into --model-parts
        parser.error(f"--model-parts {args.model_parts} does not split the MLP: {err}")
    model = DataParallel(net, dist)
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9),
                               model)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    if env.rank == 0:
        here = sum(p.numel() for p in net.parameters())
        print(f"digits-mlp on a {data_parts}x{args.model_parts} grid (data x model): "
              f"{here} of its {plain_size} parameters on each rank, {local} samples per data "
              f"part and step, {steps} steps/epoch", flush=True)
    generator = torch.Generator().manual_seed(data_rank)  # the same order in a model group
    for epoch in range(args.epochs):
        model.train()
        order = torch.randperm(len(shard.train_inputs), generator=generator)
        total = 0.0
        for step in range(steps):
            rows = order[step * local:(step + 1) * local]
            loss = workload.loss_fn(model(shard.train_inputs[rows]), shard.train_targets[rows])
            loss.backward()
            opt.step()
            opt.zero_grad()
            total += loss.item()
        sched.step()
        model.synchronize()
        accuracy = evaluate_accuracy(net, data.test_inputs, data.test_targets)  # every rank
        if env.rank == 0:
            print(f"epoch {epoch + 1:2d}/{args.epochs}  loss {total / steps:.4f}  "
                  f"test accuracy {accuracy:.4f}", flush=True)
    state = full_state_dict(net)  # every rank takes part; each gets the whole state dict
    if env.rank == 0:
        plain = workload.build_model(seed=0)
        plain.load_state_dict(state)
        print(f"the gathered plain model: test accuracy "
              f"{evaluate_accuracy(plain, data.test_inputs, data.test_targets):.4f}", flush=True)
    model.close()
    env.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
