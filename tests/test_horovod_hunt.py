"""Defects found in scaleout.horovod by the stop-51 hunt, each against Horovod's documented
behaviour; every case failed before its fix (see docs/horovod.md)."""

from __future__ import annotations

import torch
from torch import nn

import scaleout.horovod as hvd
from harness import run_ranks

# A process's first optimizer costs seconds of lazy torch imports: pay it once here, before
# the ranks fork, not in every rank.
torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def _error(fn) -> str:
    try:
        fn()
    except (ValueError, RuntimeError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def body_hunt() -> dict[str, object]:
    out: dict[str, object] = {}
    # Horovod's init(process_sets="dynamic") (which its add_process_set needs) was read as
    # ranks 'd', 'y', ... : TypeError "ProcessSet ranks must be ints, got ['d']"
    out["bad_mode"] = _error(lambda: hvd.init(timeout=20, process_sets="static"))
    hvd.init(timeout=20, process_sets="dynamic")
    r = hvd.rank()
    evens = hvd.add_process_set([0, 2])
    if evens.included():
        out["evens"] = hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=evens).item()
    hvd.remove_process_set(evens)

    # broadcast_optimizer_state: a rank whose parameter groups do not fit the root's state
    # raised alone; the root returned as if all was well
    model = nn.Linear(3, 2, bias=(r == 0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out["optimizer"] = _error(lambda: hvd.broadcast_optimizer_state(optimizer, root_rank=0))

    # two tensors of one name in flight at once, submitted in different orders: the second
    # is refused, as in Horovod (before: paired in submission order, rank 0's second tensor
    # summed with the others' first, every rank a mixed answer, no error); the first ones
    # pair as Horovod pairs them, by name
    first = torch.ones(2) * (r + 1)
    second = torch.ones(2) * 100 * (r + 1)
    order = (first, second) if r == 0 else (second, first)
    handle = hvd.allreduce_async(order[0], name="same", op=hvd.Sum)
    out["in_flight"] = _error(lambda: hvd.allreduce_async(order[1], name="same", op=hvd.Sum))
    out["first_result"] = hvd.synchronize(handle).tolist()
    # once synchronized, the name is free again; other collectives have names of their own
    out["reused"] = hvd.synchronize(hvd.allreduce_async(first, name="same", op=hvd.Sum)).tolist()
    pending = hvd.allgather_async(first, name="same")
    out["other_kind"] = hvd.allreduce(first, name="same", op=hvd.Sum).tolist()
    hvd.synchronize(pending)
    # one rank alone reuses a name: it raises its ValueError, the others at once, naming it
    h = hvd.broadcast_async(first, root_rank=0, name="b0")
    out["one_rank"] = _error(lambda: hvd.broadcast_async(
        first, root_rank=0, name="b0" if r == 1 else "b1"))
    hvd.synchronize(h)
    g = hvd.grouped_allreduce_async([first, second], name="g")
    out["grouped"] = _error(lambda: hvd.grouped_allreduce_async([first, second], name="g"))
    hvd.synchronize(g)
    out["after"] = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()

    # DistributedOptimizer's groups= has no effect, but bad values passed silently where
    # Horovod raises ValueError
    w, bias = model.weight, nn.Parameter(torch.zeros(2))
    for kwargs in ({"groups": -1}, {"groups": "2"}, {"groups": [w, bias]},
                   {"groups": [[w, "bias"]]}, {"groups": [[w], [w]]}, {"num_groups": -1}):
        text = _error(lambda: hvd.DistributedOptimizer(torch.optim.SGD([w, bias], lr=0.1),
                                                       **kwargs))
        out.setdefault("groups", []).append(text.split(":")[0])
    for kwargs in ({"groups": 2}, {"groups": [[w], [bias]]}, {"num_groups": 2}):
        hvd.DistributedOptimizer(torch.optim.SGD([w, bias], lr=0.1), **kwargs)

    # a group added after wrapping: before stop 51 its parameters were never averaged
    torch.manual_seed(0)
    first_layer, second_layer = nn.Linear(2, 2), nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(first_layer.parameters(), lr=0.5))
    opt.add_param_group({"params": list(second_layer.parameters())})
    second_layer(first_layer(torch.full((1, 2), float(r + 1)))).sum().backward()
    opt.step()
    out["added"] = [second_layer.weight.tolist(), first_layer.weight.tolist()]
    hvd.shutdown()
    return out


def test_hunt_three_ranks() -> None:
    got = run_ranks(3, body_hunt, timeout=120)
    assert got[0]["optimizer"].startswith("TensorMismatchError") and \
        "global rank 1" in got[0]["optimizer"], got[0]["optimizer"]
    for g in got[1:]:
        assert "parameter group that doesn't match" in g["optimizer"], g["optimizer"]
    for r, g in enumerate(got):
        assert g["bad_mode"].startswith("ValueError") and '"dynamic"' in g["bad_mode"]
        assert g.get("evens") == (None if r == 1 else 2.0)
        assert g["in_flight"].startswith("ValueError") and "'same' is still in flight" \
            in g["in_flight"], g["in_flight"]
        assert g["first_result"] == [501.0, 501.0]  # rank 0's 1 + the others' 200, 300
        assert g["reused"] == [6.0, 6.0] and g["other_kind"] == [6.0, 6.0]
        if r == 1:
            assert g["one_rank"].startswith("ValueError") and "'b0'" in g["one_rank"]
        else:
            assert g["one_rank"].startswith("TensorMismatchError") and \
                "global rank 1" in g["one_rank"], g["one_rank"]
        assert "'g.0' is still in flight" in g["grouped"], g["grouped"]
        assert g["added"] == got[0]["added"], (r, g["added"], got[0]["added"])
        assert g["after"] == 3.0
        assert g["groups"] == ["ValueError"] * 6, g["groups"]
