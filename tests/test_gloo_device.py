"""New gloo groups share the world group's device (one I/O thread per rank), stay separate
groups, and fall back to torch's own making where the device cannot be had."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as tdist

import scaleout
from harness import run_ranks
from scaleout.core import gloo_device
from scaleout.core.grid import GroupType


def _io_threads() -> int:
    """This process's gloo I/O threads (one per gloo device)."""
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as handle:
                count += handle.read().strip() == "gloo_tcp_loop"
        except OSError:
            pass
    return count


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def body_groups(own: bool) -> tuple[int, int, list[float], int]:
    """The named I/O threads before and after two new groups, the sums on them, and how
    many threads the process gained (each group's workers, and its I/O thread if it has its
    own device: torch before 2.13 leaves that thread unnamed)."""
    if own:
        os.environ["SCALEOUT_GLOO_OWN_DEVICES"] = "1"
    env = scaleout.init(backend="gloo", timeout=30)
    before, threads = _io_threads(), _threads()
    dist = env.create_distribution()
    lanes = [dist.duplicate(GroupType.DATA, f"lane {i}") for i in range(2)]
    rank = tdist.get_rank()
    sums = []
    for comm in lanes:  # each a group of its own: a sum on each, in a different order
        t = torch.full((1 << 16,), float(rank + 1))
        work = tdist.all_reduce(t, group=comm.group, async_op=True)
        world = torch.full((4,), 10.0 * (rank + 1))
        tdist.all_reduce(world)  # the world group, while the lane's is in flight
        work.wait()
        sums += [float(t[0]), float(world[0])]
    after, grown = _io_threads(), _threads() - threads
    env.finalize()
    return before, after, sums, grown


@pytest.mark.parametrize("world", [2, 3])
def test_new_groups_share_the_world_groups_io_thread(world: int) -> None:
    total = float(sum(range(1, world + 1)))
    for before, after, sums, _ in run_ranks(world, body_groups, False, timeout=60):
        assert sums == [total, 10 * total] * 2
        if before:  # (torch names gloo's I/O thread from 2.13 on; the next test counts all)
            assert before == 1 and after == 1, (before, after)


def test_own_devices_on_request() -> None:
    for before, after, sums, _ in run_ranks(2, body_groups, True, timeout=60):
        assert sums == [3.0, 30.0] * 2
        if before:
            assert (before, after) == (1, 3)


def test_each_own_device_costs_a_thread_that_sharing_saves() -> None:
    """Counted over all of the process's threads, so on any torch: with their own devices the
    two new groups bring two threads more than sharing the world group's does."""
    shared = [grown for *_, grown in run_ranks(2, body_groups, False, timeout=60)]
    own = [grown for *_, grown in run_ranks(2, body_groups, True, timeout=60)]
    assert [o - s for o, s in zip(own, shared)] == [2, 2], (own, shared)


def test_without_the_world_groups_devices_torch_makes_the_group(
        monkeypatch: pytest.MonkeyPatch) -> None:
    made = []
    monkeypatch.setattr(gloo_device, "_world_devices", lambda: None)
    monkeypatch.setattr(tdist, "new_group",
                        lambda ranks, backend=None: made.append(ranks) or "group")
    assert gloo_device.new_group_on_world_device([0, 1]) == "group" and made == [[0, 1]]


def test_torchs_class_is_restored_after_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed import distributed_c10d

    torch_class = distributed_c10d.ProcessGroupGloo
    monkeypatch.setattr(gloo_device, "_world_devices", lambda: ["device"])

    def fails(ranks: list[int], backend: str | None = None) -> None:
        assert distributed_c10d.ProcessGroupGloo is not torch_class  # (swapped meanwhile)
        raise RuntimeError("the store is gone")

    monkeypatch.setattr(tdist, "new_group", fails)
    with pytest.raises(RuntimeError, match="the store is gone"):
        gloo_device.new_group_on_world_device([0, 1])
    assert distributed_c10d.ProcessGroupGloo is torch_class


def test_what_else_torch_passes_goes_on_the_options_or_torch_makes_the_group(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.14 makes gloo groups with ``enable_reconfigure=``, which the options carry;
    an argument they cannot carry gets torch's own making (its own device), not an error."""
    from torch.distributed import distributed_c10d

    class Options:
        def __init__(self) -> None:
            self._timeout = self._devices = None
            self.enable_reconfigure = False

    class TorchGloo:
        _Options = Options

        def __init__(self, *args: object, **kwargs: object) -> None:
            self.args, self.kwargs = args, kwargs

    monkeypatch.setattr(distributed_c10d, "ProcessGroupGloo", TorchGloo)
    with gloo_device._gloo_groups_on(["device"]):
        carried = distributed_c10d.ProcessGroupGloo("store", 0, 2, timeout=5,
                                                    enable_reconfigure=True)
        unknown = distributed_c10d.ProcessGroupGloo("store", 0, 2, timeout=5, new_flag=1)
    options = carried.args[3]
    assert carried.args[:3] == ("store", 0, 2) and not carried.kwargs
    assert (options._devices, options._timeout, options.enable_reconfigure) == (["device"], 5, True)
    assert unknown.args == ("store", 0, 2) and unknown.kwargs == {"timeout": 5, "new_flag": 1}
    assert distributed_c10d.ProcessGroupGloo is TorchGloo
