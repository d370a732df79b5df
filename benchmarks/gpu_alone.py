"""What scaleout costs a lone rank over the plain model (issue 11), in one process.

Times the plain model before any process group exists, then, interleaved over ROUNDS rounds
after ``scaleout.init()``: the plain model, DataParallel + DistributedOptimizer, DataParallel
with a plain SGD, and the whole machinery (``SCALEOUT_ALONE_FAST_PATH=0``).

    ROUNDS=5 scaleout run -n 1 benchmarks/gpu_alone.py            # on a GPU machine
    DEV=cpu WORKLOAD=digits-mlp scaleout run -n 1 benchmarks/gpu_alone.py

Results: benchmarks/results/gpu-stop11/alone.txt, RESULTS.md section 4.
"""
import os, sys, time, statistics as st
import torch
CUDA = os.environ.get("DEV", "cuda") == "cuda"
dev = torch.device("cuda", 0) if CUDA else torch.device("cpu")
if CUDA: torch.cuda.set_device(dev)
torch.set_num_threads(4)
from scaleout.workloads import get_workload
from scaleout.workloads.base import batch_to
w = get_workload(os.environ.get("WORKLOAD", "resnet18"))
batches = [batch_to(w.make_batch(32, s, 0), dev) for s in range(4)]
ITERS = int(os.environ.get("ITERS", "40"))
def sync():
    if CUDA: torch.cuda.synchronize()
def sgd(p): return torch.optim.SGD(p, lr=0.01, momentum=0.9)
def loop(model, opt):
    def it(s):
        x, y = batches[s % 4]
        w.loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad(set_to_none=True); sync()
    for s in range(5): it(s)
    times = []
    for s in range(ITERS):
        t = time.perf_counter(); it(s); times.append(time.perf_counter() - t)
    return st.median(times) * 1e3
def plain():
    net = w.build_model(0).to(dev); return loop(net, sgd(net.parameters()))
res = {"plain, no process group": [plain() for _ in range(3)]}
import scaleout
from scaleout.pytorch import DataParallel, DistributedOptimizer
env = scaleout.init(timeout=60)
print("backend", env.backend, flush=True)
def dp(fast="1"):
    os.environ["SCALEOUT_ALONE_FAST_PATH"] = fast
    net = w.build_model(0).to(dev)
    m = DataParallel(net, env.create_distribution())
    r = loop(m, DistributedOptimizer(sgd(net.parameters()), m)); m.close(); return r
def bare():
    net = w.build_model(0).to(dev)
    m = DataParallel(net, env.create_distribution())
    os.environ["SCALEOUT_ALONE_FAST_PATH"] = "1"
    return loop(m, sgd(net.parameters()))
for name in ["plain, after scaleout.init", "DataParallel+DistributedOptimizer", "DataParallel, plain SGD", "full machinery (fast path off)"]:
    res[name] = []
for r in range(int(os.environ.get("ROUNDS", "3"))):
    res["plain, after scaleout.init"].append(plain())
    res["DataParallel+DistributedOptimizer"].append(dp())
    res["DataParallel, plain SGD"].append(bare())
    res["full machinery (fast path off)"].append(dp("0"))
base = st.median(res["plain, no process group"])
for k, v in res.items():
    print(f"{k:40s} {st.median(v):7.2f} ms  x{st.median(v)/base:.3f}  {[round(x,2) for x in v]}",
          flush=True)
# The bar's figure: each round's ratio to the plain model of the same round (rounds drift more
# than the bar on a shared machine, so medians of whole columns can mislead).
paired = res["plain, after scaleout.init"]
for k in list(res)[2:]:
    ratios = [a / b for a, b in zip(res[k], paired)]
    print(f"{k:40s} per round / plain after init: median x{st.median(ratios):.3f}"
          f"  {[round(r, 3) for r in ratios]}", flush=True)
env.finalize()
sys.stdout.flush(); os._exit(0)
