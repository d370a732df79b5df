"""CPU time per training iteration of one ``bench train`` configuration, per rank and per thread.

On a 2-core machine two ranks that also move their gradients are CPU-bound: an iteration
cannot take less than the CPU one rank spends on it. This measures that CPU (``getrusage``:
user + system, the context switches) and the main thread's own CPU per phase (forward,
backward, step + zero_grad) and every thread's CPU (``/proc/self/task``: the progress thread,
gloo's threads), so the overhead a configuration adds over ``single`` and ``ddp`` shows in
figures that other load on the machine disturbs less than wall time. Run
with torchrun (one process per rank), on loopback::

    torchrun --nproc_per_node 2 benchmarks/cpu_per_iteration.py scaleout [WORKLOAD] [ITERS]

``THREADS`` (default 1) is torch's intra-op thread count per rank (``bench train --threads``).
torchrun leaves glibc's allocator at its defaults, where ``bench train`` and ``scaleout run``
give ranks ``--allocator keep``: for the same setting, run with ``GLIBC_TUNABLES=glibc.malloc.
trim_threshold=1073741824:glibc.malloc.mmap_threshold=1073741824`` (``scaleout.launch.
allocator``). Without it both configurations page-fault 20-40k times per ResNet-18
iteration, which is system time that ``bench train`` does not see (RESULTS.md, stop 46).
``SCALEOUT_POLICY`` (``default``, ``priority``, ``fifo``), ``SCALEOUT_MODE`` (``overlap``,
``sync``) and ``SCALEOUT_COMPRESSION`` (a codec spec, e.g. ``powersgd:2``) choose scaleout's
set-up; ``BUDGET`` (e.g. ``4m``) is ``bench train``'s ``--memory-budget`` (the hybrid's plan),
and a configuration that prefetches (the hybrid) gets each next batch's ids as there. Rank 0
prints one line; with ``CPU_JSON=PATH`` every rank also appends its figures to PATH as one
JSON line. Interleave configurations and repeat (the machine's speed drifts by 20-30% over
minutes here).
"""

import json
import os
import resource
import sys
import threading
import time
from collections import defaultdict

import torch

from scaleout.bench.train_peers import build_setup
from scaleout.bench.train_setup import SetupOptions
from scaleout.workloads import get_workload

WARMUP = 10
DISTINCT_BATCHES = 8


def thread_cpu() -> dict[str, list[float]]:
    """``[CPU seconds, voluntary context switches]`` so far of each of this process's threads,
    by name: Python threads by their ``threading`` name (the OS shows ``python3`` for all of
    them), gloo's by their kernel name (``gloo_tcp_loop``, ``pt_gloo_runloop``), summed per
    name (``BY_TID=1``: per thread, ``name#tid``; each gloo process group has a loop thread of
    its own). Empty where ``/proc`` is not."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return {}
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()  # from field 3 (state) on
            with open(f"/proc/self/task/{task}/comm") as handle:
                kernel_name = handle.read().strip()
            with open(f"/proc/self/task/{task}/status") as handle:
                waits = next(int(line.split()[1]) for line in handle
                             if line.startswith("voluntary_ctxt_switches"))
        except OSError:  # the thread ended meanwhile
            continue
        name = names.get(int(task), kernel_name)
        totals = out[f"{name}#{task}" if os.environ.get("BY_TID") == "1" else name]
        totals[0] += (int(fields[11]) + int(fields[12])) / ticks
        totals[1] += waits
    return out


def _budget(text: str | None) -> int | None:
    """The ``BUDGET`` variable in bytes (``4m``, ``1048576``: read as ``bench train
    --memory-budget`` reads it), or none."""
    if not text:
        return None
    from scaleout.cli.bench_train import _memory_budget
    return _memory_budget(text)


def main(config: str, workload_name: str = "dlrm", iters: int = 200) -> None:
    torch.set_num_threads(int(os.environ.get("THREADS", "1")))  # (bench train --threads)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    workload = get_workload(workload_name)
    batch = workload.default_batch_size
    options = SetupOptions(workload=workload,
                           policy=os.environ.get("SCALEOUT_POLICY", "default"),
                           mode=os.environ.get("SCALEOUT_MODE", "overlap"),
                           compression=os.environ.get("SCALEOUT_COMPRESSION") or None,
                           batch=batch, memory_budget=_budget(os.environ.get("BUDGET")))
    setup = build_setup(config, options)
    batches = [workload.make_batch(batch * world, step, 0, rank=rank, world_size=world)
               for step in range(DISTINCT_BATCHES)]
    phases = [0.0, 0.0, 0.0]  # main thread CPU: forward, backward, step + zero_grad

    def iteration(step: int, record: bool) -> None:
        inputs, targets = batches[step % DISTINCT_BATCHES]
        if setup.prefetch is not None:  # (hybrid: the next batch's ids, as bench train does)
            setup.prefetch(batches[(step + 1) % DISTINCT_BATCHES][0])
        began = time.thread_time()
        loss = workload.loss_fn(setup.model(inputs), targets)
        forward = time.thread_time()
        loss.backward()
        backward = time.thread_time()
        setup.optimizer.step()
        setup.optimizer.zero_grad(set_to_none=True)
        if record:
            phases[0] += forward - began
            phases[1] += backward - forward
            phases[2] += time.thread_time() - backward

    if setup.prefetch is not None:
        setup.prefetch(batches[0][0])
    for step in range(WARMUP):
        iteration(step, False)
    setup.settle()
    threads_before = thread_cpu()
    before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for step in range(iters):
        iteration(WARMUP + step, True)
    setup.settle()
    wall = (time.perf_counter() - started) / iters
    after = resource.getrusage(resource.RUSAGE_SELF)
    threads = {name: [(now - then) / iters for now, then
                      in zip(totals, threads_before.get(name, [0.0, 0.0]))]
               for name, totals in thread_cpu().items()}
    cpu = (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime) / iters
    system = (after.ru_stime - before.ru_stime) / iters
    voluntary = (after.ru_nvcsw - before.ru_nvcsw) / iters  # waits
    switches = voluntary + (after.ru_nivcsw - before.ru_nivcsw) / iters  # + preempted
    faults = (after.ru_minflt - before.ru_minflt) / iters  # pages the kernel mapped (zeroed)
    if os.environ.get("CPU_JSON"):  # one JSON line per rank, appended
        record = {"config": config, "workload": workload_name, "rank": rank, "world": world,
                  "iters": iters, "wall_ms": 1e3 * wall, "cpu_ms": 1e3 * cpu,
                  "system_ms": 1e3 * system, "minor_faults": faults,
                  "main_ms": dict(zip(("forward", "backward", "step"),
                                      (1e3 * p / iters for p in phases))),
                  "threads_ms": {n: 1e3 * v[0] for n, v in threads.items()},
                  "policy": options.policy, "mode": options.mode}
        with open(os.environ["CPU_JSON"], "a") as handle:
            handle.write(json.dumps(record) + "\n")
    if rank == 0:
        forward, backward, step = (1e3 * p / iters for p in phases)
        print(f"{config} {workload_name} {world} ranks: {1e3 * wall:.2f} ms/it wall, "
              f"{1e3 * cpu:.2f} ms/it CPU ({1e3 * system:.2f} system), {switches:.1f} context "
              f"switches/it ({voluntary:.1f} voluntary); main thread CPU forward "
              f"{forward:.2f} backward {backward:.2f} step {step:.2f} ms/it; {faults:.0f} minor page "
              f"faults/it", flush=True)
        for column, title, unit in ((0, "CPU per thread (ms/it, clock ticks)", 1e3),
                                    (1, "voluntary context switches per thread per iteration", 1)):
            ranked = sorted(((v[column], n) for n, v in threads.items() if v[column] > 0),
                            reverse=True)
            print(f"  {title}: " + ", ".join(f"{n} {unit * x:.2f}" for x, n in ranked),
                  flush=True)
    setup.close()


if __name__ == "__main__":
    main(sys.argv[1], *(sys.argv[2:3]), *(int(a) for a in sys.argv[3:4]))
