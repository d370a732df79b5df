"""New gloo process groups that share the world group's gloo device, and so its I/O thread.

Each gloo device runs one I/O thread (``gloo_tcp_loop``) that wakes from ``epoll_wait``
every 10 ms even when idle, and torch gives every new gloo group a device of its own. A
data-parallel rank holds three groups (the world group, a lane, the BatchNorm buffers'),
so two such threads woke 200 times a second beside the one carrying the gradients: on two
ResNet-18 ranks over loopback, ~1,100 more ``epoll_wait`` calls per iteration than DDP's
single group, and twice the context switches (RESULTS.md, stop 43). A group made here keeps
its own gloo context, connections and worker threads (collectives of different groups still
never queue behind one another); only the device, which multiplexes their sockets, is the
world group's, as DDP's one group has one device.

torch's ``new_group`` takes no gloo options (``pg_options`` is ignored for gloo), so the
group is made while ``distributed_c10d.ProcessGroupGloo`` names a subclass that passes the
world group's devices to the constructor that accepts them, with whatever else torch passes
(torch 2.14 adds ``enable_reconfigure``) set on the same options. Where any of that is
missing (another torch), the group is made as torch makes it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as tdist

__all__ = ["OWN_DEVICES_VAR", "new_group_on_world_device"]

#: ``1``: every new gloo group gets a device (an I/O thread) of its own, as torch makes them,
#: instead of sharing the world group's; for measuring what sharing saves.
OWN_DEVICES_VAR = "SCALEOUT_GLOO_OWN_DEVICES"

_LOCK = threading.Lock()  # (the swap below is module state: one group at a time)


def new_group_on_world_device(ranks: list[int] | None = None,
                              backend: str | None = None) -> Any:
    """``tdist.new_group(ranks, backend=backend)``; a gloo group where the world group is
    one too, on the world group's device (above)."""
    devices = _world_devices() if backend in (None, "gloo") else None
    if devices is None:
        return tdist.new_group(ranks, backend=backend)
    with _LOCK, _gloo_groups_on(devices):
        return tdist.new_group(ranks, backend=backend)


def _world_devices() -> list[Any] | None:
    """The world group's gloo devices, where the world group is a gloo group whose options
    show them; else ``None``."""
    if tdist.get_backend() != "gloo" or os.environ.get(OWN_DEVICES_VAR) == "1":
        return None
    try:
        backend = tdist.group.WORLD._get_backend(torch.device("cpu"))  # type: ignore[union-attr]
        devices = list(backend.options._devices)
        tdist.ProcessGroupGloo._Options()  # (the constructor that takes devices)
    except (AttributeError, RuntimeError, TypeError):
        return None
    return devices or None


@contextlib.contextmanager
def _gloo_groups_on(devices: list[Any]) -> Iterator[None]:
    from torch.distributed import distributed_c10d

    torch_class = distributed_c10d.ProcessGroupGloo

    class OnWorldDevice(torch_class):  # type: ignore[misc, valid-type]
        def __init__(self, store: Any, rank: int, size: int, timeout: Any,
                     **more: Any) -> None:
            options = torch_class._Options()
            if not all(hasattr(options, name) for name in more):
                # an argument the options cannot carry: torch's own making, own device
                super().__init__(store, rank, size, timeout=timeout, **more)
                return
            options._timeout = timeout
            options._devices = devices
            for name, value in more.items():  # (torch 2.14: enable_reconfigure)
                setattr(options, name, value)
            super().__init__(store, rank, size, options)

    distributed_c10d.ProcessGroupGloo = OnWorldDevice
    try:
        yield
    finally:
        distributed_c10d.ProcessGroupGloo = torch_class
