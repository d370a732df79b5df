import torch
from scaleout.compression import rows as rows_module, CompressionConfig
calls=[0]; orig=rows_module._touched
def counted(*a, **k):
    calls[0]+=1; return orig(*a, **k)
rows_module._touched=counted
import scaleout
from scaleout.pytorch import DataParallel, DistributedOptimizer
from scaleout.workloads import get_workload
torch.set_num_threads(1)
env=scaleout.init(timeout=60)
w=get_workload("dlrm"); b=w.default_batch_size
net=w.build_model(0)
names=[n for n,p in net.named_parameters() if p.dim()==2 and p.shape[0]>=1000]
cfg=CompressionConfig(layers={n: "rows:dense_above=0.9" for n in names}, min_numel=0)
model=DataParallel(net, env.create_distribution(), compression=cfg)
opt=DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9), model)
for step in range(6):
    x,y=w.make_batch(b*env.world_size, step, 0, rank=env.rank, world_size=env.world_size)
    w.loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad(set_to_none=True)
model.synchronize()
if env.rank==0: print(len(names), "tables named; searches in 6 steps:", calls[0], "MB/it", model.session.statistics.summary() if False else "")
model.close(); env.finalize()
