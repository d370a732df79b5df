"""Two ranks sharing one GPU over gloo (issue 11): where a ResNet-18 iteration goes.

Prints raw gloo allreduce times of 45 MB (CUDA, CPU, pinned; one call, four, and two halves
on two process groups at once), then the median iteration time of DDP and of scaleout
variants (policy, channels, bucket and credit sizes), interleaved over two rounds.

    THREADS=4 scaleout run -n 2 benchmarks/gpu_two_ranks.py        # on a GPU machine
    DEV=cpu ITERS=2 N=100000 scaleout run -n 2 benchmarks/gpu_two_ranks.py   # smoke run

Results: benchmarks/results/gpu-stop11/two-ranks-probe-*.txt, RESULTS.md section 4.
"""
import os, sys, time, statistics as st
import torch, torch.distributed as dist
import scaleout
from scaleout import SchedulerConfig
from scaleout.pytorch import DataParallel, DistributedOptimizer
from scaleout.workloads import get_workload
from scaleout.workloads.base import batch_to
from torch.nn.parallel import DistributedDataParallel as DDP

MB = 1 << 20
env = scaleout.init(timeout=120)
rank, world = env.rank, env.world_size
CUDA = os.environ.get("DEV", "cuda") == "cuda"
dev = torch.device("cuda", 0) if CUDA else torch.device("cpu")
if CUDA: torch.cuda.set_device(dev)
def sync():
    if CUDA: torch.cuda.synchronize()
ITERS, N = int(os.environ.get("ITERS", "20")), int(os.environ.get("N", "11200000"))
torch.set_num_threads(int(os.environ.get("THREADS", "4")))
def log(*a):
    if rank == 0: print(*a, flush=True)
log("backend", env.backend, "world", world)

def time_ar(t, n=10, group=None):
    for _ in range(2): dist.all_reduce(t, group=group)
    sync(); s = time.perf_counter()
    for _ in range(n): dist.all_reduce(t, group=group)
    sync(); return (time.perf_counter() - s) / n * 1e3
n = N
if os.environ.get("RAW", "1") == "1": log("allreduce 45MB cuda ms", round(time_ar(torch.ones(n, device=dev)), 2))
log("allreduce 45MB cpu ms", round(time_ar(torch.ones(n)), 2))
if CUDA: log("allreduce 45MB cpu pinned ms", round(time_ar(torch.ones(n).pin_memory()), 2))
log("allreduce 4x11MB cuda ms", round(sum(time_ar(torch.ones(n // 4, device=dev)) for _ in range(4)), 2))
g2 = dist.new_group(backend="gloo")
def concurrent(parts):
    ts = [torch.ones(n // parts, device=dev) for _ in range(parts)]
    groups = [None, g2]
    for _ in range(2):
        ws = [dist.all_reduce(t, group=groups[i % 2], async_op=True) for i, t in enumerate(ts)]
        [w.wait() for w in ws]
    sync(); s = time.perf_counter()
    for _ in range(5):
        ws = [dist.all_reduce(t, group=groups[i % 2], async_op=True) for i, t in enumerate(ts)]
        [w.wait() for w in ws]
    sync(); return (time.perf_counter() - s) / 5 * 1e3
log("allreduce 45MB as 2 halves on 2 groups concurrently ms", round(concurrent(2), 2))

w = get_workload("resnet18")
batches = [batch_to(w.make_batch(32 * world, s, 0, rank=rank, world_size=world), dev) for s in range(4)]
def run(name, build, iters=ITERS, warm=5):
    torch.manual_seed(0)
    model, opt, close = build()
    def it(s):
        x, y = batches[s % 4]
        w.loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad(set_to_none=True)
        sync()
    for s in range(warm): it(s)
    dist.barrier(); times = []
    for s in range(iters):
        t = time.perf_counter(); it(s); times.append(time.perf_counter() - t)
    close(); dist.barrier()
    return st.median(times) * 1e3
def sgd(p): return torch.optim.SGD(p, lr=0.01, momentum=0.9)
def ddp():
    m = DDP(w.build_model(0).to(dev), device_ids=[0] if CUDA else None); return m, sgd(m.parameters()), lambda: None
def so(**kw):
    def b():
        net = w.build_model(0).to(dev)
        m = DataParallel(net, env.create_distribution(), scheduler=SchedulerConfig(**kw))
        o = DistributedOptimizer(sgd(net.parameters()), m, mode=os.environ.get("MODE", "overlap"))
        return m, o, m.close
    return b
variants = {"ddp": ddp, "so-priority": so(), "so-fifo": so(policy="fifo"),
            "so-priority-credit64": so(credit_bytes=64 * MB),
            "so-priority-bucket25-credit64": so(bucket_bytes=25 * MB, credit_bytes=64 * MB),
            "so-fifo-3ch": so(policy="fifo", channels=3)}
res = {k: [] for k in variants}
for r in range(2):
    for k, b in variants.items():
        res[k].append(run(k, b)); log(r, k, round(res[k][-1], 2))
for k, v in res.items():
    log(f"{k:20s} median {st.median(v):.2f} ms  vs ddp {st.median(res['ddp'])/st.median(v):.3f}x")
env.finalize()

sys.stdout.flush(); os._exit(0)
