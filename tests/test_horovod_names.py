"""Automatic names of unnamed Horovod calls: counted per process set and kind, started over
by ``join()``, and a mismatch of automatic names says why (docs/horovod.md, "Unnamed calls are
matched in order")."""

from __future__ import annotations

import pytest
import torch

import scaleout.horovod as hvd
from harness import run_ranks


def body_unnamed_calls_on_a_process_set() -> dict[str, object]:
    """Ranks 1 and 2 run unnamed collectives on their own set; rank 0 does not. Automatic
    names count per process set, so the global calls afterwards still match (they used to
    raise "named its tensor differently" on every rank)."""
    hvd.init(timeout=30)
    r = hvd.rank()
    pair = hvd.add_process_set([1, 2])
    out: dict[str, object] = {}
    if pair.included():
        for _ in range(2):
            summed = hvd.allreduce(torch.ones(2) * r, op=hvd.Sum, process_set=pair)
        out["pair_sum"] = summed.tolist()
        out["pair_gather"] = hvd.allgather(torch.tensor([r]), process_set=pair).tolist()
        out["pair_bcast"] = hvd.broadcast(torch.tensor([r]), root_rank=2, process_set=pair).item()
        out["pair_rs"] = hvd.reducescatter(torch.ones(2) * r, op=hvd.Sum, process_set=pair).tolist()
        hvd.barrier(process_set=pair)
    out["sum"] = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum).item()
    out["rs"] = hvd.reducescatter(torch.ones(3), op=hvd.Sum).tolist()
    out["gather"] = hvd.allgather(torch.tensor([r])).tolist()
    out["bcast"] = hvd.broadcast(torch.tensor([r]), root_rank=1).item()
    hvd.barrier()
    out["objects"] = hvd.allgather_object(r)
    hvd.shutdown()
    return out


def test_unnamed_calls_on_a_process_set_leave_global_names_aligned() -> None:
    got = run_ranks(3, body_unnamed_calls_on_a_process_set, timeout=90)
    for r, g in enumerate(got):
        assert g["sum"] == 3.0 and g["rs"] == [3.0] and g["gather"] == [0, 1, 2], g
        assert g["bcast"] == 1 and g["objects"] == [0, 1, 2], g
        if r:
            assert g["pair_sum"] == [3.0, 3.0] and g["pair_gather"] == [1, 2], g
            assert g["pair_bcast"] == 2 and g["pair_rs"] == [3.0], g


def body_unnamed_calls_after_join() -> dict[str, object]:
    """Rank 0 runs more unnamed steps than the others, which join early; after the join
    every rank's automatic names start over, so unnamed calls match again (they used to
    raise on every rank)."""
    hvd.init(timeout=30)
    r, n = hvd.rank(), hvd.size()
    for _ in range(3 if r == 0 else 1):
        hvd.allreduce(torch.ones(2), op=hvd.Sum)
        hvd.allgather(torch.ones(1, 2))
        hvd.grouped_allreduce([torch.ones(1), torch.ones(2)], op=hvd.Sum)
    hvd.join()
    out = {"sum": hvd.allreduce(torch.tensor([r + 1.0]), op=hvd.Sum).item(),
           "average": hvd.allreduce(torch.tensor([float(r)])).item(),
           "gather": hvd.allgather(torch.tensor([r])).tolist(),
           "bcast": hvd.broadcast(torch.tensor([r]), root_rank=n - 1).item()}
    hvd.join()  # a second join (nobody behind) leaves them aligned too
    out["again"] = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()
    hvd.shutdown()
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_unnamed_calls_match_after_join(n: int) -> None:
    got = run_ranks(n, body_unnamed_calls_after_join, timeout=90)
    for g in got:
        assert g["sum"] == n * (n + 1) / 2 and g["average"] == (n - 1) / 2, g
        assert g["gather"] == list(range(n)) and g["bcast"] == n - 1 and g["again"] == n, g


def body_automatic_names_differ() -> list[str]:
    hvd.init(timeout=30)
    r = hvd.rank()
    errors = []
    for name in ("x" if r == 0 else None, None):  # then rank 1 is one unnamed call ahead
        try:
            hvd.allreduce(torch.ones(1), name=name)
        except hvd.TensorMismatchError as err:
            errors.append(str(err))
    hvd.shutdown()
    return errors


def test_automatic_names_that_differ_say_why() -> None:
    got = run_ranks(2, body_automatic_names_differ, timeout=60)
    for r, (mixed, both) in enumerate(got):
        which = "that rank's" if r == 0 else "this rank's"
        assert f"{which} name is automatic (an unnamed call) and the other's is not" in mixed
        assert "both names are automatic" in both, both
        assert "different numbers of unnamed allreduce calls on this process set" in both
        mine, theirs = ("0", "1") if r == 0 else ("1", "0")
        assert f"this rank: 'allreduce.noname.{mine}', that rank: 'allreduce.noname.{theirs}'" \
            in both, both


def body_codec_state_names() -> dict[str, object]:
    """A codec compression keeps error feedback per name. DistributedOptimizer without
    named_parameters names parameter j of group i ``allreduce.noname.i.j`` (as Horovod), apart
    from unnamed allreduces (its names used to be theirs, so one shared codec fed a gradient's
    residual into an unrelated allreduce); an unnamed allreduce with a codec is refused (its
    name changes every call: the residual was never fed back and the states grew)."""
    hvd.init(timeout=30)
    codec = hvd.Compression.codec("topk:ratio=0.25")
    model = torch.nn.Linear(4, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD([{"params": [model.weight]},
                                                    {"params": [model.bias]}], lr=0.1),
                                   compression=codec)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    out: dict[str, object] = {"optimizer": sorted(codec.states)}
    try:
        hvd.allreduce(torch.ones(4), compression=codec)
    except ValueError as err:
        out["unnamed"] = str(err)
    out["states"] = len(codec.states)
    for _ in range(3):  # named: one state, its residual fed back every call
        hvd.allreduce(torch.ones(4), name="g", compression=codec)
    out["named_states"] = len(codec.states)
    out["fp16"] = hvd.allreduce(torch.ones(2), compression=hvd.Compression.fp16).tolist()
    hvd.shutdown()
    return out


def test_codec_state_names_neither_collide_nor_grow() -> None:
    for got in run_ranks(2, body_codec_state_names, timeout=60):
        assert got["optimizer"] == ["allreduce.noname.0.0", "allreduce.noname.1.0"], got
        assert "pass name=" in got.get("unnamed", ""), got
        assert got["states"] == 2 and got["named_states"] == 3, got
        assert got["fp16"] == [1.0, 1.0], got  # stateless compressions stay fine unnamed
