"""Tensor parallelism on a data x model grid equals single-process training.

Each grid trains the TP MLP and a TP attention block with a vocab-parallel embedding (float64) with DataParallel +
DistributedOptimizer on the data group; the full state dict gathered from the shards must
equal the plain model trained in one process on the concatenated batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import scaleout
from harness import run_ranks
from scaleout import GroupType, SchedulerConfig
from scaleout.pytorch import (
    ColumnParallelLinear,
    DataParallel,
    DistributedOptimizer,
    RowParallelLinear,
    VocabParallelEmbedding,
    full_state_dict,
    load_full_state_dict,
    tensor_parallel,
)
from scaleout.pytorch.tensor_parallel import plan_tensor_parallel
from tp_models import MODELS, FusedAttention, LlamaAttention, LocalHeadsAttention, batch

PER_RANK, STEPS = 3, 4
TINY = SchedulerConfig(bucket_bytes=2048, first_bucket_bytes=512, partition_bytes=512,
                       credit_bytes=2048, urgent_bytes=300)


def make_opt(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.05)


def reference(kind: str, data_parts: int, opt_name: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    net = MODELS[kind]().double()
    opt = make_opt(opt_name, net.parameters())
    for step in range(STEPS):
        x, y = batch(kind, step, PER_RANK * data_parts)
        for d in range(data_parts):
            rows = slice(d * PER_RANK, (d + 1) * PER_RANK)
            (F.mse_loss(net(x[rows]), y[rows]) / data_parts).backward()
        opt.step()
        opt.zero_grad()
    return net.state_dict()


def train(env, dist, kind: str, opt_name: str, mode: str, sharded: bool) -> int:
    torch.manual_seed(0 if env.rank == 0 else 7 + env.rank)  # rank 0's init must win
    net = tensor_parallel(MODELS[kind]().double(), dist, embeddings=kind == "block")
    if dist.size(GroupType.MODEL) > 1 and kind == "block":
        assert type(net.emb).__name__ == "VocabParallelEmbedding"
    model = DataParallel(net, dist, scheduler=TINY, distributed_update=sharded)
    opt = DistributedOptimizer(make_opt(opt_name, net.parameters()), model, mode=mode)
    data_parts, d = dist.size(GroupType.DATA), dist.rank(GroupType.DATA)
    for step in range(STEPS):
        x, y = batch(kind, step, PER_RANK * data_parts)
        rows = slice(d * PER_RANK, (d + 1) * PER_RANK)
        F.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
        opt.zero_grad()
    model.synchronize()
    if kind == "mlp" and dist.size(GroupType.MODEL) > 1:  # Statistics report the exchanges
        for layer in ("2", "4"):  # row: allreduce forward; column: allreduce backward
            figures = model.statistics.operation(f"{layer} (activations)")
            assert figures.bytes > 0 and figures.comm_s > 0, (layer, figures)
    state = full_state_dict(net)
    expected = reference(kind, data_parts, opt_name)
    assert list(state) == list(expected)
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, rtol=1e-9, atol=1e-11,
                                   msg=lambda m, n=name: f"rank {env.rank} {kind} {n}: {m}")
    fresh = tensor_parallel(MODELS[kind]().double(), dist, embeddings=kind == "block")
    load_full_state_dict(fresh, expected)  # a saved plain state dict loads into the shards
    assert all(torch.equal(v, expected[k]) for k, v in full_state_dict(fresh).items())
    model.close()
    return sum(p.numel() for p in net.parameters())


def body_grids(grids: list[tuple[int, int, str, str, bool]]) -> None:
    """Every model of MODELS on each grid in turn, in one job (its start-up costs more than a
    grid's training)."""
    env = scaleout.init(timeout=60)
    for data_parts, model_parts, opt_name, mode, sharded in grids:
        dist = env.create_distribution(data_parts, model_parts)
        for kind in MODELS:
            train(env, dist, kind, opt_name, mode, sharded)
    env.finalize()


GRIDS = [(1, 2, "sgd", "sync", False), (2, 1, "adamw", "overlap", False),
         (2, 2, "adamw", "overlap", False), (2, 2, "sgd", "sync", True),
         (1, 3, "sgd", "overlap", False), (3, 1, "adamw", "sync", False)]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_grid_matches_single_process(world: int) -> None:  # the grids of GRIDS on world
    run_ranks(world, body_grids, [grid for grid in GRIDS if grid[0] * grid[1] == world],
              timeout=120)


def body_memory(model_parts: int) -> tuple[int, int]:
    env = scaleout.init(timeout=60)
    dist = env.create_distribution(1, model_parts)
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(64, 384), torch.nn.ReLU(),
                                torch.nn.Linear(384, 64))
    full = sum(p.numel() * p.element_size() for p in plain.parameters())
    x = torch.randn(5, 64)
    full_hidden = plain[0](x).numel()
    net = tensor_parallel(plain, dist)
    local = sum(p.numel() * p.element_size() for p in net.parameters())
    local_hidden = net[0](x).numel()  # the activation between the pair: this rank's block
    env.finalize()
    return full, local, full_hidden, local_hidden


@pytest.mark.parametrize("model_parts", [2, 3])
def test_parameter_and_activation_memory_fall_by_model_degree(model_parts: int) -> None:
    for full, local, full_hidden, local_hidden in run_ranks(model_parts, body_memory,
                                                            model_parts):
        # only the row layer's bias (64 values) stays replicated
        assert local <= full / model_parts + 64 * 4, (full, local)
        assert local >= full / model_parts
        assert local_hidden * model_parts == full_hidden


def body_errors() -> None:
    env = scaleout.init(timeout=30)
    grid12 = env.create_distribution(1, 2)
    grid21 = env.create_distribution(2, 1)
    with pytest.raises(ValueError, match=r"ColumnParallelLinear fc: out_features = 7 .* 2"):
        ColumnParallelLinear(4, 7, distribution=grid12, name="fc")
    with pytest.raises(ValueError, match=r"RowParallelLinear proj: in_features = 5 .* 2"):
        RowParallelLinear(5, 4, distribution=grid12, name="proj")
    block = MODELS["block"](width=12, n_heads=3)
    with pytest.raises(ValueError, match=r"attention attn: n_heads = 3 .* 2"):
        tensor_parallel(block, grid12)
    assert type(block.attn.q) is torch.nn.Linear  # nothing was converted
    with pytest.raises(ValueError, match=r"layer 'nope'"):
        tensor_parallel(MODELS["mlp"](), grid12, plan={"nope": "column"})
    net = tensor_parallel(MODELS["mlp"](), grid12)
    with pytest.raises(ValueError, match=r"layer 0 is split across the model group of ranks "
                                         r"\[0, 1\] \(2 parts\).*ranks \[\d\] \(1 parts\)"):
        DataParallel(net, grid21)
    with pytest.raises(ValueError, match="must divide the world size"):
        env.create_distribution(2, 2)
    env.finalize()


def test_errors_name_the_layer_and_sizes() -> None:
    run_ranks(2, body_errors)


def body_vocab_ids() -> None:
    env = scaleout.init(timeout=20)
    for model_parts in (2, 1):  # split, and a model group of one
        grid = env.create_distribution(env.world_size // model_parts, model_parts)
        emb = VocabParallelEmbedding(4, 3, distribution=grid, name="emb")
        for bad in (4, -1):  # past every rank's rows: plain nn.Embedding raises, not zeros
            with pytest.raises(ValueError, match=rf"VocabParallelEmbedding emb: ids must be in "
                                                 rf"\[0, 4\), got {bad}"):
                emb(torch.tensor([[0, bad], [3, 1]]))
        assert emb(torch.tensor([[0, 3]])).shape == (1, 2, 3)
    env.finalize()


def test_vocab_embedding_refuses_ids_outside_the_table() -> None:
    run_ranks(2, body_vocab_ids, timeout=30)


class TiedLM(torch.nn.Module):
    """GPT-2's layout: the LM head reads the token embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(8, 4)
        self.head = torch.nn.Linear(4, 8, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids))


def body_tied() -> None:
    env = scaleout.init(timeout=20)
    grid = env.create_distribution(1, 2)
    net = TiedLM()
    with pytest.raises(ValueError, match=r"layer 'emb': its weight is also head\.weight"):
        tensor_parallel(net, grid, embeddings=True)
    assert type(net.emb) is torch.nn.Embedding and net.head.weight is net.emb.weight
    env.finalize()


def test_a_layer_whose_weight_is_tied_is_not_split() -> None:
    # the split layer got a weight of its own: the head kept the old, whole one, and the
    # two trained apart (silently, unlike the tied model)
    run_ranks(2, body_tied, timeout=30)


def body_frequency_scaled_embedding() -> None:
    env = scaleout.init(timeout=20)
    grid = env.create_distribution(1, 2)
    net = torch.nn.Sequential(torch.nn.Embedding(8, 4, scale_grad_by_freq=True))
    with pytest.raises(ValueError, match=r"VocabParallelEmbedding 0: .*scale_grad_by_freq"):
        tensor_parallel(net, grid, embeddings=True)
    env.finalize()


def test_an_embedding_that_scales_gradients_by_frequency_is_not_split() -> None:
    # the split layer ignored the option: its gradients were not scaled, silently
    run_ranks(2, body_frequency_scaled_embedding, timeout=30)


class _Between(torch.nn.Module):
    """Two linears with ``step`` between them in the forward."""

    def __init__(self, step) -> None:
        super().__init__()
        self.a, self.b, self.step = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.step(self.a(x)))


class _Branching(_Between):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent: torch.fx cannot trace it
            return self.b(self.a(x))
        return self.b(torch.relu(self.a(x)))


class _Residual(_Between):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(F.gelu(h)) + h  # h is needed whole


def test_default_plan_pairs_only_across_elementwise_steps() -> None:
    pair = {"a": "column", "b": "row"}
    assert plan_tensor_parallel(_Between(F.gelu)) == pair
    assert plan_tensor_parallel(_Between(lambda h: torch.relu(h) * 0.5)) == pair
    # a softmax or a normalisation over the features needs them all: left replicated
    assert plan_tensor_parallel(_Between(lambda h: torch.softmax(h, -1))) == {}
    assert plan_tensor_parallel(_Residual(None)) == {}
    seq = torch.nn.Sequential
    assert plan_tensor_parallel(seq(torch.nn.Linear(8, 8), torch.nn.GELU(),
                                    torch.nn.Dropout(0.1), torch.nn.Linear(8, 8))) == {
        "0": "column", "3": "row"}
    assert plan_tensor_parallel(seq(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8),
                                    torch.nn.Linear(8, 8))) == {}
    with pytest.warns(UserWarning, match=r"the forward of <root> \(_Branching\) cannot be "
                                         r"traced to see what lies between a and b"):
        assert plan_tensor_parallel(_Branching(None)) == {}


CLIP, CLIP_STEPS, CLIP_PER = 0.05, 3, 4


def _clip_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 4)).double()


def _clip_data(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return (torch.randn(n, 8, generator=g, dtype=torch.float64),
            torch.randn(n, 4, generator=g, dtype=torch.float64))


def body_clip(data_parts: int, model_parts: int, mode: str) -> float:
    env = scaleout.init(timeout=60)
    dist = env.create_distribution(data_parts, model_parts)
    d = dist.rank(GroupType.DATA)
    net = tensor_parallel(_clip_net(), dist)
    model = DataParallel(net, dist)
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.5), model, mode=mode,
                               max_grad_norm=CLIP)
    for step in range(CLIP_STEPS):
        x, y = _clip_data(step, CLIP_PER * data_parts)
        mine = slice(d * CLIP_PER, (d + 1) * CLIP_PER)
        F.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
        opt.zero_grad()
    model.synchronize()
    got = full_state_dict(net)
    ref = _clip_net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(CLIP_STEPS):
        x, y = _clip_data(step, CLIP_PER * data_parts)
        F.mse_loss(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        ref_opt.step()
        ref_opt.zero_grad()
    worst = max((got[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    model.close()
    env.finalize()
    return worst


@pytest.mark.parametrize("mode", ["overlap", "sync"])
@pytest.mark.parametrize("grid", [(1, 2), (2, 2)])
def test_gradient_clipping_uses_the_whole_models_norm(grid: tuple[int, int], mode: str) -> None:
    """Each model rank clipped by the norm of its own shard and the replicated parameters:
    weights 1e-3..7e-3 off, and the replicated bias different on each model rank."""
    assert max(run_ranks(grid[0] * grid[1], body_clip, *grid, mode, timeout=90)) < 1e-12


class _SingleHead(torch.nn.Module):
    """Attention-named projections but no head count: splitting q/k/v would give each rank
    half of every q.k product."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.out = (torch.nn.Linear(8, 8) for _ in range(4))


class _HFAttention(_SingleHead):
    def __init__(self) -> None:
        super().__init__()
        self.num_attention_heads = 4
        self.query, self.key, self.value, self.dense = self.q, self.k, self.v, self.out
        del self.q, self.k, self.v, self.out


def test_attention_is_split_only_with_a_head_count() -> None:
    with pytest.warns(UserWarning, match="no head count"):
        assert plan_tensor_parallel(_SingleHead()) == {}
    assert plan_tensor_parallel(_HFAttention()) == {
        "query": "column", "key": "column", "value": "column", "dense": "row"}
    for llama in (LlamaAttention(), LocalHeadsAttention()):
        assert plan_tensor_parallel(llama) == {
            "wq": "column", "wk": "column", "wv": "column", "wo": "row"}
    assert plan_tensor_parallel(_Heads()) == {}  # whether a/b are its attention: not told
    assert plan_tensor_parallel(FusedAttention()) == {"qkv": "qkv", "proj": "row"}


def body_gpt_default_plan() -> tuple[dict[str, str], list[int], float]:
    """The transformer workload's GPT under the default plan: its fused qkv projection
    stayed replicated before stop 49 (its forward split the output by the whole width)."""
    from scaleout.workloads.transformer import GPT, TransformerConfig

    env = scaleout.init(timeout=30)
    dist = env.create_distribution(1, 2)
    config = TransformerConfig(vocab_size=32, seq_len=6, d_model=16, n_layers=2, n_heads=4)
    torch.manual_seed(0)
    plain = GPT(config).double()
    torch.manual_seed(0)
    net = GPT(config).double()
    plan = plan_tensor_parallel(net)
    tensor_parallel(net, dist)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (plain, net)]
    for step in range(2):
        ids = torch.randint(0, 32, (3, 6), generator=torch.Generator().manual_seed(step))
        for module, opt in zip((plain, net), opts):
            F.cross_entropy(module(ids).flatten(0, 1), ids.roll(-1, 1).flatten()).backward()
            opt.step()
            opt.zero_grad()
    state = full_state_dict(net)
    worst = max((state[k] - v).abs().max().item() for k, v in plain.state_dict().items())
    heads = [block.attn.n_heads for block in net.blocks]
    env.finalize()
    return {k: v for k, v in plan.items() if ".attn." in k}, heads, worst


def test_the_gpt_workloads_attention_is_split_by_the_default_plan() -> None:
    for plan, heads, worst in run_ranks(2, body_gpt_default_plan, timeout=60):
        assert plan == {f"blocks.{i}.attn.{name}": style for i in range(2)
                        for name, style in (("qkv", "qkv"), ("proj", "row"))}, plan
        assert heads == [2, 2]
        assert worst < 1e-12, worst


#: explicit plans on attentions the default plan's names did not cover (before, the heads of
#: the first stayed undivided, 0.27 off; the second, planned "column" as the docs said, gave
#: rank 0 all of q and half of k, 0.75 off)
PLANNED = {"llama": (LlamaAttention, {"wq": "column", "wk": "column", "wv": "column",
                                      "wo": "row"}),
           "fused": (FusedAttention, {"qkv": "qkv", "proj": "row"}),
           # the heads a rank holds (n_local_heads) stayed whole: the forward's view(..., -1)
           # then halved each head's width, silently 0.063 off
           "local": (LocalHeadsAttention, {"wq": "column", "wk": "column", "wv": "column",
                                           "wo": "row"})}


def body_planned_attention(kind: str) -> tuple[list[int], float]:
    env = scaleout.init(timeout=30)
    dist = env.create_distribution(1, 2)
    build, plan = PLANNED[kind]
    torch.manual_seed(0)
    plain = build().double()
    torch.manual_seed(0)
    net = tensor_parallel(build().double(), dist, plan=plan)
    heads = [getattr(net, attr) for attr in ("n_heads", "n_kv_heads", "n_local_heads",
                                             "n_local_kv_heads") if hasattr(net, attr)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (plain, net)]
    for step in range(2):
        x = torch.randn(3, 5, 12 if kind == "fused" else plain.wq.in_features,
                        generator=torch.Generator().manual_seed(step), dtype=torch.float64)
        for module, opt in zip((plain, net), opts):
            module(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    state = full_state_dict(net)
    worst = max((state[k] - v).abs().max().item() for k, v in plain.state_dict().items())
    fresh = tensor_parallel(build().double(), dist, plan=plan)
    load_full_state_dict(fresh, state)  # each rank takes its parts back
    assert all(torch.equal(v, state[k]) for k, v in full_state_dict(fresh).items())
    if kind == "fused":  # gathered, a fused layer's output is the plain layer's
        whole = ColumnParallelLinear.from_linear(plain.qkv, distribution=dist, blocks=3,
                                                 gather_output=True)
        x = torch.randn(2, 12, dtype=torch.float64)
        worst = max(worst, (whole(x) - plain.qkv(x)).abs().max().item())
    env.finalize()
    return heads, worst


@pytest.mark.parametrize("kind,heads", [("llama", [2, 1]), ("fused", [1]), ("local", [2, 1])])
def test_planned_attention_divides_its_heads_and_trains_like_the_plain_one(
        kind: str, heads: list[int]) -> None:
    for got, worst in run_ranks(2, body_planned_attention, kind, timeout=60):
        assert got == heads
        assert worst < 1e-12, worst


class _Heads(_Between):
    """A head count, and linears not named as q/k/v projections."""

    def __init__(self) -> None:
        super().__init__(F.gelu)
        self.n_heads = 2


def body_wrong_plans() -> None:
    env = scaleout.init(timeout=30)
    grid12 = env.create_distribution(1, 2)
    lone = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with pytest.raises(ValueError, match=r"plan for layer '0': a column layer leaves each rank "
                                         r"a block of its outputs \(4 of 8 here\), which only a "
                                         r"row layer can take, and the plan has no \"row\" "
                                         r"layer in <root> \(Sequential\)"):
        tensor_parallel(lone, grid12, plan={"0": "column"})
    assert type(lone[0]) is torch.nn.Linear  # nothing converted
    with pytest.raises(ValueError, match=r"layer 'qkv': a fused \[q; k; v\] projection planned "
                                         r"\"column\".* plan it \"qkv\""):
        tensor_parallel(FusedAttention(), grid12, plan={"qkv": "column", "proj": "row"})
    with pytest.raises(ValueError, match=r"layer 'a': <root> \(_Heads\) has a head count "
                                         r"\(n_heads = 2\) but no layer named as a q/k/v"):
        tensor_parallel(_Heads(), grid12, plan={"a": "column", "b": "row"})
    env.finalize()


def test_plans_that_would_split_wrongly_are_refused() -> None:
    # a lone column layer failed at the next layer with torch's "mat1 and mat2 shapes cannot
    # be multiplied", naming no layer
    run_ranks(2, body_wrong_plans, timeout=30)
