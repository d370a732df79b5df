"""Why EF-sign fails with momentum: log the residual and the codec's contraction per step.

An in-process simulation of 2 data-parallel ranks (no communication: each rank's gradient is
encoded with its own codec state and the decodes are averaged, which is what the exchange
computes) training a 64-128-64-10 MLP on scikit-learn's digits with SGD, batch 32, 6 epochs;
the weights (tensors of >= 1024 values) go through the codec as one bucket, biases exact.
Printed per phase of training: ``delta = ||x||_1^2 / (n ||x||_2^2)`` averaged over blocks (the
share of a block's energy a mean-scaled sign keeps), rank 0's residual norm over its gradient
norm, and the one-step relative error of the compensated gradient.

    PYTHONPATH=src python3 benchmarks/sign_residual_probe.py "sign:scale=mean" 0.1 0.9
"""

from __future__ import annotations

import statistics
import sys

import torch
from sklearn.datasets import load_digits

from scaleout.compression import CodecState, make_codec


def main(spec: str, lr: float, momentum: float, ranks: int = 2, batch: int = 32, epochs: int = 6) -> None:
    torch.set_num_threads(1)
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32) / 16.0, torch.tensor(y)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    xtr, ytr, xte, yte = x[360:], y[360:], x[:360], y[:360]
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64),
                              torch.nn.ReLU(), torch.nn.Linear(64, 10))
    params = list(net.parameters())
    big = [p for p in params if p.numel() >= 1024]
    opt = torch.optim.SGD(params, lr=lr, momentum=momentum)
    codec = make_codec(spec)
    block = getattr(codec, "block_size", 256)
    states = [CodecState() for _ in range(ranks)]
    shuffle, local, log = torch.Generator().manual_seed(1), batch // ranks, []
    for _ in range(epochs):
        perm = torch.randperm(len(xtr), generator=shuffle)
        for start in range(0, len(perm) - batch + 1, batch):
            grads = []
            for r in range(ranks):
                idx = perm[start + r * local: start + (r + 1) * local]
                opt.zero_grad()
                torch.nn.functional.cross_entropy(net(xtr[idx]), ytr[idx]).backward()
                grads.append([p.grad.clone() for p in params])
            for i, p in enumerate(params):
                p.grad = sum(g[i] for g in grads) / ranks
            decoded = []
            for r in range(ranks):
                flat = torch.cat([g.reshape(-1) for g, p in zip(grads[r], params) if p.numel() >= 1024])
                old = states[r].buffers.get("residual")
                compensated = flat + (0 if old is None else old)
                payload, ctx = codec.encode(flat, states[r])
                decoded.append(codec.decode(payload, ctx))
                if r == 0:
                    n = compensated.numel() // block * block
                    blocks = compensated[:n].view(-1, block)
                    delta = blocks.abs().sum(1) ** 2 / (block * (blocks * blocks).sum(1).clamp_min(1e-30))
                    log.append((delta.mean().item(),
                                states[r].buffers["residual"].norm().item() / flat.norm().item(),
                                ((compensated - decoded[-1]).norm() / compensated.norm()).item()))
            average, offset = sum(decoded) / ranks, 0
            for p in big:
                p.grad = average[offset: offset + p.numel()].view_as(p).clone()
                offset += p.numel()
            opt.step()
    with torch.no_grad():
        accuracy = (net(xte).argmax(1) == yte).float().mean().item() * 100
    print(f"{spec} lr {lr} momentum {momentum}: test accuracy {accuracy:.1f}%")
    for lo, hi in ((0, 20), (20, 100), (100, len(log))):
        part = log[lo:hi]
        print(f"  steps {lo}-{hi}: delta {statistics.mean(s[0] for s in part):.3f}  "
              f"residual/gradient {statistics.mean(s[1] for s in part):.2f}  "
              f"one-step rel. error {statistics.mean(s[2] for s in part):.2f}")


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), float(sys.argv[3]))
