"""Checkpoints that go wrong: a save cut short before its commit, a rank's file missing or
corrupt, state that does not fit the model or the optimizer, ``extra`` that cannot be loaded,
a save called on rank 0 only, another optimizer's state left out; and the sharded update
following a scheduler attached to the wrapped optimizer."""

from __future__ import annotations

import os
import pathlib
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import scaleout
from harness import others_done, run_ranks
from scaleout import checkpoint


def make(seed: int = 0, hidden: int = 8, opt: str = "sgdm", compression: Any = None,
         shard: bool = False, groups: int = 1, layer: int | None = None
         ) -> tuple[nn.Module, Any, Any]:
    """(net, DataParallel, DistributedOptimizer); ``layer``: the optimizer holds that layer's
    parameters only."""
    from scaleout.pytorch import DataParallel, DistributedOptimizer

    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(6, hidden), nn.Tanh(), nn.Linear(hidden, 3))
    model = DataParallel(net, compression=compression, distributed_update=shard)
    params: Any = list(net.parameters()) if groups == 1 else [
        {"params": list(net[0].parameters())}, {"params": list(net[2].parameters())}]
    if layer is not None:
        params = list(net[layer].parameters())
    inner = torch.optim.Adam(params, lr=0.01) if opt == "adam" else \
        torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return net, model, DistributedOptimizer(inner, model)


def train(model: Any, opt: Any, steps: int = 2) -> None:
    for _ in range(steps):
        model(torch.randn(4, 6)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    model.synchronize()


def weights(net: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()]).clone()


def body_stale_version(folder: str) -> list[str]:
    """A version directory left by a save killed before its commit (files of 3 ranks) is
    emptied before this save writes; a save whose directory is not complete is not committed
    and the previous version stays loadable."""
    env = scaleout.init(timeout=20)
    path = f"{folder}/ckpt"
    net, model, opt = make()
    train(model, opt)
    checkpoint.save(path, model, opt, step=1)
    if env.rank == 0:
        Path(f"{path}.versions/1").mkdir()
        for r in (0, 2):
            (Path(f"{path}.versions/1") / f"rank-{r}-of-3.pt").write_bytes(b"torn")
    torch.distributed.barrier()
    checkpoint.save(path, model, opt, step=2)
    names = sorted(os.listdir(path))
    assert checkpoint.load(path, model, opt)[0] == 2
    original = checkpoint.write_atomic
    if env.rank == 1:  # this rank's file lands under another world size's name
        checkpoint.write_atomic = lambda target, payload: original(  # type: ignore[assignment]
            target.with_name("rank-1-of-3.pt"), payload)
    try:
        with pytest.raises(checkpoint.IncompleteCheckpointError, match="not committed"):
            checkpoint.save(path, model, opt, step=3)
    finally:
        checkpoint.write_atomic = original  # type: ignore[assignment]
    assert checkpoint.load(path, model, opt)[0] == 2  # the previous version is kept
    model.close()
    env.finalize()
    return names


def test_a_stale_version_directory_is_emptied_first(tmp_path: Path) -> None:
    for names in run_ranks(2, body_stale_version, str(tmp_path), timeout=25):
        assert names == ["rank-0-of-2.pt", "rank-1-of-2.pt"], names


def body_incomplete(folder: str) -> list[str]:
    """Rank 1's file missing, then truncated: every rank raises the same error naming it (not
    FileNotFoundError, which means "no checkpoint"), and nothing is restored."""
    env = scaleout.init(timeout=20)
    net, model, opt = make()
    train(model, opt)
    messages = []
    for damage in ("delete", "truncate"):
        path = f"{folder}/{damage}"
        checkpoint.save(path, model, opt, step=2)
        if env.rank == 0:
            file = Path(os.path.realpath(path)) / "rank-1-of-2.pt"
            data = file.read_bytes()
            file.unlink() if damage == "delete" else file.write_bytes(data[: len(data) // 2])
        torch.distributed.barrier()
        net2, model2, opt2 = make(seed=1)
        before = weights(net2)
        with pytest.raises(checkpoint.IncompleteCheckpointError) as caught:
            checkpoint.load(path, model2, opt2)
        assert not isinstance(caught.value, FileNotFoundError)
        assert torch.equal(weights(net2), before)
        messages.append(str(caught.value))
        model2.close()
    model.close()
    env.finalize()
    return messages


def test_a_missing_or_corrupt_file_fails_on_every_rank(tmp_path: Path) -> None:
    missing, corrupt = zip(*run_ranks(2, body_incomplete, str(tmp_path), timeout=25))
    assert missing[0] == missing[1] and "rank-1-of-2.pt is missing" in missing[0], missing
    assert corrupt[0] == corrupt[1] and "rank-1-of-2.pt cannot be read" in corrupt[0], corrupt


def body_other_compression(folder: str, built: bool) -> list[str]:
    """A top-k checkpoint loaded into an uncompressed model (before its first forward, or
    after): the codec state is reset with a warning, and training goes on."""
    env = scaleout.init(timeout=20)
    from scaleout.compression import CompressionConfig

    net, model, opt = make(compression=CompressionConfig(codec="topk:ratio=0.5", min_numel=0))
    train(model, opt)
    assert model.state_dict()["_extra_state"]["compression"]  # (a bucket is compressed)
    checkpoint.save(f"{folder}/ckpt", model, opt, step=2)
    net2, model2, opt2 = make(seed=1)
    if built:
        train(model2, opt2, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint.load(f"{folder}/ckpt", model2, opt2)
        train(model2, opt2)
    model.close()
    model2.close()
    env.finalize()
    return [str(w.message) for w in caught if "codec state" in str(w.message)]


@pytest.mark.parametrize("built", [False, True])
def test_compression_state_for_other_buckets_is_reset(tmp_path: Path, built: bool) -> None:
    for said in run_ranks(2, body_other_compression, str(tmp_path), built, timeout=25):
        assert len(said) == 1 and "does not compress them" in said[0], said


def test_extra_that_load_would_refuse_is_refused_at_save(tmp_path: Path) -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cases = {"loss": (np.float64(0.25), "numpy.float64"),
             "data": (pathlib.Path("/data"), "PosixPath"),
             "nested": ({"ok": 1, "bad": [1, np.zeros(2)]}, r"extra\['nested'\]\['bad'\]\[1\]")}
    for key, (value, named) in cases.items():
        with pytest.raises(ValueError, match=named) as caught:
            checkpoint.save(tmp_path / "ckpt", model, opt, extra={key: value})
        assert f"extra[{key!r}]" in str(caught.value)
    assert list(tmp_path.iterdir()) == []  # nothing written
    checkpoint.save(tmp_path / "ckpt", model, opt, extra={"loss": 0.25, "path": "/data"})


def body_scheduler() -> list[float]:
    """lr scheduled to 0 after the first step, through the wrapped optimizer or the wrapper,
    with the sharded update: the weights stop moving."""
    env = scaleout.init(timeout=20)
    moved = []
    for attach_to in ("wrapped", "wrapper"):
        net, model, opt = make(shard=True)
        target = opt._user_optimizer if attach_to == "wrapped" else opt
        sched = torch.optim.lr_scheduler.LambdaLR(target, lambda epoch: 1.0 if epoch == 0 else 0.0)
        train(model, opt, 1)
        sched.step()
        before = weights(net)
        train(model, opt, 2)
        moved.append((weights(net) - before).abs().max().item())
        moved.append(opt.param_groups[0]["lr"] + opt._user_optimizer.param_groups[0]["lr"])
        model.close()
    env.finalize()
    return moved


def test_a_scheduler_on_the_wrapped_optimizer_drives_the_sharded_update() -> None:
    for moved in run_ranks(2, body_scheduler, timeout=25):
        assert moved == [0.0] * 4, moved


def body_mismatch(folder: str) -> list[str]:
    """Loads refused before anything is modified: another optimizer class (either way),
    another model, other groups, an optimizer over other parameters (it was accepted, and
    the next step failed on a shape), no optimizer state."""
    env = scaleout.init(timeout=20)
    messages = []
    cases = [({"opt": "sgdm"}, {"opt": "adam"}), ({"opt": "adam"}, {"opt": "sgdm"}),
             ({}, {"hidden": 10}), ({"groups": 2}, {}), ({"shard": True, "opt": "adam"},
                                                         {"shard": True, "opt": "adam",
                                                          "hidden": 10}),
             ({"layer": 2}, {"layer": 0})]
    for index, (saved, loading) in enumerate([*cases, ({}, {})]):
        net, model, opt = make(**saved)
        train(model, opt)
        no_state = index == len(cases)
        with warnings.catch_warnings():  # (the parameters that the optimizer does not hold)
            warnings.simplefilter("ignore")
            checkpoint.save(f"{folder}/{index}", model, None if no_state else opt, step=2)
        net2, model2, opt2 = make(seed=1, **loading)
        train(model2, opt2, 1)
        before, state = weights(net2), repr(opt2.state_dict())
        with pytest.raises(ValueError) as caught:
            checkpoint.load(f"{folder}/{index}", model2, opt2)
        assert torch.equal(weights(net2), before) and repr(opt2.state_dict()) == state
        messages.append(str(caught.value))
        model.close()
        model2.close()
    env.finalize()
    return messages


def test_a_load_that_does_not_fit_changes_nothing(tmp_path: Path) -> None:
    messages = run_ranks(2, body_mismatch, str(tmp_path), timeout=28)[0]
    sgd, adam = "torch.optim.sgd.SGD", "torch.optim.adam.Adam"
    assert sgd in messages[0] and adam in messages[0], messages[0]
    assert sgd in messages[1] and adam in messages[1], messages[1]
    for message in messages[2:3] + messages[4:5]:
        assert "does not fit this model" in message and "(10, 6)" in message, message
    assert "parameter groups" in messages[3], messages[3]
    assert "the optimizer's parameter 0 has shape (3, 8) there and (8, 6) here" in messages[5]
    assert "holds no optimizer state" in messages[6], messages[6]


def body_refused_extra_state(path: str) -> tuple[str, list[str]]:
    """Sharded tables updated in backward, loaded where they are not: refused (as before),
    but before: only after the dense layers registered before them had been loaded."""
    import torch.nn.functional as F

    from dlrm_oracle import WORKLOAD, global_batch, shard
    from scaleout import GroupType
    from scaleout.pytorch import (DataParallel, DistributedOptimizer, EmbeddingCollection,
                                  FusedRowWiseAdagrad)

    env = scaleout.init(timeout=30)
    dist = env.create_distribution()

    def build(seed: int, rule: bool) -> tuple[nn.Module, Any, Any]:
        net = WORKLOAD.build_model(seed).double()
        net.embeddings = EmbeddingCollection.from_embeddings(list(net.embeddings), dist)
        if rule:
            net.embeddings.update_in_backward(FusedRowWiseAdagrad(lr=0.05))
        model = DataParallel(net, dist)
        dense = [p for n, p in net.named_parameters() if not n.startswith("embeddings.")]
        return net, model, DistributedOptimizer(torch.optim.SGD(dense, lr=0.1), model)

    net, model, opt = build(0, True)
    x, y = shard(*global_batch(0, 2), dist.rank(GroupType.DATA))
    F.binary_cross_entropy_with_logits(model(x), y).backward()
    opt.step()
    checkpoint.save(path, model, opt, step=1)
    other, model2, opt2 = build(1, False)
    before = {k: v.clone() for k, v in other.state_dict().items() if torch.is_tensor(v)}
    with pytest.raises(ValueError) as caught:
        checkpoint.load(path, model2, opt2)
    changed = [k for k, v in other.state_dict().items()
               if torch.is_tensor(v) and not torch.equal(v, before[k])]
    model.close()
    model2.close()
    env.finalize()
    return str(caught.value), changed


def test_a_refused_extra_state_changes_nothing(tmp_path: Path) -> None:
    for message, changed in run_ranks(2, body_refused_extra_state, str(tmp_path / "c"),
                                      timeout=60):
        assert "does not fit this model (module.embeddings._extra_state: " in message, message
        assert "updated in backward by FusedRowWiseAdagrad when saved, here by none" in message
        assert changed == [], changed


def body_bare_module(path: str) -> float:
    """``load(path, net, opt)`` with ``net`` the module a DataParallel wraps: the update the
    last ``step()`` requested (overlap mode) was applied on top of the weights just loaded
    (1.7e-2 off); the DataParallel that ``opt`` steps is synchronized first now."""
    env = scaleout.init(timeout=20)
    net, model, opt = make()
    for step in range(4):
        if step == 2:
            checkpoint.save(path, net, opt, step=2)
            saved = weights(net)
        model(torch.randn(4, 6)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    checkpoint.load(path, net, opt)
    worst = (weights(net) - saved).abs().max().item()
    model.close()
    env.finalize()
    return worst


def test_a_load_into_the_wrapped_module_restores_the_saved_weights(tmp_path: Path) -> None:
    assert run_ranks(2, body_bare_module, str(tmp_path / "c"), timeout=30) == [0.0, 0.0]


def test_a_symlink_that_is_not_a_checkpoint_is_named(tmp_path: Path) -> None:
    # save said "invalid literal for int() with base 10: 'mine'", load "world sizes []"
    (tmp_path / "mine").mkdir()
    (tmp_path / "latest").symlink_to("mine")
    for call in (checkpoint.save, checkpoint.load):
        with pytest.raises(ValueError, match=r"latest exists and is not a scaleout checkpoint "
                                             r"\(a symbolic link to a version directory "
                                             r"latest.versions/<n>\)"):
            call(tmp_path / "latest", nn.Linear(2, 2))


def body_rank0_only(folder: str) -> str:
    env = scaleout.init(timeout=3)
    net, model, opt = make()
    train(model, opt)
    if env.rank == 1:  # in a DDP habit, only rank 0 saves
        others_done()
        return ""
    with pytest.raises(RuntimeError) as caught:
        checkpoint.save(f"{folder}/ckpt", model, opt, step=2)
    return str(caught.value)


def test_a_save_on_rank_0_alone_says_every_rank_must_call_it(tmp_path: Path) -> None:
    start = time.monotonic()
    message = run_ranks(2, body_rank0_only, str(tmp_path), timeout=20)[0]
    assert "every rank of the job must call checkpoint.save" in message, message
    assert time.monotonic() - start < 15


def body_untracked(folder: str) -> list[list[str]]:
    """A second optimizer steps the head: a save without its state warns, naming it; with its
    state in ``extra`` it does not."""
    from scaleout.pytorch import DataParallel, DistributedOptimizer

    env = scaleout.init(timeout=20)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model = DataParallel(net)
    opt = DistributedOptimizer(torch.optim.SGD(net[0].parameters(), lr=0.1), model)
    head = torch.optim.Adagrad(net[2].parameters(), lr=0.1)
    said = []
    for extra in (None, {"head": head.state_dict()}):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            checkpoint.save(f"{folder}/ckpt", model, opt, extra=extra)
        said.append([str(w.message) for w in caught if "not held" in str(w.message)])
    model.close()
    env.finalize()
    return said


def test_parameters_outside_the_optimizer_are_named_at_save(tmp_path: Path) -> None:
    for without, with_extra in run_ranks(2, body_untracked, str(tmp_path), timeout=25):
        assert len(without) == 1 and "module.2.weight" in without[0], without
        assert "extra" in without[0] and with_extra == [], with_extra
