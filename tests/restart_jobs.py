"""Training jobs for the restart tests: run by ``scaleout run`` as a script, and by the
forked harness (``run_ranks``) as functions for the uninterrupted reference (cheaper than a
second launched job). Each returns the SHA-256 of its final weights."""

from __future__ import annotations

import hashlib
import os
import signal
import sys

import torch
from torch import nn


def _digest(model: nn.Module) -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                   for p in model.parameters())).hexdigest()


def checkpointed(path: str, kill_at: int) -> str:
    """10 steps, 2 ranks, momentum, per-rank random data, ``scaleout.checkpoint`` every 3
    steps, resumed when there is one; on attempt 0 rank 1 SIGKILLs itself before step
    ``kill_at`` (-1: never)."""
    import scaleout
    from scaleout import checkpoint
    from scaleout.pytorch import DataParallel, DistributedOptimizer

    torch.set_num_threads(1)
    env = scaleout.init(timeout=30)
    attempt = int(os.environ.get("SCALEOUT_RESTART_COUNT", "0"))
    assert os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == str(attempt)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    model = DataParallel(net, env.create_distribution())
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), model)
    step = checkpoint.load(path, model, opt)[0] if os.path.islink(path) else 0
    print(f"attempt {attempt} starts at step {step}", flush=True)
    while step < 10:
        if step == kill_at and attempt == 0 and env.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        loss = model(torch.randn(8, 16) + env.rank).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        step += 1
        if step % 3 == 0:
            checkpoint.save(path, model, opt, step=step)
    model.synchronize()
    digest = _digest(net)
    model.close()
    env.finalize()
    return digest


def elastic(kill: bool) -> str:
    """A Horovod elastic script: 48 samples, 2 ranks, batches of 4 (6 steps per epoch), 2
    epochs, a commit every 2 steps; with ``kill``, rank 1 SIGKILLs itself at step 9 on
    attempt 0 (mid-epoch 1, one step after the commit at step 8)."""
    from torch.utils.data import DataLoader, TensorDataset

    import scaleout.horovod as hvd

    torch.set_num_threads(1)
    hvd.init(timeout=30)
    attempt = int(os.environ.get("SCALEOUT_RESTART_COUNT", "0"))
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(48, 8, generator=g), torch.randint(0, 2, (48,), generator=g))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(data, seed=3)
    loader = DataLoader(data, batch_size=4, sampler=sampler)
    state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=0, steps=0)
    state.register_reset_callbacks(
        [lambda: print(f"reset: attempt {attempt} resumes at step {state.steps}", flush=True)])

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        for state.epoch in range(state.epoch, 2):
            sampler.set_epoch(state.epoch)
            for batch, (x, y) in enumerate(loader):
                if kill and attempt == 0 and hvd.rank() == 1 and state.steps == 9:
                    os.kill(os.getpid(), signal.SIGKILL)
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                sampler.record_batch(batch, 4)
                state.steps += 1
                if state.steps % 2 == 0:
                    state.commit()

    train(state)
    assert state.steps == 12
    digest = _digest(model)
    hvd.shutdown()
    return digest


if __name__ == "__main__":
    job, rest = sys.argv[1], sys.argv[2:]
    result = checkpointed(rest[0], int(rest[1])) if job == "checkpointed" else elastic(
        rest[0] == "kill")
    print(f"final weights={result}", flush=True)
    os._exit(0)  # see _TEARDOWN in test_launcher.py
