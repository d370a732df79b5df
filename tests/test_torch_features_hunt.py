"""DataParallel with ordinary PyTorch features (stop 52's hunt), against a float64 single
process on the whole batch, in overlap mode, sync mode and with the sharded update.

Found wrong (now fixed or refused with an error that says what to do):

- ``model.double()`` (``.half()``, ``.to(dtype)``) after the first step failed in the next
  backward ("start_gradient_comm on b.bias: expected dtype torch.float32, got
  torch.float64"), and with the sharded update, after the DistributedOptimizer was built,
  in ``step()`` with autograd's "assign a gradient with dtype 'double' to a tensor with
  grad_dtype 'Float'": now the conversion itself is refused. Before the first forward (and
  before the sharded update's optimizer) it trains as torch does.
- ``copy.deepcopy(model)`` (``AveragedModel(model)``) and pickling failed with "cannot pickle
  'torch._C._distributed_c10d.TCPStore' object": now named, with the bare module to copy.
- A checkpoint of the same model under DDP (``ddp.state_dict()``: keys ``module.…``) did not
  load: "Missing key(s) in state_dict: "_extra_state"".

Found right, and kept so here: parametrizations (orthogonal, a user's, weight_norm,
spectral_norm with its power-iteration buffers; the older hook-based weight_norm and
spectral_norm, which read the weights in a forward pre-hook), channels_last convolutions,
a non-contiguous parameter, a tensor hook scaling a parameter's gradient over a varying
number of ``no_sync()`` micro-batches, full backward hooks, forward pre-hooks that change the
input, dict and dataclass outputs with the loss on part of them, per-group options (a frozen
group with lr 0, Nesterov, AMSGrad), layers frozen and thawed again mid-training,
a float32 layer beside float64 ones, ``torch.func.functional_call`` on the wrapper, and an EMA
(``AveragedModel``) of the bare module in sync mode.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations, parametrize
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import scaleout
from harness import run_ranks
from small_models import Conv
from scaleout.pytorch import DataParallel, DistributedOptimizer

PER_RANK, STEPS = 4, 4
#: (mode, distributed_update)
MODES = [("overlap", False), ("sync", False), ("overlap", True), ("sync", True)]


def data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return (torch.randn(PER_RANK, 6, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (PER_RANK,), generator=g))


def images(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = data(step, rank)
    g = torch.Generator().manual_seed(7 + 100 * step + rank)
    x = torch.randn(PER_RANK, 2, 5, 5, generator=g, dtype=torch.float64)
    return x.contiguous(memory_format=torch.channels_last), y


class Three(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.m, self.b = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> Any:
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.m(h.to(self.m.weight.dtype))).to(self.b.weight.dtype)
        return self.b(h)


class Skew(nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        upper = weight.triu(1)
        return upper - upper.T


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    aux: torch.Tensor
    note: str = "non-tensor"


class TwoHeads(Three):
    def __init__(self) -> None:
        super().__init__()
        self.aux = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> Any:
        h = torch.tanh(self.a(x))
        return Out(self.b(h), self.aux(h))  # the loss reads logits only: aux is never used


def _edited(edit: Any) -> Any:
    def make() -> nn.Module:
        net = Three().double()  # (then edited: the hook-based norms' weights in float64)
        edit(net)
        return net
    return make


def _noncontiguous(net: nn.Module) -> None:
    net.a.weight = nn.Parameter(net.a.weight.detach().t().contiguous().t())


def _hooks(net: nn.Module) -> None:
    net.a.weight.register_hook(lambda grad: 3.0 * grad)
    net.b.register_full_backward_hook(lambda _m, grad_in, _out: (2.0 * grad_in[0],))
    net.m.register_forward_pre_hook(lambda _m, inputs: (0.5 * inputs[0],))


def _thaw_schedule(net: nn.Module, step: int) -> None:
    """Fine-tuning: ``b`` frozen at step 1, ``a.weight`` at step 2, ``b`` thawed at step 3."""
    if step == 1:
        net.b.requires_grad_(False)
    if step == 2:
        net.a.weight.requires_grad_(False)
    if step == 3:
        net.b.requires_grad_(True)


def sgd(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)


def three_reference(world: int, ema: bool = False) -> tuple[nn.Module, Any]:
    """``Three`` trained on every rank's batches in one process (float64, SGD), and with
    ``ema``, its exponential moving average (decay 0.5) updated after each step."""
    torch.manual_seed(0)
    ref = Three().double()
    ref_opt = sgd(ref)
    ref_ema = AveragedModel(ref, multi_avg_fn=get_ema_multi_avg_fn(0.5)) if ema else None
    for step in range(STEPS):
        for rank in range(world):
            x, y = data(step, rank)
            (F.cross_entropy(ref(x), y) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if ref_ema is not None:
            ref_ema.update_parameters(ref)
    return ref, ref_ema


def per_group(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        [{"params": [net.b.weight, net.a.bias], "lr": 0.03, "betas": (0.8, 0.9)},
         {"params": list(net.m.parameters()), "lr": 0.0},  # frozen by its learning rate
         {"params": [net.a.weight, net.b.bias], "weight_decay": 0.0, "amsgrad": True}],
        lr=0.01, weight_decay=0.1)


#: name -> (model factory, batches, optimizer, loss of the output, hook before each step)
CASES: dict[str, tuple[Any, Any, Any, Any, Any]] = {
    "orthogonal": (_edited(lambda n: parametrizations.orthogonal(n.a)), data, sgd, None, None),
    "user parametrization": (_edited(lambda n: parametrize.register_parametrization(
        n.m, "weight", Skew())), data, sgd, None, None),
    "weight_norm": (_edited(lambda n: (parametrizations.weight_norm(n.a),
                                       parametrizations.weight_norm(n.b))), data, sgd, None, None),
    "spectral_norm": (_edited(lambda n: parametrizations.spectral_norm(n.m)), data, sgd, None,
                      None),
    "hook-based norms": (_edited(lambda n: (torch.nn.utils.spectral_norm(n.a),
                                            torch.nn.utils.weight_norm(n.b, dim=None))),
                         data, sgd, None, None),
    "channels_last": (lambda: Conv().to(memory_format=torch.channels_last), images, sgd, None,
                      None),
    "non-contiguous parameter": (_edited(_noncontiguous), data, sgd, None, None),
    "hooks": (_edited(_hooks), data, sgd, None, None),
    "dataclass output": (TwoHeads, data, sgd, lambda out: out.logits, None),
    "per-group options": (Three, data, per_group, None, None),
    "frozen and thawed": (Three, data, sgd, None, _thaw_schedule),
}


def train(case: str, world: int, ddp: Any = None) -> nn.Module:
    """``STEPS`` steps of ``CASES[case]``: on this rank's batch through a DataParallel when
    ``ddp`` is (env, mode, sharded), else every rank's in one process (the buffers as
    DataParallel's: each rank's forward from the same values, the results averaged)."""
    make, batches, optimizer, pick, before = CASES[case]
    torch.manual_seed(0)
    net = make().double()
    runner, opt = net, optimizer(net)
    if ddp is not None:
        env, mode, sharded = ddp
        runner = DataParallel(net, env.create_distribution(), distributed_update=sharded)
        opt = DistributedOptimizer(opt, runner, mode=mode)
    for step in range(STEPS):
        if before is not None:
            before(net, step)
        start = {name: b.clone() for name, b in net.named_buffers()}
        after = []
        for rank in range(world) if ddp is None else [ddp[0].rank]:
            with torch.no_grad():
                for name, buffer in net.named_buffers():
                    buffer.copy_(start[name])
            x, y = batches(step, rank)
            out = runner(x)
            loss = F.cross_entropy(out if pick is None else pick(out), y)
            (loss if ddp is not None else loss / world).backward()
            after.append({name: b.clone() for name, b in net.named_buffers()})
        if ddp is None:
            with torch.no_grad():
                for name, buffer in net.named_buffers():
                    values = torch.stack([a[name] for a in after])
                    buffer.copy_(values.mean(0) if buffer.is_floating_point() else values[-1])
        opt.step()
        opt.zero_grad()
    if ddp is not None:
        runner.synchronize()
        runner.close()
    return net


def farthest(net: nn.Module, ref: nn.Module) -> float:
    """The largest difference between two models' floating state (parameters and buffers)."""
    mine, theirs = net.state_dict(), ref.state_dict()
    return max((mine[k].double() - theirs[k].double()).abs().max().item()
               for k in theirs if theirs[k].is_floating_point())


def body_features(modes: list[tuple[str, bool]]) -> dict[str, float]:
    env, worst = scaleout.init(timeout=60), {}
    references = {case: train(case, env.world_size) for case in CASES}
    for mode, sharded in modes:
        for case in CASES:
            net = train(case, env.world_size, (env, mode, sharded))
            worst[f"{case}, {mode}{', sharded' if sharded else ''}"] = \
                farthest(net, references[case])
    env.finalize()
    return worst


@pytest.mark.filterwarnings("ignore::FutureWarning")  # (the hook-based weight_norm)
@pytest.mark.parametrize("world", [2, 3])
def test_torch_features_match_the_single_process_reference(world: int) -> None:
    for worst in run_ranks(world, body_features, MODES, timeout=120):
        assert max(worst.values()) < 1e-12, worst


def body_conversions(mode: str, sharded: bool) -> list[str]:
    """A conversion before the first forward (trained, checked against the reference), then
    ``.double()``, ``.to(float32)`` and ``.half()`` after it; the sharded update's optimizer
    made before a conversion; ``.to(memory_format=...)`` after the first forward (passes)."""
    env, outcome = scaleout.init(timeout=60), []
    torch.manual_seed(0)
    net = Three()
    model = DataParallel(net, env.create_distribution(), distributed_update=sharded)
    model.double()  # before the first forward: the buckets are built as it leaves them
    opt = DistributedOptimizer(sgd(net), model, mode=mode)
    for step in range(STEPS):
        x, y = data(step, env.rank)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    model.synchronize()
    ref, _ = three_reference(env.world_size)
    outcome.append(f"{farthest(net, ref):.3g}")
    for convert in (lambda: model.double(), lambda: model.to(torch.float32),
                    lambda: model.half(), lambda: model.to(memory_format=torch.channels_last)):
        try:
            convert()
            outcome.append("ok")
        except RuntimeError as err:
            outcome.append(str(err))
    assert net.a.weight.dtype == torch.float64  # (refused before it changed anything)
    model.close()
    other = Three()
    model = DataParallel(other, env.create_distribution(), distributed_update=sharded)
    opt = DistributedOptimizer(sgd(other), model, mode=mode)
    try:
        model.double()
        outcome.append("ok")
    except RuntimeError as err:
        outcome.append(str(err))
    model.close()
    env.finalize()
    return outcome


@pytest.mark.parametrize("mode, sharded", MODES)
def test_a_conversion_after_the_buckets_exist_is_refused(mode: str, sharded: bool) -> None:
    for outcome in run_ranks(2, body_conversions, mode, sharded, timeout=60):
        trained, double, to32, half, layout, after_optimizer = outcome
        assert float(trained) < 1e-12, outcome
        assert double == "ok" and layout == "ok", outcome  # nothing trained changes
        for refused in (to32, half):
            assert "after the first forward built the gradient buckets" in refused, outcome
            assert "wrap the converted module (model.module)" in refused, outcome
        assert "parameter a.weight torch.float16" in half, outcome
        if sharded:
            assert "the sharded update's DistributedOptimizer copied" in after_optimizer, outcome
        else:
            assert after_optimizer == "ok", outcome


def body_copies() -> list[str]:
    env, outcome = scaleout.init(timeout=60), []
    torch.manual_seed(0)
    net = Three().double()
    model = DataParallel(net, env.create_distribution())
    opt = DistributedOptimizer(sgd(net), model, mode="sync")
    ema = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.5))  # of the bare module
    for step in range(STEPS):
        x, y = data(step, env.rank)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        ema.update_parameters(net)
    for copier in (copy.deepcopy, pickle.dumps, lambda m: AveragedModel(m)):
        try:
            copier(model)
            outcome.append("ok")
        except TypeError as err:
            outcome.append(str(err))
    _, ref_ema = three_reference(env.world_size, ema=True)
    outcome.append(f"{farthest(ema.module, ref_ema.module):.3g}")
    model.close()
    env.finalize()
    return outcome


def test_a_copy_of_the_wrapper_is_refused_and_one_of_the_module_averages() -> None:
    for *refused, ema in run_ranks(2, body_copies, timeout=60):
        assert float(ema) < 1e-12, ema
        for message in refused:
            assert "a DataParallel cannot be copied or pickled" in message, refused
            assert "AveragedModel(model.module)" in message, refused


def body_ddp_checkpoint(mode: str, sharded: bool) -> float:
    """Weights saved from DDP (``module.``-prefixed, no ``_extra_state``) loaded mid-training
    into the DataParallel model with ``strict=True``, against the same load in one process."""
    env = scaleout.init(timeout=60)
    torch.manual_seed(5)
    saved = {f"module.{k}": v for k, v in Three().double().state_dict().items()}
    nets = []
    for ddp in (True, False):
        torch.manual_seed(0)
        net = Three().double()
        runner: Any = net
        opt = sgd(net)
        if ddp:
            runner = DataParallel(net, env.create_distribution(), distributed_update=sharded)
            opt = DistributedOptimizer(opt, runner, mode=mode)
        for step in range(STEPS):
            if step == 2:
                if ddp:
                    runner.load_state_dict(saved)
                else:
                    net.load_state_dict({k[len("module."):]: v for k, v in saved.items()})
            for rank in [env.rank] if ddp else range(env.world_size):
                x, y = data(step, rank)
                loss = F.cross_entropy(runner(x), y)
                (loss if ddp else loss / env.world_size).backward()
            opt.step()
            opt.zero_grad()
        if ddp:
            runner.synchronize()
            runner.close()
        nets.append(net)
    env.finalize()
    return farthest(*nets)


@pytest.mark.parametrize("mode, sharded", [("overlap", False), ("sync", True)])
def test_a_ddp_checkpoint_loads_into_the_wrapper(mode: str, sharded: bool) -> None:
    assert max(run_ranks(2, body_ddp_checkpoint, mode, sharded, timeout=60)) < 1e-12
