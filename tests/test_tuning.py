"""DataParallel(tune=...): measured, agreed on by every rank, rebuilt once, arguments checked."""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import scaleout
from harness import run_ranks
from scaleout.pytorch import DataParallel, DistributedOptimizer
from scaleout.pytorch.tuning import TuneConfig, as_tune_config
from scaleout.sim.tuning import LinkModel

SLOW = LinkModel(ranks=2, latency_s=1e-3, seconds_per_byte=1e-6)  # ~1 MB/s: codecs pay
LATENCY_BOUND = LinkModel(ranks=2, latency_s=0.2, seconds_per_byte=1e-10)


def _net(wide: bool = False) -> nn.Module:
    torch.manual_seed(0)
    if wide:  # 8 layers of 1 MB: a latency-bound link wants fewer, bigger messages
        return nn.Sequential(nn.Linear(128, 512), *(nn.Linear(512, 512) for _ in range(8)),
                             nn.Linear(512, 10))
    return nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 10))


def body(tune: object, optimizer: str, distributed: bool = True, steps: int = 6,
         cuda: bool = False) -> dict:
    world = int(os.environ["WORLD_SIZE"])
    env = scaleout.init(backend=("nccl" if world == 1 else "gloo") if cuda else None, timeout=60)
    device = torch.device("cuda" if cuda else "cpu")
    net = _net(wide=isinstance(tune, TuneConfig) and tune.link is LATENCY_BOUND).to(device)
    model = DataParallel(net, env.create_distribution(), tune=tune)
    inner = (torch.optim.AdamW(net.parameters(), lr=1e-3) if optimizer == "adamw"
             else torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9))
    opt = DistributedOptimizer(inner, model) if distributed else inner
    generator = torch.Generator().manual_seed(1 + env.rank)
    tuned_at = None
    for step in range(steps):
        x = torch.randn(16, 128, generator=generator)
        y = torch.randint(0, 10, (16,), generator=generator)
        F.cross_entropy(model(x.to(device)), y.to(device)).backward()
        if tuned_at is None and model.tuning is not None:
            tuned_at = step + 1  # the forward that tuned
        opt.step()
        opt.zero_grad()
    model.synchronize()
    total = model.statistics.total()
    out = {"key": repr(model.tuning.key()), "in_use": model.session.scheduler,
           "chosen": model.tuning.scheduler, "summary": model.tuning.summary(),
           "codecs": dict(model.tuning.codecs), "tuned_at": tuned_at,
           "compressed_in_use": model._compression is not None,
           "params": [p.detach().cpu() for p in net.parameters()],
           "bytes": total.bytes, "raw_bytes": total.raw_bytes,
           "cpu_per_message": model.tuning.link.cpu_s_per_message,
           "cpu_per_byte": model.tuning.link.cpu_s_per_byte}
    model.close()
    env.finalize()
    return out


def test_every_rank_agrees_and_the_replicas_stay_identical() -> None:
    results = run_ranks(3, body, True, "sgd", timeout=120)
    assert len({r["key"] for r in results}) == 1
    assert results[0]["tuned_at"] == 4  # skip 1, measure 2, then tune
    assert not results[0]["codecs"] and "chosen:" in results[0]["summary"]
    # a collective's CPU, measured on this CPU run, the slowest rank's on every rank
    assert len({r["cpu_per_message"] for r in results}) == 1
    assert results[0]["cpu_per_message"] > 0
    assert "of CPU per collective" in results[0]["summary"]
    # and what a 4 MiB all-reduce costs beyond it, per byte (gloo's threads, the kernel)
    assert len({r["cpu_per_byte"] for r in results}) == 1
    assert results[0]["cpu_per_byte"] > 0 and "of CPU per MiB moved" in results[0]["summary"]
    for other in results[1:]:
        for a, b in zip(results[0]["params"], other["params"]):
            assert torch.equal(a, b)


def test_loopback_with_no_rate_limit_chooses_nothing_lossy() -> None:
    results = run_ranks(2, body, "lossy", "sgd", timeout=120)
    assert results[0]["key"] == results[1]["key"]
    assert results[0]["codecs"] == {}, results[0]["summary"]
    # not priced at all: over loopback a busy machine's measured link once made powersgd
    # look 10.4% faster (a test run beside another); the bytes are memory copies there
    assert "every rank is on this machine (rendezvous on 127.0.0.1, 2 ranks local)" in \
        results[0]["summary"]
    assert results[0]["bytes"] == results[0]["raw_bytes"]
    # the defaults are priced as the session runs them over loopback: fifo, not the plan's
    # priority (which the defaults never ran here)
    assert "  defaults: fifo bucket=" in results[0]["summary"], results[0]["summary"]


def test_a_slow_link_gets_a_codec_that_suits_the_optimizer() -> None:
    tune = TuneConfig(allow_lossy=True, link=SLOW, verify=0)  # what-if: not timed here
    results = run_ranks(2, body, tune, "adamw", True, 7, timeout=120)
    assert results[0]["key"] == results[1]["key"]
    chosen = set(results[0]["codecs"].values())
    assert chosen and chosen <= {"cast:bf16", "blockquant"}, results[0]["summary"]
    assert "unsuited to AdamW" in results[0]["summary"]
    assert results[0]["bytes"] < results[0]["raw_bytes"]  # after tuning, compressed on the wire
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)


def test_a_latency_bound_link_rebuilds_the_plan_with_fewer_messages() -> None:
    from scaleout.scheduler import SchedulerConfig

    results = run_ranks(2, body, TuneConfig(link=LATENCY_BOUND, verify=0), "sgd", timeout=120)
    assert results[0]["key"] == results[1]["key"]
    chosen = results[0]["chosen"]
    assert chosen != SchedulerConfig(), results[0]["summary"]
    assert results[0]["in_use"] == chosen  # the session was rebuilt with it
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)


def body_rebuilds() -> list[int]:
    """Plans again three times (as the tuner's trials do), training a step after each: the
    process groups made so far after each plan."""
    import torch.distributed as tdist

    from scaleout.scheduler import SchedulerConfig

    made = [0]
    new_group = tdist.new_group

    def counted(*args: object, **kwargs: object) -> object:
        made[0] += 1
        return new_group(*args, **kwargs)

    tdist.new_group = counted
    env = scaleout.init(timeout=60)
    net = _net()
    model = DataParallel(net, env.create_distribution(),
                         scheduler=SchedulerConfig(policy="priority", bucket_bytes=1 << 16))
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01), model)
    generator = torch.Generator().manual_seed(1 + env.rank)
    counts = []
    for policy in ("priority", "fifo", "priority", "fifo"):
        if counts:
            model._rebuild(SchedulerConfig(policy=policy, bucket_bytes=1 << 16), None)
        F.cross_entropy(model(torch.randn(8, 128, generator=generator)),
                        torch.randint(0, 10, (8,), generator=generator)).backward()
        opt.step()
        opt.zero_grad()
        model.synchronize()
        counts.append(made[0])
    model.close()
    env.finalize()
    return counts


def test_a_plan_made_again_sends_on_the_process_groups_of_the_last() -> None:
    # each new gloo group would keep a thread waking 100 times a second, for good
    for counts in run_ranks(2, body_rebuilds, timeout=120):
        assert counts[1:] == [counts[0]] * 3, counts


def test_a_choice_is_timed_and_every_rank_keeps_what_the_check_decided() -> None:
    """The real path: tuned at forward 4, the choice settles at 5, is timed over 5-6 and
    decided at 7; kept or undone, the report says which and the session runs it."""
    results = run_ranks(2, body, TuneConfig(link=LATENCY_BOUND), "sgd", True, 9, timeout=120)
    assert results[0]["key"] == results[1]["key"]
    assert "measured per iteration: the choice" in results[0]["summary"], results[0]["summary"]
    assert results[0]["in_use"] == results[0]["chosen"]  # what the report says is what runs
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)


def test_a_close_runner_up_is_timed_too_and_every_rank_runs_what_was_kept() -> None:
    """Tuned at forward 4; the choice settles at 5 and is timed over 5-6; the runner-up is
    built at 7, settles, is timed over 8-9 and the faster (or the defaults) kept at 10."""
    tune = TuneConfig(allow_lossy=True, link=SLOW, codecs=("powersgd:rank=2", "topk:ratio=0.01"),
                      runner_up_within=0.99)  # any other codec that gains 10% is a runner-up
    results = run_ranks(2, body, tune, "sgd", True, 11, timeout=120)
    first = results[0]
    assert first["key"] == results[1]["key"]
    assert "runner-up:" in first["summary"], first["summary"]
    kept = next(line for line in first["summary"].splitlines() if "measured per iteration" in line)
    assert "the choice " in kept and "the runner-up " in kept, kept  # both were timed
    assert kept.endswith(("the choice is kept", "the runner-up is kept",
                          "the defaults are restored")), kept
    assert first["in_use"] == first["chosen"] and first["compressed_in_use"] == bool(first["codecs"])
    for a, b in zip(first["params"], results[1]["params"]):
        assert torch.equal(a, b)


def test_an_exact_choice_left_at_the_defaults_still_has_the_other_policy_timed() -> None:
    """The defaults stay (nothing gains 99% on paper), yet the other policy, predicted close,
    is timed beside them: the plan in use is the first trial (no rebuild at forward 4)."""
    tune = TuneConfig(link=SLOW, min_gain_exact=0.99, runner_up_within=0.99)
    results = run_ranks(2, body, tune, "sgd", True, 11, timeout=120)
    first = results[0]
    assert first["key"] == results[1]["key"] and not first["codecs"]
    assert "the defaults stay" in first["summary"] and "runner-up:" in first["summary"]
    kept = next(line for line in first["summary"].splitlines() if "measured per iteration" in line)
    assert "the choice " in kept and "the runner-up " in kept, kept  # both were timed
    assert first["in_use"] == results[1]["in_use"]  # every rank runs the same plan
    assert first["in_use"] == first["chosen"]  # what the report says is what runs
    for a, b in zip(first["params"], results[1]["params"]):
        assert torch.equal(a, b)


def _check_model(rebuilt: list) -> object:
    from types import SimpleNamespace

    return SimpleNamespace(_device=torch.device("cpu"), comm=SimpleNamespace(size=1),
                           synchronize=lambda: None, _rebuild=lambda *a: rebuilt.append(a),
                           _exchanges=0)


def _choice(runner_up: bool = False) -> object:
    from scaleout.scheduler import SchedulerConfig
    from scaleout.sim.tuning import Candidate, TuneChoice

    runner = Candidate("topk:ratio=0.01 on the 1 largest", SchedulerConfig(bucket_bytes=2 << 20),
                       {"l0": "topk:ratio=0.01"}, 0.011) if runner_up else None
    return TuneChoice(scheduler=SchedulerConfig(bucket_bytes=1 << 20), codecs={"l0": "blockquant"},
                      predicted_s=0.01, default_s=0.02, exact_s=0.02, compute_s=0.005,
                      link=LATENCY_BOUND, reasons=(), candidates=(), runner_up=runner)


def _timed(monkeypatch: pytest.MonkeyPatch, check: object, model: object, choice: object,
           per_iteration: list[float], drift: float = 0.0,
           per_window: list[float] | None = None) -> object:
    """Drive ``check`` through its windows (``tune_check.windows``: one settling iteration,
    then the timed ones), an iteration of trial ``i`` lasting ``per_iteration[i]`` (or of
    window ``j``, ``per_window[j]``) plus ``drift`` x the iterations run before it; the
    decision."""
    from scaleout.pytorch import tune_check

    ticks, now, ran = [], 1.0, 0
    for j, (trial, timed) in enumerate(tune_check.windows(check.verify, len(per_iteration))):
        for _ in range(1 + timed):  # the settling iteration, then the timed ones
            now += (per_window[j] if per_window else per_iteration[trial]) + drift * ran
            ran += 1
            ticks.append(now)  # the next forward
    clock = iter(ticks)
    monkeypatch.setattr(tune_check.time, "perf_counter", lambda: next(clock))
    for _ in range(len(ticks) - 1):
        model._exchanges += 1  # (the iteration before this forward exchanged)
        assert check.at_forward(model, choice) is None
    model._exchanges += 1
    return check.at_forward(model, choice)


def test_a_choice_slower_than_the_defaults_is_undone(monkeypatch: pytest.MonkeyPatch) -> None:
    from scaleout.pytorch import tune_check
    from scaleout.scheduler import SchedulerConfig

    choice, defaults = _choice(), (SchedulerConfig(), None)
    plan = (choice.scheduler, "compressed")
    for per_iteration, kept in ((0.05, False), (0.01, True)):
        rebuilt: list = []
        check = tune_check.ChoiceCheck(default_s=0.02, fallback=defaults, verify=2, plans=(plan,))
        decided = _timed(monkeypatch, check, _check_model(rebuilt), choice, [per_iteration])
        if kept:
            assert rebuilt == [] and decided.key() == choice.key()
            assert decided.reasons[-1].endswith(": the choice is kept")
        else:
            assert rebuilt == [defaults] and decided.scheduler == SchedulerConfig()
            assert decided.codecs == {} and "defaults are restored" in decided.reasons[-1]


@pytest.mark.parametrize("choice_s, runner_s, kept", [
    (0.015, 0.010, "runner-up"), (0.010, 0.015, "choice"), (0.030, 0.040, "defaults")])
def test_the_faster_of_the_choice_and_its_runner_up_is_kept(
        monkeypatch: pytest.MonkeyPatch, choice_s: float, runner_s: float, kept: str) -> None:
    from scaleout.pytorch import tune_check
    from scaleout.scheduler import SchedulerConfig
    from scaleout.sim.units import format_time

    choice, defaults = _choice(runner_up=True), (SchedulerConfig(), None)
    plans = ((choice.scheduler, "choice codecs"), (choice.runner_up.scheduler, "runner codecs"))
    rebuilt: list = []
    check = tune_check.ChoiceCheck(default_s=0.02, fallback=defaults, verify=2, plans=plans)
    decided = _timed(monkeypatch, check, _check_model(rebuilt), choice, [choice_s, runner_s])
    # the runner-up was built after the choice's first window, the choice after the runner-up's
    assert rebuilt[:2] == [plans[1], plans[0]]
    said = decided.reasons[-1]
    assert f"the choice {format_time(choice_s)} (windows {format_time(choice_s)} and " in said
    assert f"), the runner-up {format_time(runner_s)}" in said
    if kept == "runner-up":
        assert rebuilt == [plans[1], plans[0], plans[1]]  # built again: it stays in use
        assert decided.scheduler == choice.runner_up.scheduler
        assert dict(decided.codecs) == {"l0": "topk:ratio=0.01"} and decided.runner_up is None
        assert decided.reasons[-1].endswith("the runner-up is kept")
    elif kept == "choice":
        assert rebuilt == [plans[1], plans[0]]  # the choice's second window: in use
        assert decided.key() == choice.key() and decided.reasons[-1].endswith("the choice is kept")
    else:
        assert rebuilt == [plans[1], plans[0], defaults] and decided.codecs == {}
        assert decided.reasons[-1].endswith("the defaults are restored")


@pytest.mark.parametrize("verify", [1, 2, 3, 4])
@pytest.mark.parametrize("drift", [-4e-4, 4e-4])
def test_a_warm_up_drift_favours_neither_trial(monkeypatch: pytest.MonkeyPatch, verify: int,
                                               drift: float) -> None:
    """Iterations getting faster (or slower) by 2% of one each iteration, as they do while a run
    warms up: equally fast trials are timed alike, and a runner-up 1% slower than the choice is
    not kept. Timed one after the other, the runner-up drew 4-10% of drift and was kept when
    the iterations were getting faster."""
    from scaleout.pytorch import tune_check
    from scaleout.scheduler import SchedulerConfig

    choice, defaults = _choice(runner_up=True), (SchedulerConfig(), None)
    plans = ((choice.scheduler, "choice codecs"), (choice.runner_up.scheduler, "runner codecs"))
    for per_iteration in ([0.02, 0.02], [0.02, 0.0202]):
        check = tune_check.ChoiceCheck(default_s=0.5, fallback=defaults, verify=verify,
                                       plans=plans)
        decided = _timed(monkeypatch, check, _check_model([]), choice, per_iteration, drift)
        said = decided.reasons[-1]
        times = [float(t) for t in re.findall(r"the (?:choice|runner-up) ([0-9.]+)ms", said)]
        assert len(times) == 2 and said.endswith("the choice is kept"), said
        if per_iteration[0] == per_iteration[1]:
            assert times[0] == pytest.approx(times[1], rel=1e-9), said


@pytest.mark.parametrize("runner_s, kept", [(0.0195, "choice"), (0.0185, "runner-up")])
def test_a_runner_up_must_lead_by_more_than_the_choices_own_spread(
        monkeypatch: pytest.MonkeyPatch, runner_s: float, kept: str) -> None:
    """The choice's two windows read 19.5 and 20.5 ms: a runner-up 2.5% faster than their mean
    is within that 5% and the model's choice stands; one 7.5% faster is kept."""
    from scaleout.pytorch import tune_check
    from scaleout.scheduler import SchedulerConfig

    choice, defaults = _choice(runner_up=True), (SchedulerConfig(), None)
    plans = ((choice.scheduler, "choice codecs"), (choice.runner_up.scheduler, "runner codecs"))
    check = tune_check.ChoiceCheck(default_s=0.5, fallback=defaults, verify=2, plans=plans)
    decided = _timed(monkeypatch, check, _check_model([]), choice, [0.02, runner_s],
                     per_window=[0.0195, runner_s, 0.0205])
    said = decided.reasons[-1]
    assert said.endswith(f"the {kept} is kept"), said
    if kept == "choice":
        assert "(its 2.5% lead is within the choice's own spread, 5.0%)" in said, said


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])  # NCCL alone; gloo with CUDA tensors (one GPU)
def test_tuning_on_a_gpu(world: int) -> None:
    link = LinkModel(ranks=world, latency_s=1e-3, seconds_per_byte=1e-6)
    results = run_ranks(world, body, TuneConfig(allow_lossy=True, link=link), "sgd", True, 6,
                        True, timeout=180)
    assert len({r["key"] for r in results}) == 1
    if world == 2:
        assert results[0]["codecs"], results[0]["summary"]
        for a, b in zip(results[0]["params"], results[1]["params"]):
            assert torch.equal(a, b)
    else:
        assert "one rank" in results[0]["summary"]


def body_reset_on_rank_0() -> tuple[int | None, str]:
    env = scaleout.init(timeout=15)
    model = DataParallel(_net(), env.create_distribution(), tune=True)
    opt = DistributedOptimizer(torch.optim.SGD(model.module.parameters(), lr=0.01), model)
    tuned_at = None
    for step in range(6):
        model(torch.randn(8, 128)).sum().backward()
        if tuned_at is None and model.tuning is not None:
            tuned_at = step + 1
        opt.step()
        opt.zero_grad()
        if step == 1 and env.rank == 0:
            model.statistics.reset()  # rank 0 alone starts its figures afresh
    model.synchronize()
    key = repr(model.tuning.key()) if model.tuning is not None else ""
    model.close()
    env.finalize()
    return tuned_at, key


def test_a_statistics_reset_on_one_rank_does_not_move_its_tuning() -> None:
    """The tuner's clock is its own: a rank whose figures were reset during the measured
    iterations tunes at the same forward as the others (it used to tune later: hang)."""
    (at0, key0), (at1, key1) = run_ranks(2, body_reset_on_rank_0, timeout=60)
    assert at0 == at1 == 4 and key0 == key1


def body_uneven_forwards(kind: str) -> list[torch.Tensor]:
    """Rank 0 alone runs an evaluation forward, or accumulates two micro-batches per step
    where rank 1 runs one: ranks whose forwards differ in number, steps alike."""
    env = scaleout.init(timeout=20)
    net = _net()
    model = DataParallel(net, env.create_distribution(), tune=TuneConfig(link=SLOW, measure=1))
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01), model)
    generator = torch.Generator().manual_seed(1 + env.rank)
    for step in range(7):
        if kind == "micro" and env.rank == 0:
            with model.no_sync():
                model(torch.randn(8, 128, generator=generator)).square().mean().backward()
        model(torch.randn(8, 128, generator=generator)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if kind == "eval" and env.rank == 0 and step == 1:
            model.eval()
            with torch.no_grad():
                model(torch.randn(2, 128))
            model.train()
    model.synchronize()
    params = [p.detach().clone() for p in net.parameters()]
    model.close()
    env.finalize()
    return params


@pytest.mark.parametrize("kind", ["eval", "micro"])
def test_ranks_with_other_numbers_of_forwards_tune_at_the_same_step(kind: str) -> None:
    # every forward advanced the tuner: the ranks tuned at different steps and their
    # collectives met others (CommunicationTimeout); only a forward whose backward exchanges
    # counts now
    first, second = run_ranks(2, body_uneven_forwards, kind, timeout=60)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_lossy_tuning_without_a_known_optimizer_stays_exact() -> None:
    tune = TuneConfig(allow_lossy=True, link=SLOW)
    results = run_ranks(2, body, tune, "sgd", False, timeout=120)
    assert results[0]["codecs"] == {}
    assert "no optimizer is known" in results[0]["summary"]


def bad_arguments() -> None:
    env = scaleout.init(timeout=30)
    dist = env.create_distribution()
    for tune, error in (("bogus", ValueError), (3, TypeError)):
        with pytest.raises(error):
            DataParallel(_net(), dist, tune=tune)
    with pytest.raises(ValueError, match="compression"):
        DataParallel(_net(), dist, tune=True, compression="cast:bf16")
    model = DataParallel(_net(), dist, tune=True)
    with pytest.raises(RuntimeError, match="tune="):
        model.register_comm_hook(None, lambda state, bucket: None)
    with pytest.raises(RuntimeError, match="measured iteration"):
        model.tune_now()
    model.close()
    with pytest.raises(RuntimeError, match="tune="):
        DataParallel(_net(), dist).tune_now()
    # a link for 2 ranks on 1: refused when the model is built (it was at the 4th forward)
    with pytest.raises(ValueError, match="TuneConfig.link is for 2 ranks; the data group has 1"):
        DataParallel(_net(), dist, tune=TuneConfig(link=SLOW, measure=1))
    env.finalize()


def test_bad_arguments_raise() -> None:
    run_ranks(1, bad_arguments, timeout=60)
    for kwargs, error in ((dict(codecs=("none",)), ValueError), (dict(measure=0), ValueError),
                          (dict(codecs="cast:bf16"), TypeError), (dict(link="1gbit"), TypeError),
                          (dict(min_gain_lossy=1.0), ValueError), (dict(allow_lossy=1), TypeError),
                          (dict(runner_up_within=-0.1), ValueError),
                          (dict(runner_up_within="10%"), ValueError)):
        with pytest.raises(error):
            TuneConfig(**kwargs)
    # skip=0 was taken and tuned as 1 (the first forward builds the plan)
    with pytest.raises(ValueError, match="skip must be an int >= 1, got 0"):
        TuneConfig(skip=0)
    with pytest.raises(TypeError, match="codecs must be a tuple of codec specs, got None"):
        TuneConfig(codecs=None)
    # a generator was used up by the check: no codecs left to choose from
    assert TuneConfig(codecs=(c for c in ("cast:bf16", "sign"))).codecs == ("cast:bf16", "sign")
    assert as_tune_config(False) is None and as_tune_config(True).allow_lossy is False
    assert as_tune_config("lossy").allow_lossy is True


def test_bench_train_runs_a_self_tuning_variant_only_with_enough_warm_up() -> None:
    from scaleout.bench.train import TrainBenchConfig

    config = TrainBenchConfig(workload="digits-mlp", compression=("none", "auto", "auto-exact"),
                              warmup=10, testbed=False)
    assert config.configurations[1:4] == ("scaleout", "scaleout+auto", "scaleout+auto-exact")
    with pytest.raises(ValueError, match="warm-up"):
        TrainBenchConfig(workload="digits-mlp", compression=("auto",), warmup=9, testbed=False)


def test_a_longer_warm_up_lengthens_the_tuners_windows_and_fits_in_it() -> None:
    from scaleout.bench.train_config import AUTO_WARMUP, AUTO_WARMUP_DEFAULT, tune_windows

    from scaleout.pytorch.tune_check import windows

    assert AUTO_WARMUP == 10
    assert tune_windows(AUTO_WARMUP) == (1, 2)  # the least: one measured, two timed a trial
    assert tune_windows(AUTO_WARMUP_DEFAULT) == (3, 4)
    verifies = []
    for warmup in range(AUTO_WARMUP, 40):
        measure, verify = tune_windows(warmup)
        # build, measure, then three windows (choice, runner-up, choice) of one to settle and
        # their timed iterations, then the kept one
        order = windows(verify, 2)
        assert [trial for trial, _ in order] == [0, 1, 0], order
        assert order[0][1] + order[2][1] >= verify and order[1][1] == verify
        assert 1 + measure + sum(1 + n for _, n in order) + 1 == warmup and measure >= 1, warmup
        verifies.append(verify)
    assert verifies == sorted(verifies) and verifies[-1] > 2
    assert tune_windows(3) == (1, 2)  # (a direct build below the bench's minimum)


def test_scaleout_tune_prints_the_choice_on_loopback(capsys) -> None:
    from scaleout.cli.main import main

    assert main(["tune", "--workload", "digits-mlp", "--no-testbed", "--warmup", "10",
                 "--iters", "1"]) == 0
    out = capsys.readouterr().out
    assert "chosen:" in out and "codecs: none (exact)" in out and "measured after tuning" in out
    assert main(["tune", "--workload", "digits-mlp", "--no-testbed", "--warmup", "9"]) == 2


def test_a_codec_is_timed_by_its_best_run_not_one_spike(monkeypatch) -> None:
    # the first timed encode + decode hits a 1 s stall (another process took the core): the
    # codec is priced by its usual time, not by the spike
    from types import SimpleNamespace

    from scaleout.pytorch import tune_measure

    clock = iter([0.0, 1.0, 1.0, 1.001, 1.001, 1.002])  # start/stop of the three timed runs
    monkeypatch.setattr(tune_measure, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    param = nn.Parameter(torch.randn(256, 64))
    payload, seconds = tune_measure.measure_codec("cast:bf16", [param], min_numel=1024)
    assert payload == param.numel() * 2
    assert seconds == pytest.approx(1e-3)


def test_the_link_probes_see_the_latency_of_a_shaped_link() -> None:
    # A token-bucket shaper (tc tbf, a cloud's rate limit) lets a message within its burst
    # through at once: 100 Mbit/s, 64 KB of burst, 0.7 ms per message. The line through the
    # probes must keep the latency (a 16 KB probe put it at 0 in 6 of 7 testbed runs).
    from scaleout.pytorch.tune_measure import PROBE_BYTES

    latency, rate, burst = 7e-4, 12.5e6, 64 << 10

    def shaped(nbytes: int) -> float:
        return latency + max(nbytes - burst, 0) / rate

    link = LinkModel.fit(2, *((m, shaped(m)) for m in PROBE_BYTES))
    assert link.latency_s == pytest.approx(latency, rel=0.15)
    assert link.bandwidth == pytest.approx(rate, rel=0.05)
