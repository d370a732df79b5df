"""Rows searched by the rows codec in 6 DLRM steps, rank 0 (stop 46): the number of searches
and the rows they covered. torchrun --nproc_per_node 2 count_rows.py rows:dense_above=0.9"""
import os, sys, torch
from scaleout.compression import rows as rows_module
searched = []; orig = rows_module._touched
def counted(matrix, *a, **k):
    searched.append(matrix.shape[0]); return orig(matrix, *a, **k)
rows_module._touched = counted
from scaleout.bench.train_peers import build_setup
from scaleout.bench.train_setup import SetupOptions
from scaleout.workloads import get_workload
torch.set_num_threads(1)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
w = get_workload("dlrm"); b = w.default_batch_size
setup = build_setup("scaleout", SetupOptions(workload=w, policy="default", mode="overlap",
                    compression=sys.argv[1] if len(sys.argv) > 1 else None, batch=b, memory_budget=None))
for step in range(6):
    x, y = w.make_batch(b * world, step, 0, rank=rank, world_size=world)
    w.loss_fn(setup.model(x), y).backward(); setup.optimizer.step(); setup.optimizer.zero_grad(set_to_none=True)
setup.settle()
if rank == 0:
    print(f"{sys.argv[1:]}: {len(searched)} searches in 6 steps covering {sum(searched)} rows")
setup.close()
