"""Stop 39: one walk of a DLRM forward's autograd graph for its tables' readers, and building a
flag per row from their saved indices (what scaleout.pytorch.lookup_ids does per forward): ms."""
import time, torch
from scaleout.workloads import get_workload
from scaleout.pytorch.lookup_reads import graph_readers
torch.set_num_threads(1)
w = get_workload("dlrm"); m = w.build_model(0)
x, y = w.make_batch(w.default_batch_size, 0, 0)
params = {id(p): p for n, p in m.named_parameters() if n.startswith("embeddings")}
out = w.loss_fn(m(x), y)
for _ in range(5): graph_readers(out, params)
t = time.perf_counter()
for _ in range(200): r = graph_readers(out, params)
print("walk %.3f ms" % ((time.perf_counter() - t) / 200 * 1e3), len(r))
def ids():
    parts = [node._saved_indices.reshape(-1).to(torch.long) + 7 for v in r.values() for node, _ in v]
    f = torch.zeros(77776, dtype=torch.bool); f[torch.cat(parts)] = True
t = time.perf_counter()
for _ in range(200): ids()
print("ids+flags %.3f ms" % ((time.perf_counter() - t) / 200 * 1e3))
