"""A model group whose ranks see different inputs is an error, not a wrong model.

Tensor-parallel layers need the same input on every rank of their model group. The usual
mistakes - a loader sharded by global rank, a dropout seeded per rank before a column layer,
different ids into a vocab-parallel table - are caught by a fingerprint comparison on the
consistency check's schedule (``tensor_parallel/agreement.py``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import scaleout
from harness import run_ranks
from scaleout import GroupType
from scaleout.pytorch import DataParallel, tensor_parallel
from scaleout.pytorch.tensor_parallel.agreement import TOLERANCE, _differs, _fingerprint


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))


def body_inputs(case: str, check: str) -> str:
    env = scaleout.init(timeout=30, check_consistency=check)
    dist = env.create_distribution(1, env.world_size)
    try:
        if case == "vocab":
            torch.manual_seed(0)
            net = tensor_parallel(nn.Sequential(nn.Embedding(12, 4), nn.Linear(4, 4)), dist,
                                  embeddings=True)
            ids = torch.tensor([[1, 2, 3]]) + (env.rank if env.rank == 2 else 0)
            net(ids)
            return "ok"
        if case == "near ids":  # one id of 4096 off by one: 3e-5 of their norm
            net = tensor_parallel(nn.Sequential(nn.Embedding(1000, 2)), dist, embeddings=True)
            ids = torch.randint(0, 999, (8, 512), generator=torch.Generator().manual_seed(0))
            ids[3, 7] += env.rank
            net(ids)
            return "ok"
        if case == "split dropout":  # per-rank masks inside the pairs, alike after them
            torch.manual_seed(0)
            net = tensor_parallel(nn.Sequential(
                nn.Linear(6, 12), nn.Dropout(0.5), nn.Linear(12, 6), nn.Dropout(0.5),
                nn.Linear(6, 12), nn.Dropout(0.5), nn.Linear(12, 4)), dist)
            assert type(net[1]).__name__ == "SplitRegionDropout" == type(net[5]).__name__
            for _ in range(3):  # the second pair's input is compared at every forward
                net(torch.randn(5, 6))
            return "ok"
        net = tensor_parallel(mlp(), dist)
        torch.manual_seed(0)
        x = torch.randn(5, 6)
        if case == "samples":  # a loader sharded by global rank
            x = torch.randn(5, 6, generator=torch.Generator().manual_seed(env.rank))
        elif case == "dropout":  # a dropout seeded per rank before the column layer
            torch.manual_seed(env.rank)
            x = nn.functional.dropout(x, 0.1)
        elif case == "second":  # equal at the first forward, different at the second
            net(x)
            x = x + env.rank
        elif case == "rounding":  # different in the last bit: rounding, not a mistake
            x = x * (1 + 1e-7 * env.rank)
        net(x)
        return "ok"
    except ValueError as err:
        return str(err)
    finally:
        env.finalize()


@pytest.mark.parametrize("case", ["samples", "dropout"])
def test_different_inputs_in_a_model_group_are_named_on_every_rank(case: str) -> None:
    for rank, message in enumerate(run_ranks(2, body_inputs, case, "first")):
        assert "ColumnParallelLinear 0: different input on the ranks of the model group " \
            "model[0, 1]" in message, (rank, message)
        assert "global rank 1 against 0" in message and "by DATA rank" in message


def test_different_ids_into_a_vocab_parallel_table_are_named() -> None:
    for message in run_ranks(3, body_inputs, "vocab", "first"):
        assert "VocabParallelEmbedding 0: different ids on the ranks" in message, message
        assert "global rank 2 against 0" in message


def test_ids_one_apart_are_named() -> None:
    # ids were compared with the floats' tolerance (1e-4 of the norm): this passed, and the
    # ranks looked up different rows, silently
    for message in run_ranks(2, body_inputs, "near ids", "first"):
        assert "VocabParallelEmbedding 0: different ids on the ranks" in message, message
        assert "different values" in message


@pytest.mark.parametrize("check,expected", [("first", "ok"), ("full", "different input")])
def test_the_check_follows_the_consistency_schedule(check: str, expected: str) -> None:
    for message in run_ranks(2, body_inputs, "second", check):
        assert expected in message, message


def test_equal_inputs_and_rounding_pass() -> None:
    assert run_ranks(2, body_inputs, "same", "full") == ["ok", "ok"]
    assert run_ranks(2, body_inputs, "rounding", "full") == ["ok", "ok"]
    assert run_ranks(2, body_inputs, "samples", "off") == ["ok", "ok"]  # off: nothing checks


def test_split_region_dropouts_leave_the_replicated_inputs_alike() -> None:
    # since stop 49 a dropout between a column and a row layer draws from a per-rank stream:
    # the default one, which the dropout after the row layer draws from, stays alike
    assert run_ranks(3, body_inputs, "split dropout", "full") == ["ok", "ok", "ok"]


def body_training_by_data_rank() -> None:
    """A 2x2 grid fed by DATA rank, as the docs say: no error through DataParallel."""
    env = scaleout.init(timeout=30, check_consistency="full")
    dist = env.create_distribution(2, 2)
    torch.manual_seed(env.rank)  # different seeds: DataParallel's broadcast makes them agree
    model = DataParallel(tensor_parallel(mlp(), dist), dist)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(
            10 * step + dist.rank(GroupType.DATA)))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    model.close()
    env.finalize()


def test_a_grid_fed_by_data_rank_trains() -> None:
    run_ranks(4, body_training_by_data_rank, timeout=90)


def test_fingerprints_tell_differences_from_rounding() -> None:
    torch.manual_seed(0)
    x = torch.randn(1000)
    same = _fingerprint(x).tolist()
    assert _differs(_fingerprint(x.clone()).tolist(), same) is None
    assert _differs(_fingerprint(x * (1 + 1e-7)).tolist(), same) is None
    one = x.clone()
    one[17] += 0.1 * x.norm()  # one element off by a tenth of the whole norm
    assert _differs(_fingerprint(one).tolist(), same) > TOLERANCE
    assert _differs(_fingerprint(x[:999]).tolist(), same) == float("inf")
    assert _differs(_fingerprint(x.roll(1)).tolist(), same) > 0.1  # the same values, moved
    nan = torch.full((4,), float("nan"))
    assert _differs(_fingerprint(nan).tolist(), _fingerprint(nan).tolist()) is None


def test_integer_fingerprints_compare_exactly() -> None:
    ids = torch.randint(0, 50_000, (64, 128), generator=torch.Generator().manual_seed(0))
    same = _fingerprint(ids).tolist()
    assert _differs(_fingerprint(ids.clone()).tolist(), same, exact=True) is None
    one_more, swapped, two = ids.clone(), ids.clone(), ids.clone()
    one_more[39, 8] += 1
    swapped[0, :2] = ids[0, :2].flip(0)
    two[0, 1], two[9, 2] = 7, 7
    for other in (one_more, swapped, two):
        assert _differs(_fingerprint(other).tolist(), same, exact=True) == float("inf")
