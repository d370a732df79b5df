import os, sys, time, statistics, torch
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", SCALEOUT_ALONE_FAST_PATH="0")
torch.set_num_threads(1)
import scaleout
from scaleout.workloads import get_workload
from scaleout.pytorch import DataParallel, DistributedOptimizer
env = scaleout.init(timeout=60)
w = get_workload("resnet18")
torch.manual_seed(0)
net = w.build_model(0)
model = DataParallel(net, env.create_distribution())
opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9), model)
batch = w.make_batch(16, 0, 0)
x, y = batch
times = []
for i in range(int(sys.argv[1])):
    t = time.perf_counter()
    w.loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
    times.append(time.perf_counter() - t)
model.synchronize()
print(sys.argv[3], "median ms", round(statistics.median(times[2:]) * 1000, 1), "cpu s", round(time.process_time(), 2))
env.finalize()
