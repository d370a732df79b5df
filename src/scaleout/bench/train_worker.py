"""Per-rank worker of ``scaleout bench train``: train one configuration, time it, write JSON.

Launched by :func:`scaleout.bench.train.run_benchmark` (``python -m
scaleout.bench.train_worker --config ddp ...``), as warm ranks (below) or as fresh processes
for every configuration run. Each rank builds the model from the same seed, runs ``--warmup``
untimed iterations, settles pending communication, meets the other ranks once (a barrier),
then runs :data:`LEAD_IN` + ``--iters`` iterations of forward, backward, ``step()`` and
``zero_grad()``, timing each on its own with no barrier in the loop, and settles again.
The lead-in iteration is timed and kept in the JSON but left out of the median: after
the settle it has no earlier update or communication to wait for (in overlap mode, scaleout's
iterations wait for the one before; ``hybrid``'s forward takes rows already looked up), so
it ran a median 0.55x the others' time for scaleout over 2,806 stored runs; every reported
iteration follows one that ran like it, in every configuration alike. Then every rank digests
its parameters (:mod:`scaleout.bench.train_digest`), and rank 0 writes the iteration times,
the digests (and scaleout's statistics) to ``--json``.

Batches cycle by the model's step, counted over every round, so that every configuration
takes the same batches in the same order, and a batch prefetched at the end of a round
(``hybrid``) is the one the next round starts with.

While it runs, rank 0 prints ``@@progress DONE TOTAL`` after every iteration; the runner
turns these lines into its progress bar.

Warm ranks (``--rounds N --go DIR``, :mod:`scaleout.bench.train_warm`): the same processes
run ``N`` rounds. Once imported, every rank writes ``DIR/ready.<rank>``; before round ``r``
it waits for the file ``DIR/go.<r>`` (the runner's turn signal), builds the model at its
first turn, runs the warm-up and timed iterations as above, and rank 0 writes ``--json``
with ``.round<r>`` appended. The model, optimizer and process groups are built once;
everything measured is measured again every round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from scaleout.bench.train_digest import ParameterDigest, gather_digests
from scaleout.bench.train_peers import CONFIGURATIONS, SetupOptions, build_setup, is_configuration
from scaleout.bench.train_setup import LEAD_IN, steps_per_round
from scaleout.workloads import batch_to, get_workload

__all__ = ["PROGRESS_MARK", "DISTINCT_BATCHES", "GO_POLL_S", "go_file", "main", "ready_file",
           "round_json"]

PROGRESS_MARK = "@@progress"
#: Batches are made before the loop (data generation is not timed) and cycled.
DISTINCT_BATCHES = 4
#: How often a warm rank looks for its turn (seconds).
GO_POLL_S = 0.02


def go_file(folder: str, round_index: int) -> str:
    """The file whose appearance starts round ``round_index`` of warm ranks."""
    return os.path.join(folder, f"go.{round_index}")


def round_json(path: str, round_index: int) -> str:
    """Where rank 0 of warm ranks writes round ``round_index``'s results."""
    return f"{path}.round{round_index}"


def ready_file(folder: str, rank: int) -> str:
    """The file with which warm rank ``rank`` says it is started and waits for its turn."""
    return os.path.join(folder, f"ready.{rank}")


def _announce_ready(folder: str, rank: int) -> None:
    with open(ready_file(folder, rank), "w"):
        pass


def _wait_for_turn(folder: str, round_index: int, timeout_s: float) -> None:
    """Block until the runner starts round ``round_index``.

    Raises:
        TimeoutError: no turn within ``timeout_s`` (the runner is gone or stuck).
    """
    deadline = time.monotonic() + timeout_s
    path = go_file(folder, round_index)
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"warm ranks: round {round_index} was not started within "
                               f"{timeout_s:g} s (no {path}); is the benchmark runner gone?")
        time.sleep(GO_POLL_S)



def _configuration(name: str) -> str:
    if not is_configuration(name):
        raise argparse.ArgumentTypeError(f"unknown configuration {name!r}")
    return name

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="per-rank worker of `scaleout bench train`")
    parser.add_argument("--config", required=True, type=_configuration,
                        help=f"one of {', '.join(CONFIGURATIONS)} or ddp-tuned:MB")
    parser.add_argument("--workload", required=True)
    parser.add_argument("--batch", type=int, required=True, help="samples per rank")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy", default="default")
    parser.add_argument("--mode", default="overlap")
    parser.add_argument("--compression", default=None)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--memory-budget", type=int, default=None)
    parser.add_argument("--json", required=True, help="rank 0 writes its results here")
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds these ranks run (warm ranks; needs --go when > 1)")
    parser.add_argument("--go", default=None,
                        help="folder: wait for the file go.<r> there before round r")
    parser.add_argument("--go-timeout", type=float, default=3600.0,
                        help="seconds to wait for a round's turn")
    return parser


def _timed_round(args: argparse.Namespace, setup: object, iteration: object,
                 distributed: bool, first: int, digest: ParameterDigest) -> dict[str, object]:
    """Warm-up, settle, meet, the lead-in and the timed iterations, settle; what was
    measured, and the parameters' digests. ``first`` is the model's step at the round's
    start."""
    total = steps_per_round(args.warmup, args.iters)
    for done in range(args.warmup):
        iteration(first + done, done, total)
    setup.settle()
    tuning = getattr(setup.model, "tuning", None)  # what a self-tuning model chose
    if tuning is not None:
        setup.details["tuning"] = {**tuning.as_dict(), "summary": tuning.summary()}
    setup.reset()  # (the statistics count the lead-in too: an iteration's communication
    if distributed:  # completes in the next one, the last one's in the settle below)
        torch.distributed.barrier()
    times = []
    loop_start = time.perf_counter()
    for done in range(args.warmup, total):
        start = time.perf_counter()
        iteration(first + done, done, total)
        times.append(time.perf_counter() - start)
    setup.settle()  # overlap mode: the last iteration's communication
    loop_s = time.perf_counter() - loop_start
    if setup.after_round is not None:
        setup.after_round()
    return {
        "iter_s": times, "lead_in": LEAD_IN, "median_iter_s": statistics.median(times[LEAD_IN:]),
        "loop_s": loop_s, "loop_start": loop_start,
        "details": setup.details,
        "scaleout_stats": setup.statistics() if setup.statistics is not None else None,
        "steps": first + total, "digests": gather_digests(digest, distributed),
    }


def main(argv: list[str] | None = None) -> object:
    """Run the configuration; return its set-up, which the caller keeps until it exits.

    Freeing a ``ddp`` set-up can deadlock: DDP's reducer holds the last reference to its
    gloo process group and is freed with the GIL held, so the group's destructor joins a
    worker thread that may still be freeing the final barrier's work, which needs the GIL
    (seen under load: ``~ProcessGroupGloo`` in ``std::thread::join`` on the main thread,
    ``gil_scoped_acquire`` in ``~AsyncBarrierWork`` on the gloo thread). As a script the
    worker ends with ``os._exit`` while the set-up is still referenced.
    """
    args = _parser().parse_args(argv)
    if args.rounds < 1 or (args.rounds > 1 and args.go is None):
        raise SystemExit(f"train_worker: --rounds {args.rounds} needs --go (and must be >= 1)")
    torch.set_num_threads(args.threads)
    workload = get_workload(args.workload)
    distributed = args.config != "single"
    rank = int(os.environ.get("RANK", "0")) if distributed else 0
    world = int(os.environ.get("WORLD_SIZE", "1")) if distributed else 1
    options = SetupOptions(workload=workload, seed=args.seed, policy=args.policy,
                           mode=args.mode, compression=args.compression,
                           timeout_s=args.timeout, device=args.device,
                           memory_budget=args.memory_budget, warmup=args.warmup,
                           batch=args.batch)
    device = options.torch_device()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    if args.go is not None:  # imported; set up only at this configuration's first turn, so
        _announce_ready(args.go, rank)  # no setup runs while another configuration is timed
        _wait_for_turn(args.go, 0, args.go_timeout)
    started = time.perf_counter()
    setup = build_setup(args.config, options)
    digest = ParameterDigest(setup)  # (the parameters as they start)
    total = steps_per_round(args.warmup, args.iters)
    batches = [batch_to(workload.make_batch(args.batch * world, step, args.seed, rank=rank,
                                       world_size=world), device)
               for step in range(min(DISTINCT_BATCHES, total))]

    last_loss: list[torch.Tensor] = []

    def iteration(step: int, done: int, total: int) -> None:
        """The model's step ``step`` (batches cycle by it), the round's ``done``-th."""
        inputs, targets = batches[step % len(batches)]
        if setup.prefetch is not None:  # (hybrid: the next batch's ids travel during this one;
            if step == 0:                # the last iteration's too, drained by the settle)
                setup.prefetch(inputs)
            setup.prefetch(batches[(step + 1) % len(batches)][0])
        loss = workload.loss_fn(setup.model(inputs), targets)
        loss.backward()
        last_loss[:] = [loss.detach()]  # read once at the end: no host sync per iteration
        setup.optimizer.step()
        setup.optimizer.zero_grad(set_to_none=True)
        if cuda:  # the iteration's time includes its kernels, not only their launches
            torch.cuda.synchronize(device)
        if rank == 0:
            print(f"{PROGRESS_MARK} {done + 1} {total}", flush=True)

    for round_index in range(args.rounds):
        if round_index:
            _wait_for_turn(args.go, round_index, args.go_timeout)
            started = time.perf_counter()
        result = _timed_round(args, setup, iteration, distributed, round_index * total,
                              digest)
        result["setup_and_warmup_s"] = result.pop("loop_start") - started
        result.update(config=args.config, ranks=world, batch_per_rank=args.batch,
                      threads=args.threads, device=str(device), round=round_index,
                      final_loss=float(last_loss[0]), pid=os.getpid())
        if rank == 0:
            path = args.json if args.go is None else round_json(args.json, round_index)
            with open(path + ".tmp", "w") as handle:
                json.dump(result, handle)
            os.replace(path + ".tmp", path)  # the runner never reads a half-written file
        if distributed:
            torch.distributed.barrier()  # nobody tears down while a peer still communicates
    setup.close()
    write_trace = getattr(setup.model, "write_trace", None)
    if write_trace is not None:  # SCALEOUT_TRACE (bench train --trace): name what ran
        write_trace(workload=args.workload, batch_size=args.batch,
                    command=f"scaleout bench train --workload {args.workload} "
                            f"(configuration {args.config}, {world} ranks)")
    return setup


if __name__ == "__main__":
    kept = main()  # never freed: see main()
    # The results are written and every process group is destroyed. Skip interpreter
    # finalisation: on gloo it can abort ("terminate called without an active
    # exception") when torch's C++ work objects are freed after Python's, which would
    # turn a finished measurement into a failed configuration.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
