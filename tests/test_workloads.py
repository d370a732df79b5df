"""Tests of the reference workloads (scaleout.workloads)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from torch import nn

from scaleout.workloads import (
    DLRMConfig,
    DLRMInputs,
    DLRMWorkload,
    DigitsWorkload,
    LayerSize,
    ResNetWorkload,
    TransformerConfig,
    TransformerWorkload,
    batch_to,
    evaluate_accuracy,
    get_workload,
    layer_sizes,
    load_digits_data,
    make_generator,
    shard_bounds,
    total_grad_bytes,
    workload_names,
    zipf_cdf,
)

NAMES = ("resnet18", "resnet50", "transformer", "dlrm", "dlrm-large", "digits-mlp", "digits-cnn")


def _n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _concat(parts: list) -> object:
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts)
    return type(parts[0])(*(torch.cat(column) for column in zip(*parts)))


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and all(_equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Small ops on a shared 2-core machine run faster (and steadier) on one thread."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def workloads() -> dict:
    return {name: get_workload(name) for name in NAMES}


# ---------------------------------------------------------------- registry


def test_registry_names_and_metadata(workloads: dict) -> None:
    assert workload_names() == NAMES
    for name, wl in workloads.items():
        assert wl.name == name
        assert isinstance(wl.description, str) and wl.description
        assert isinstance(wl.default_batch_size, int) and wl.default_batch_size >= 1


def test_registry_rejects_bad_names() -> None:
    with pytest.raises(ValueError, match="resnet18, resnet50, transformer, dlrm, dlrm-large"):
        get_workload("resnet34")
    with pytest.raises(TypeError, match="str"):
        get_workload(18)  # type: ignore[arg-type]


# ---------------------------------------------------------------- models


@pytest.mark.parametrize("name", NAMES)
def test_forward_backward_shapes(workloads: dict, name: str) -> None:
    wl = workloads[name]
    model = wl.build_model(seed=0)
    inputs, targets = wl.make_batch(2, step=0, seed=0)
    outputs = model(inputs)
    expected = {
        "transformer": (2, 128, 4096),
        "dlrm": (2,),
        "dlrm-large": (2,),
    }.get(name, (2, 10))
    assert outputs.shape == expected
    loss = wl.loss_fn(outputs, targets)
    assert loss.dim() == 0 and math.isfinite(loss.item())
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize(
    ("name", "expected"), [("resnet18", 11_173_962), ("resnet50", 23_520_842)]
)
def test_resnet_parameter_counts(workloads: dict, name: str, expected: int) -> None:
    model = workloads[name].build_model(seed=0)
    assert _n_params(model) == expected
    assert total_grad_bytes(model) == 4 * expected


def test_transformer_head_is_tied(workloads: dict) -> None:
    model = workloads["transformer"].build_model(seed=0)
    config = TransformerConfig()
    assert _n_params(model) == sum(size.param_count for size in layer_sizes(model))
    # a separate head would add vocab_size x d_model parameters
    d, layers = config.d_model, config.n_layers
    per_block = 12 * d * d + 13 * d
    expected = (config.vocab_size + config.seq_len) * d + layers * per_block + 2 * d
    assert _n_params(model) == expected


@pytest.mark.parametrize("name", ["resnet18", "transformer", "dlrm", "digits-mlp", "digits-cnn"])
def test_build_model_is_deterministic_and_leaves_global_rng(workloads: dict, name: str) -> None:
    wl = workloads[name]
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, b, c = wl.build_model(seed=7), wl.build_model(seed=7), wl.build_model(seed=8)
    assert torch.equal(torch.get_rng_state(), before)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa if sa[k].is_floating_point())


@pytest.mark.parametrize("name", NAMES)
def test_make_batch_is_deterministic(workloads: dict, name: str) -> None:
    wl = workloads[name]
    first = wl.make_batch(8, step=3, seed=1)
    assert _equal(first, wl.make_batch(8, step=3, seed=1))
    assert not _equal(first, wl.make_batch(8, step=4, seed=1))
    assert not _equal(first, wl.make_batch(8, step=3, seed=2))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_rank_slices_concatenate_to_global_batch(workloads: dict, name: str, world_size: int) -> None:
    wl = workloads[name]
    batch_size = 7
    global_inputs, global_targets = wl.make_batch(batch_size, step=5, seed=3)
    shards = [wl.make_batch(batch_size, 5, 3, rank=r, world_size=world_size)
              for r in range(world_size)]
    assert [len(t) for _, t in shards] == [
        stop - start for start, stop in (shard_bounds(batch_size, r, world_size)
                                         for r in range(world_size))
    ]
    assert _equal(_concat([inputs for inputs, _ in shards]), global_inputs)
    assert _equal(torch.cat([targets for _, targets in shards]), global_targets)


def test_sharded_gradients_average_to_global_gradient(workloads: dict) -> None:
    """The exactness contract: equal shards, mean losses -> averaged grads = global grad."""
    wl = workloads["digits-mlp"]
    model = wl.build_model(seed=0)

    def grads(rank: int, world_size: int) -> list[torch.Tensor]:
        model.zero_grad()
        inputs, targets = wl.make_batch(12, 0, 0, rank=rank, world_size=world_size)
        wl.loss_fn(model(inputs), targets).backward()
        return [p.grad.clone() for p in model.parameters()]

    reference = grads(0, 1)
    per_rank = [grads(r, 3) for r in range(3)]
    for i, ref in enumerate(reference):
        torch.testing.assert_close(sum(g[i] for g in per_rank) / 3, ref)


# ---------------------------------------------------------------- arguments


def test_make_batch_rejects_bad_arguments(workloads: dict) -> None:
    wl = workloads["digits-mlp"]
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        wl.make_batch(4, 0, 0, rank=2, world_size=2)
    with pytest.raises(ValueError, match="at least one sample"):
        wl.make_batch(2, 0, 0, rank=0, world_size=3)
    with pytest.raises(ValueError, match="step must be >= 0"):
        wl.make_batch(4, -1, 0)
    with pytest.raises(TypeError, match="seed must be an int"):
        wl.make_batch(4, 0, 1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="batch_size must be an int"):
        wl.make_batch(True, 0, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="training set"):
        wl.make_batch(5000, 0, 0)
    with pytest.raises(ValueError, match="seed must be >= 0"):
        wl.build_model(seed=-1)


def test_configs_validate_on_construction() -> None:
    with pytest.raises(ValueError, match="depth must be one of"):
        ResNetWorkload(depth=34)
    with pytest.raises(ValueError, match="divisible by n_heads"):
        TransformerConfig(d_model=30, n_heads=4)
    with pytest.raises(TypeError, match="vocab_size must be an int"):
        TransformerConfig(vocab_size=2.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="TransformerConfig"):
        TransformerWorkload(config={"vocab_size": 10})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one table"):
        DLRMConfig(table_sizes=())
    with pytest.raises(ValueError, match=r"table_sizes\[1\] must be >= 1"):
        DLRMConfig(table_sizes=(10, 0))
    with pytest.raises(TypeError, match="tuple"):
        DLRMConfig(table_sizes=[10, 10])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="zipf_exponent"):
        DLRMConfig(zipf_exponent=0)
    with pytest.raises(ValueError, match="model must be one of"):
        DigitsWorkload(model="rnn")
    with pytest.raises(TypeError):
        ResNetWorkload(18)  # type: ignore[misc]  # keyword-only
    with pytest.raises(TypeError, match="key 0 must be an int"):
        make_generator("seed")  # type: ignore[arg-type]


# ---------------------------------------------------------------- DLRM data


def test_dlrm_ids_follow_a_power_law() -> None:
    wl = DLRMWorkload(config=DLRMConfig(table_sizes=(20000, 50)))
    inputs, targets = wl.make_batch(20000, step=0, seed=0)
    assert isinstance(inputs, DLRMInputs)
    assert inputs.dense.shape == (20000, 13) and inputs.sparse.dtype == torch.int64
    ids = inputs.sparse[:, 0]
    assert 0 <= int(ids.min()) and int(ids.max()) < 20000
    counts = torch.bincount(ids, minlength=20000).double()
    frequency = counts / counts.sum()
    expected = zipf_cdf(20000, 1.05)
    assert abs(frequency[0].item() - expected[0].item()) < 0.01  # ~0.12 of all samples
    assert frequency[0] > frequency[9] > frequency[99:110].mean()
    top_share = counts.sort(descending=True).values[:200].sum() / counts.sum()
    assert top_share > 0.5  # 1% of the ids draw more than half the samples
    assert 0.1 < targets.mean().item() < 0.6 and set(targets.unique().tolist()) <= {0.0, 1.0}


def test_dlrm_is_learnable() -> None:
    config = DLRMConfig(table_sizes=(200, 100, 50, 20), bottom_mlp=(32,), top_mlp=(32,))
    wl = DLRMWorkload(config=config)
    model = wl.build_model(seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(150):
        inputs, targets = wl.make_batch(256, step, seed=0)
        optimizer.zero_grad()
        wl.loss_fn(model(inputs), targets).backward()
        optimizer.step()
    inputs, targets = wl.make_batch(4096, step=0, seed=1)
    with torch.no_grad():
        loss = wl.loss_fn(model(inputs), targets).item()
    rate = targets.mean().item()
    base_entropy = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
    assert loss < base_entropy - 0.05


# ---------------------------------------------------------------- transformer data


def test_transformer_loss_decreases_towards_chain_entropy() -> None:
    config = TransformerConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=1, n_heads=2)
    wl = TransformerWorkload(config=config, default_batch_size=32)
    inputs, targets = wl.make_batch(4, 0, 0)
    assert inputs.shape == targets.shape == (4, 16)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    model = wl.build_model(seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for step in range(150):
        inputs, targets = wl.make_batch(32, step, seed=0)
        optimizer.zero_grad()
        loss = wl.loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] > math.log(64) - 0.2
    assert sum(losses[-10:]) / 10 < wl.entropy() + 0.6


# ---------------------------------------------------------------- digits


def test_digits_split_normalisation_and_shards() -> None:
    data = load_digits_data()
    assert data.train_inputs.shape == (1438, 1, 8, 8) and data.test_inputs.shape == (359, 1, 8, 8)
    assert abs(data.train_inputs.mean().item()) < 1e-4
    assert abs(data.train_inputs.std().item() - 1) < 1e-3
    assert torch.equal(load_digits_data().test_targets, data.test_targets)
    assert not torch.equal(load_digits_data(split_seed=1).test_targets, data.test_targets)
    for world_size in (1, 2, 3):
        shards = [data.shard(r, world_size) for r in range(world_size)]
        assert torch.equal(torch.cat([s.train_inputs for s in shards]), data.train_inputs)
        assert torch.equal(torch.cat([s.train_targets for s in shards]), data.train_targets)
        assert all(s.test_targets is data.test_targets for s in shards)
    with pytest.raises(ValueError, match="test_fraction"):
        load_digits_data(test_fraction=1.0)


@pytest.mark.parametrize("name", ["digits-mlp", "digits-cnn"])
def test_digits_training_reaches_90_percent(workloads: dict, name: str) -> None:
    wl = workloads[name]
    model = wl.build_model(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    steps = 5 * (1438 // 32)  # five epochs
    for step in range(steps):
        inputs, targets = wl.make_batch(32, step, seed=0)
        optimizer.zero_grad()
        wl.loss_fn(model(inputs), targets).backward()
        optimizer.step()
    data = wl.data
    assert evaluate_accuracy(model, data.test_inputs, data.test_targets) > 0.9
    assert model.training


def test_digits_epoch_visits_every_training_sample_once(workloads: dict) -> None:
    wl = workloads["digits-mlp"]
    n = len(wl.data.train_targets)
    seen = torch.cat([wl.make_batch(2, step, 0)[0] for step in range(n // 2)])
    assert torch.equal(seen.flatten(1).sort(0).values, wl.data.train_inputs.flatten(1).sort(0).values)


def test_evaluate_accuracy_rejects_mismatched_lengths() -> None:
    model = nn.Linear(4, 3)
    with pytest.raises(ValueError, match="as many inputs as targets"):
        evaluate_accuracy(model, torch.zeros(5, 4), torch.zeros(4, dtype=torch.int64))


def test_sklearn_is_optional() -> None:
    code = (
        "import sys; sys.modules['sklearn'] = None\n"
        "import scaleout.workloads as w\n"
        "w.get_workload('digits-mlp')\n"
        "try:\n"
        "    w.load_digits_data()\n"
        "except ImportError as err:\n"
        "    print(err)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, timeout=60)
    assert "pip install scikit-learn" in result.stdout


# ---------------------------------------------------------------- layer sizes


def test_layer_sizes_forward_order_and_totals(workloads: dict) -> None:
    wl = workloads["dlrm"]
    model = wl.build_model(seed=0)
    sizes = layer_sizes(model)
    assert all(isinstance(s, LayerSize) for s in sizes)
    assert sum(s.param_count for s in sizes) == _n_params(model)
    assert sum(s.grad_bytes for s in sizes) == 4 * _n_params(model) == total_grad_bytes(model)
    names = [s.name for s in sizes]
    assert names[0] == "bottom_mlp.0" and names[-1].startswith("top_mlp")
    inputs, _ = wl.make_batch(4, 0, 0)
    assert layer_sizes(model, inputs) == sizes

    class Reversed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.late = nn.Linear(3, 2)
            self.early = nn.Linear(4, 3, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.late(self.early(x))

    toy = Reversed()
    assert [s.name for s in layer_sizes(toy)] == ["late", "early"]
    assert layer_sizes(toy, torch.zeros(1, 4)) == [LayerSize("early", 12, 48), LayerSize("late", 8, 32)]
    with pytest.raises(TypeError, match="nn.Module"):
        layer_sizes("resnet18")  # type: ignore[arg-type]


def test_batch_to_keeps_structure(workloads: dict) -> None:
    inputs, targets = workloads["dlrm"].make_batch(3, 0, 0)
    moved = batch_to((inputs, targets), "cpu")
    assert isinstance(moved[0], DLRMInputs) and _equal(moved[0], inputs)


def test_dlrm_interaction_is_every_pair_of_vectors_once() -> None:
    # the pairs' dot products (index_select of the flattened block) are the strict lower
    # triangle, forward and backward to the bit (the plain 2-D indexing as the oracle)
    config = DLRMConfig(table_sizes=(30, 20, 10), bottom_mlp=(8,), top_mlp=(8,))
    model = DLRMWorkload(config=config).build_model(seed=0)
    inputs, _ = DLRMWorkload(config=config).make_batch(16, step=0, seed=0)
    stacked = torch.randn(16, 4, config.embedding_dim, requires_grad=True)
    dots = torch.bmm(stacked, stacked.transpose(1, 2))
    rows, cols = torch.tril_indices(4, 4, offset=-1)
    grad = torch.randn(16, rows.numel())
    want = dots[:, rows, cols]
    got = dots.flatten(1).index_select(1, model._pairs)
    assert torch.equal(got, want)
    assert torch.equal(*(torch.autograd.grad(v, stacked, grad, retain_graph=True)[0]
                         for v in (got, want)))
    assert model(inputs).shape == (16,)
