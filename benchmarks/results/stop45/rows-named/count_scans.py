import os, sys, torch
from scaleout.compression import rows as rows_module
calls=[0]; orig=rows_module._touched
def counted(*a, **k):
    calls[0]+=1; return orig(*a, **k)
rows_module._touched=counted
from scaleout.bench.train_peers import build_setup
from scaleout.bench.train_setup import SetupOptions
from scaleout.workloads import get_workload
torch.set_num_threads(1)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
w=get_workload("dlrm"); b=w.default_batch_size
setup=build_setup("scaleout", SetupOptions(workload=w, policy="default", mode="overlap", compression=sys.argv[1] if len(sys.argv)>1 else None, batch=b, memory_budget=None))
for step in range(6):
    x,y=w.make_batch(b*world, step, 0, rank=rank, world_size=world)
    w.loss_fn(setup.model(x), y).backward(); setup.optimizer.step(); setup.optimizer.zero_grad(set_to_none=True)
setup.settle()
if rank==0: print("searches in 6 steps:", calls[0], "buckets:", [(bk.name[:40], type(getattr(bk.state,'codec',None)).__name__) for bk in setup.model._session.buckets][:8])
setup.close()
