"""How much a codec's accuracy on digits depends on the initial weights (docs/codecs.md, "Seeds").

Trains the convergence grid's models (tests/test_compression_convergence.py: digits, 2 ranks
over gloo, global batch 64, 10 epochs, SGD momentum 0.9, mean test accuracy of the last 3
epochs) for each initial-weights seed given, with every codec of ``VARIANTS`` beside an
uncompressed copy of the same seed, and prints each seed's difference to uncompressed and
their mean. The data order is seeded by ``seed + 100``.

    VARIANTS="sign+momentum,sign:block_size=64+momentum" LRS=0.1,0.05 \\
        PYTHONPATH=src python3 benchmarks/codec_seeds.py 0,1,2
"""

from __future__ import annotations

import os
import statistics
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import test_compression_convergence as grid  # noqa: E402
from harness import run_ranks  # noqa: E402

import scaleout  # noqa: E402
from scaleout.compression import CompressionConfig  # noqa: E402
from scaleout.pytorch import DataParallel, DistributedOptimizer  # noqa: E402

VARIANTS = os.environ.get("VARIANTS", "sign+momentum").split(",")
LRS = tuple(float(v) for v in os.environ.get("LRS", "0.1,0.05").split(","))


def _train(d: scaleout.Distribution, arch: str, seed: int) -> dict:
    xtr, ytr, xte, yte = grid._data()
    rank, ranks = d.rank(scaleout.GroupType.DATA), d.size(scaleout.GroupType.DATA)
    keys = [(spec, lr) for lr in LRS for spec in ("none", *VARIANTS)]
    ensemble = grid.Ensemble(arch, [seed] * len(keys))
    layers = {f"nets.{i}.*": grid._codec(s) for i, (s, _) in enumerate(keys) if s != "none"}
    model = DataParallel(ensemble, d, compression=CompressionConfig(codec="none", layers=layers, min_numel=0))
    groups = [{"params": list(n.parameters()), "lr": lr} for n, (_, lr) in zip(ensemble.nets, keys)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unsuited combinations are what is measured
        opt = DistributedOptimizer(torch.optim.SGD(groups, lr=LRS[0], momentum=0.9), model)
    order_gen = torch.Generator().manual_seed(seed + 100)
    local = grid.GLOBAL_BATCH // ranks
    accs = dict.fromkeys(keys, 0.0)
    for epoch in range(grid.EPOCHS):
        order = torch.randperm(len(xtr), generator=order_gen)
        for start in range(0, len(order) - grid.GLOBAL_BATCH + 1, grid.GLOBAL_BATCH):
            idx = order[start + rank * local: start + (rank + 1) * local]
            loss = F.cross_entropy(model(xtr[idx]).flatten(0, 1), ytr[idx].repeat(len(keys)),
                                   reduction="sum") / len(idx)
            loss.backward()
            opt.step()
            opt.zero_grad()
        model.synchronize()
        if epoch >= grid.EPOCHS - grid.LAST:
            with torch.no_grad():
                for net, key in zip(ensemble.nets, keys):
                    accs[key] += (net(xte).argmax(1) == yte).float().mean().item() * 100 / grid.LAST
    model.close()
    return accs


def _all(seeds: list[int]) -> dict:
    env = scaleout.init(timeout=120)
    d = env.create_distribution()
    out = {(arch, seed): _train(d, arch, seed) for arch in ("mlp", "cnn") for seed in seeds}
    env.finalize()
    return out


def main(seeds: list[int]) -> None:
    out = run_ranks(2, _all, seeds, timeout=3600, start_method="spawn")[0]
    for arch in ("mlp", "cnn"):
        for lr in LRS:
            for spec in VARIANTS:
                diffs = [out[(arch, s)][(spec, lr)] - out[(arch, s)][("none", lr)] for s in seeds]
                print(f"{arch} lr {lr:<5g} {spec:32s} " + " ".join(f"{v:+.1f}" for v in diffs)
                      + f"   mean {statistics.mean(diffs):+.2f}")


if __name__ == "__main__":
    main([int(s) for s in sys.argv[1].split(",")])
