"""A Horovod training script, unchanged but for its import line, on scikit-learn's digits.

It is written the way Horovod's PyTorch MNIST example is laid out (argument flags, a
DistributedSampler per rank, parameter and optimizer-state broadcast from rank 0, a
DistributedOptimizer with optional fp16 compression or Adasum, metrics averaged with
allreduce), with the 8x8 digits that ship with scikit-learn instead of downloading MNIST.

Run with:  scaleout run -n 2 examples/horovod_digits.py --epochs 5
      or:  torchrun --nproc_per_node 2 examples/horovod_digits.py
With Horovod installed, `horovodrun -np 2 python ...` runs it after changing the import back.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed
from sklearn.datasets import load_digits

import scaleout.horovod as hvd  # the only difference from a Horovod script: horovod.torch

parser = argparse.ArgumentParser(description="Horovod-style data-parallel digits classifier")
parser.add_argument("--batch-size", type=int, default=32, help="batch size per rank")
parser.add_argument("--test-batch-size", type=int, default=256, help="test batch size per rank")
parser.add_argument("--epochs", type=int, default=8, help="epochs to train")
parser.add_argument("--lr", type=float, default=0.05, help="learning rate (per rank)")
parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
parser.add_argument("--no-cuda", action="store_true", default=False, help="train on the CPU")
parser.add_argument("--seed", type=int, default=42, help="random seed")
parser.add_argument("--log-interval", type=int, default=10, help="batches between log lines")
parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                    help="send gradients as float16")
parser.add_argument("--use-adasum", action="store_true", default=False,
                    help="combine gradients with Adasum instead of averaging")
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0,
                    help="divide gradients by this before the allreduce, the rest after")


class DigitsNet(nn.Module):
    """Two small convolutions and two dense layers for 1x8x8 images."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, kernel_size=3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.drop = nn.Dropout(0.25)
        self.hidden = nn.Linear(32 * 4 * 4, 64)
        self.out = nn.Linear(64, 10)

    def forward(self, x):
        x = self.drop(self.features(x)).flatten(1)
        return F.log_softmax(self.out(F.relu(self.hidden(x))), dim=1)


def digits_datasets():
    """Train and test TensorDatasets: a fixed 80/20 split, pixels scaled to [0, 1]."""
    images, labels = load_digits(return_X_y=True)
    inputs = torch.tensor(images, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    targets = torch.tensor(labels, dtype=torch.int64)
    order = torch.randperm(len(targets), generator=torch.Generator().manual_seed(0))
    cut = int(0.8 * len(order))
    train, test = order[:cut], order[cut:]
    return (torch.utils.data.TensorDataset(inputs[train], targets[train]),
            torch.utils.data.TensorDataset(inputs[test], targets[test]))


def averaged(value, name):
    """The mean of a scalar over all ranks."""
    return hvd.allreduce(torch.tensor(value), name=name).item()


def train_one_epoch(epoch, model, optimizer, loader, sampler):
    model.train()
    sampler.set_epoch(epoch)  # a different shuffle every epoch, the same on every rank
    for batch, (data, target) in enumerate(loader):
        if args.cuda:
            data, target = data.cuda(), target.cuda()
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        if batch % args.log_interval == 0 and hvd.rank() == 0:
            seen = batch * len(data)
            print(f"epoch {epoch} [{seen}/{len(sampler)} samples of this rank] "
                  f"loss {loss.item():.4f}")


def evaluate(model, loader, sampler):
    model.eval()
    loss_sum, correct = 0.0, 0.0
    with torch.no_grad():
        for data, target in loader:
            if args.cuda:
                data, target = data.cuda(), target.cuda()
            output = model(data)
            loss_sum += F.nll_loss(output, target, reduction="sum").item()
            correct += output.argmax(dim=1).eq(target).sum().item()
    # every rank scored its own shard; average the per-rank figures
    loss = averaged(loss_sum / len(sampler), "avg_loss")
    accuracy = averaged(correct / len(sampler), "avg_accuracy")
    if hvd.rank() == 0:
        print(f"test: average loss {loss:.4f}, accuracy {100.0 * accuracy:.2f}%")
    return accuracy


if __name__ == "__main__":
    args = parser.parse_args()
    for option in ("batch_size", "test_batch_size", "epochs", "log_interval"):
        if getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} must be >= 1, got {getattr(args, option)}")
    args.cuda = not args.no_cuda and torch.cuda.is_available()

    hvd.init()
    if args.use_adasum and hvd.size() & (hvd.size() - 1):  # (refused at the first step else)
        parser.error(f"--use-adasum needs a power-of-two number of ranks, as Horovod's Adasum "
                     f"does, got {hvd.size()}")
    torch.manual_seed(args.seed)
    if args.cuda:
        torch.cuda.set_device(hvd.local_rank())
        torch.cuda.manual_seed(args.seed)
    torch.set_num_threads(1)  # one rank per core is plenty for 8x8 images

    train_set, test_set = digits_datasets()
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_set, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size,
                                               sampler=train_sampler)
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    test_loader = torch.utils.data.DataLoader(test_set, batch_size=args.test_batch_size,
                                              sampler=test_sampler)

    model = DigitsNet()
    # Averaged gradients of size() batches: scale the learning rate with the ranks
    # (Adasum keeps the single-rank rate, times the GPUs per node when it trains on them
    # under NCCL, as Horovod's example does).
    scale = hvd.size() if not args.use_adasum else \
        (hvd.local_size() if args.cuda and hvd.nccl_built() else 1)
    if args.cuda:
        model.cuda()
    optimizer = optim.SGD(model.parameters(), lr=args.lr * scale, momentum=args.momentum)

    # every rank starts from rank 0's weights and optimizer state
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none,
        op=hvd.Adasum if args.use_adasum else hvd.Average,
        gradient_predivide_factor=args.gradient_predivide_factor)

    for epoch in range(1, args.epochs + 1):
        train_one_epoch(epoch, model, optimizer, train_loader, train_sampler)
        evaluate(model, test_loader, test_sampler)
