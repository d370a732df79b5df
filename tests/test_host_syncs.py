"""Steady-state DataParallel training reads nothing of the device on the host from scaleout's
own code, except where a stated reason allows it (:data:`ALLOWED`).

On a GPU, every value read on the host (``.item()``, ``.tolist()``, ``if tensor:``,
``float(t)``, ``.cpu()``, ``.numpy()``, ``torch.nonzero``, ``torch.equal``, a boolean-mask
index) waits for every kernel queued before it, and ``torch.tensor(host data, device=...)``
is a pageable host-to-device copy that torch follows with a stream synchronisation. These
CPU tests cannot see the device, so they count the Python-level calls instead: after
:data:`WARMUP` iterations, two ranks train :data:`COUNTED` more with those methods and
functions of torch wrapped, and every call made directly from a file under ``src/scaleout``
is recorded with its file, function and thread (the progress engine's calls included).

Also recorded: tensors made without ``device=`` (``torch.zeros`` & co. from scaleout's code
during an iteration land on the CPU whatever the model's device).

What the CPU path alone does (a codec's data-dependent branch, taken only where
``checks_are_free`` says the tensor is on the CPU) is allowed with ``cpu_only=True``; on CUDA
those codecs take the branch-free path (docs/compression.md, "Host synchronisation"), which
``tests/test_gpu_codecs.py`` checks under ``torch.cuda.set_sync_debug_mode("error")`` on a GPU.
"""

from __future__ import annotations

import functools
import os
import pathlib
import sys
import threading
from collections import Counter
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import scaleout
from harness import run_ranks
from scaleout import SchedulerConfig
from scaleout.pytorch import DataParallel, DistributedOptimizer

WARMUP, COUNTED = 3, 3
SRC = os.path.dirname(scaleout.__file__) + os.sep

#: methods that read a tensor's values on the host (``__bool__``: ``if t:``, ``bool(t)``)
READ_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu",
                "numpy", "nonzero", "__format__", "__repr__")
#: functions whose result's size or value is decided on the host
READ_FUNCTIONS = ("equal", "nonzero", "unique", "masked_select", "bincount", "allclose")
#: factories that make a tensor on the default device (the CPU) without ``device=``
FACTORIES = ("zeros", "empty", "ones", "full", "arange", "rand", "randn", "randint", "eye",
             "linspace")


class Allowed(NamedTuple):
    cpu_only: bool  # taken only for CPU tensors: on CUDA the code takes another path
    reason: str


#: (file under src/scaleout, function) -> why it may read the device on the host.
ALLOWED: dict[tuple[str, str], Allowed] = {
    ("compression/base.py", "_keep_finite"): Allowed(
        True, "one reduction's finiteness read decides whether to mask non-finite residual "
        "values; guarded by checks_are_free (on a device: always masked, no read)"),
    ("compression/blockquant.py", "_quantize_and_remember"): Allowed(
        True, "any non-finite block / saturated exponent read decides two passes; guarded by "
        "checks_are_free (on a device: always clamped, no read)"),
    ("pytorch/updates.py", "used_globally"): Allowed(
        False, "a rank that did not use every parameter reads the exchanged usage flags: the "
        "optimizer decides on the host which parameters to skip (all used here: no read)"),
    ("pytorch/dp_backward.py", "_end_backward"): Allowed(
        False, "a rank that did not use every parameter sends its usage flags from a Python "
        "list (a host-to-device copy on a GPU; all used: torch.ones, no copy)"),
}

#: the configurations: what each may record (keys of ALLOWED)
CASES: dict[str, tuple[dict[str, Any], frozenset[tuple[str, str]]]] = {
    "exact-overlap": (dict(mode="overlap"), frozenset()),
    "exact-sync": (dict(mode="sync"), frozenset()),
    "sharded-overlap": (dict(mode="overlap", distributed_update=True), frozenset()),
    "blockquant-overlap": (dict(mode="overlap", compression="blockquant"), frozenset({
        ("compression/base.py", "_keep_finite"),
        ("compression/blockquant.py", "_quantize_and_remember")})),
    # the same codec on the path it takes on a device (``checks_are_free`` says no): the
    # CPU-only reads above are gone, so ``cpu_only`` is true of them
    "blockquant-device-path": (dict(mode="overlap", compression="blockquant", device_path=True),
                               frozenset()),
    "unused-on-rank-1": (dict(mode="overlap", unused_on=1), frozenset({
        ("pytorch/updates.py", "used_globally"), ("pytorch/dp_backward.py", "_end_backward")})),
}


class Event(NamedTuple):
    kind: str  # "read", "h2d" (torch.tensor of host data) or "no device"
    call: str
    where: str  # file under src/scaleout
    line: int
    function: str
    thread: str


class Watch:
    """Wraps :data:`READ_METHODS`, :data:`READ_FUNCTIONS`, :data:`FACTORIES`,
    ``torch.tensor`` / ``torch.as_tensor`` and ``Tensor.__getitem__`` (a boolean mask) while
    entered; records the calls made directly from scaleout's files."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._saved: list[tuple[Any, str, Any]] = []

    def _record(self, kind: str, call: str) -> None:
        frame = sys._getframe(2)  # (the wrapper's caller)
        path = frame.f_code.co_filename
        if path.startswith(SRC):
            self.events.append(Event(kind, call, path[len(SRC):].replace(os.sep, "/"),
                                     frame.f_lineno, frame.f_code.co_name,
                                     threading.current_thread().name))

    def _wrap(self, owner: Any, name: str, kind_of: Any) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            kind = kind_of(args, kwargs)
            if kind:
                self._record(kind, name)
            return original(*args, **kwargs)

        self._saved.append((owner, name, original))
        setattr(owner, name, wrapper)

    def __enter__(self) -> Watch:
        for name in READ_METHODS:
            self._wrap(torch.Tensor, name, lambda a, k: "read")
        for name in READ_FUNCTIONS:
            self._wrap(torch, name, lambda a, k: "read")
        for name in FACTORIES:
            self._wrap(torch, name, lambda a, k: None if "device" in k else "no device")
        for name in ("tensor", "as_tensor"):
            self._wrap(torch, name, lambda a, k: None if a and isinstance(a[0], torch.Tensor)
                       else "h2d" if "device" in k else "no device")
        for owner in (torch, torch.Tensor):  # (without output_size: sized on the host)
            self._wrap(owner, "repeat_interleave",
                       lambda a, k: None if "output_size" in k else "read")
        self._wrap(torch.Tensor, "__getitem__", lambda a, k: "read" if _bool_mask(a[1]) else None)
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()


def _bool_mask(index: Any) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32)  # its running statistics are averaged every forward
        self.fc2 = nn.Linear(32, 32)
        self.extra = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        h = F.relu(self.bn(self.fc1(x)))
        h = F.relu(self.fc2(h))
        if use_extra:
            h = h + torch.tanh(self.extra(h))
        return self.fc3(h)


def _take_device_paths() -> None:
    """Make every codec module's ``checks_are_free`` say no (this forked rank only): the
    codecs then run the branch-free path they take on an accelerator."""
    for name, module in list(sys.modules.items()):
        if name.startswith("scaleout.compression") and hasattr(module, "checks_are_free"):
            module.checks_are_free = lambda tensor: False


def body(case: str) -> tuple[list[Event], float]:
    options, _ = CASES[case]
    if options.get("device_path"):
        _take_device_paths()
    env = scaleout.init(timeout=60)
    torch.manual_seed(0)
    net = Net()
    model = DataParallel(net, env.create_distribution(),
                         scheduler=SchedulerConfig(bucket_bytes=4096, first_bucket_bytes=1024),
                         compression=options.get("compression"),
                         distributed_update=options.get("distributed_update", False))
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01), model,
                               mode=options["mode"])
    generator = torch.Generator().manual_seed(env.rank)
    batches = [(torch.randn(8, 16, generator=generator),
                torch.randint(0, 4, (8,), generator=generator)) for _ in range(WARMUP + COUNTED)]
    use_extra = options.get("unused_on") != env.rank

    def iteration(x: torch.Tensor, y: torch.Tensor) -> None:
        F.cross_entropy(model(x, use_extra), y).backward()
        opt.step()
        opt.zero_grad()

    for x, y in batches[:WARMUP]:  # the first forward builds the session; buckets settle
        iteration(x, y)
    with Watch() as watch:
        for x, y in batches[WARMUP:]:
            iteration(x, y)
    exchanged = model.session.statistics.total().bytes if model.session else 0.0
    model.synchronize()
    model.close()
    env.finalize()
    return watch.events, exchanged


def _report(events: list[Event]) -> str:
    counts = Counter(events)
    return "\n".join(f"  {n}x {e.kind} {e.call} at {e.where}:{e.line} in {e.function} "
                     f"({e.thread})" for e, n in sorted(counts.items(), key=lambda i: i[0].where))


@pytest.mark.parametrize("case", list(CASES))
def test_steady_state_reads_nothing_on_the_host(case: str) -> None:
    allowed = CASES[case][1]
    seen = set()
    for rank, (events, exchanged) in enumerate(run_ranks(2, body, case, timeout=120)):
        assert exchanged > 0, f"rank {rank}: nothing was exchanged (the watch saw no iteration)"
        unexpected = [e for e in events if (e.where, e.function) not in allowed]
        assert not unexpected, (f"rank {rank} ({case}): host reads or host tensors from "
                                f"scaleout's code in steady-state iterations, not in ALLOWED "
                                f"with a reason:\n{_report(unexpected)}")
        seen |= {(e.where, e.function) for e in events}
    # each allowed site did read (the watch works, and the list holds no stale entry)
    assert seen == allowed, f"{case}: allowed but not seen: {sorted(allowed - seen)}"


def test_allowed_sites_are_still_there() -> None:
    """Each allowed entry names a function that exists (a renamed one must leave the list)."""
    for (path, function), entry in ALLOWED.items():
        assert entry.reason, (path, function)
        source = pathlib.Path(SRC, path).read_text(encoding="utf-8")
        assert f"def {function}(" in source, f"{path} has no function {function} any more"
    used = set().union(*(allowed for _, allowed in CASES.values()))
    assert used == set(ALLOWED), f"ALLOWED entries no case expects: {set(ALLOWED) - used}"
    for options, allowed in CASES.values():  # a device path has none of the CPU-only reads
        if options.get("device_path"):
            assert not {key for key in allowed if ALLOWED[key].cpu_only}, options
