"""1-bit-Adam-style experiment: torchrun --nproc_per_node 2 exp.py ARCH W"""
import math, os, sys, warnings
sys.path.insert(0, "/work/main/tests")
import torch, torch.nn.functional as F
import scaleout
from scaleout.compression import CompressionConfig, MomentumCodec, make_codec
from scaleout.pytorch import DataParallel, DistributedOptimizer
from test_compression_convergence import _data, Ensemble, GLOBAL_BATCH

class FrozenVarianceAdamW(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, freeze_step=100):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, freeze_step=freeze_step))
    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]; lr = group["lr"]; freeze = group["freeze_step"]
            for p in group["params"]:
                if p.grad is None: continue
                st = self.state[p]
                if not st:
                    st["step"] = 0; st["exp_avg"] = torch.zeros_like(p); st["exp_avg_sq"] = torch.zeros_like(p)
                st["step"] += 1; t = st["step"]; g = p.grad
                p.mul_(1 - lr * group["weight_decay"])
                st["exp_avg"].lerp_(g, 1 - b1)
                if t <= freeze:
                    st["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                bc1 = 1 - b1 ** t; bc2 = 1 - b2 ** min(t, freeze)
                denom = (st["exp_avg_sq"].sqrt() / math.sqrt(bc2)).add_(group["eps"])
                p.addcdiv_(st["exp_avg"], denom, value=-lr / bc1)

def run(arch, spec, opt_kind, W, seeds=(0, 1, 2), epochs=10):
    env = scaleout.attach() if False else None
    xtr, ytr, xte, yte = _data()
    rank, ranks = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ens = Ensemble(arch, list(seeds))
    codec = None
    if spec != "none":
        base, plus, _ = spec.partition("+momentum")
        codec = MomentumCodec(codec=make_codec(base), momentum=0.9) if plus else make_codec(base)
    config = CompressionConfig(codec=codec or "none", min_numel=0, warmup_steps=W if codec else 0)
    model = DataParallel(ens, DIST, compression=config)
    inner = (torch.optim.AdamW(ens.parameters(), lr=1e-3) if opt_kind == "adamw"
             else FrozenVarianceAdamW(ens.parameters(), lr=1e-3, freeze_step=W))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = DistributedOptimizer(inner, model)
    shuffle = torch.Generator().manual_seed(1); local = GLOBAL_BATCH // ranks
    accs = [0.0] * len(seeds)
    for epoch in range(epochs):
        order = torch.randperm(len(xtr), generator=shuffle)
        for start in range(0, len(order) - GLOBAL_BATCH + 1, GLOBAL_BATCH):
            idx = order[start + rank * local: start + (rank + 1) * local]
            logits = model(xtr[idx])
            loss = F.cross_entropy(logits.flatten(0, 1), ytr[idx].repeat(len(seeds)), reduction="sum") / len(idx)
            loss.backward(); opt.step(); opt.zero_grad()
        model.synchronize()
        if epoch >= epochs - 3:
            with torch.no_grad():
                for i, net in enumerate(ens.nets):
                    accs[i] += (net(xte).argmax(1) == yte).float().mean().item() * 100 / 3
    model.close()
    return accs

env = scaleout.init(timeout=120)
DIST = env.create_distribution()
arch, W = sys.argv[1], int(sys.argv[2])
specs = sys.argv[3].split(",") if len(sys.argv) > 3 else ["none:adamw", "none:frozen", "sign+momentum:adamw", "sign+momentum:frozen", "sign:frozen"]
base = None
for item in specs:
    spec, kind = item.split(":")
    accs = run(arch, spec, kind, W)
    if env.rank == 0:
        if base is None: base = accs
        print(f"{arch} W={W} {spec:16s} {kind:7s} acc {sum(accs)/3:.1f} per seed {[round(a,1) for a in accs]} diff vs first {sum(a-b for a,b in zip(accs,base))/3:+.2f}", flush=True)
env.finalize()
