"""What the autotuner measures beside the compute: the link (all-reduces of two sizes) and
each candidate codec's cost on a layer's shapes (:mod:`scaleout.pytorch.tuning`), and the
simulator's models made of those measurements."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from scaleout.compression import make_codec
from scaleout.compression.state import CodecState
from scaleout.core.collectives import allreduce
from scaleout.sim.config import CodecModel
from scaleout.sim.tuning import LinkModel
from scaleout.sim.workload import Workload

__all__ = ["PROBE_BYTES", "PROBE_REPEATS", "codec_models", "link_model", "measure_codec",
           "measure_link"]

#: The two all-reduce sizes that measure the link (bytes), and timed repetitions of each (of
#: each codec's encode + decode too). The small one is 1 KB, so that its time is the
#: per-message latency: a 16 KB probe, 1.3 ms of bytes at 100 Mbit/s, passed a token-bucket
#: shaper's burst faster than the line through it allows, and the fitted latency came out 0
#: in 6 of 7 runs at 100 Mbit/s (0.4-1.2 ms at 1 and 10 Gbit/s; benchmarks/RESULTS.md, stop
#: 17), blinding the search to what more, smaller messages cost.
PROBE_BYTES = (1 << 10, 4 << 20)
PROBE_REPEATS = 3


def _wait(request: Any, device: torch.device) -> None:
    request.wait()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_link(comm: Any, device: torch.device) -> list[float]:
    """This rank's best time of an all-reduce of each :data:`PROBE_BYTES` size (seconds),
    then the process's CPU time per small all-reduce (every thread's: the call, the
    communication library's threads and the kernel's; the mean over the repetitions) and
    what a large one took beyond it: ``[small s, large s, small CPU s, large CPU s - small
    CPU s]``. The difference is this rank's own, so that the slowest rank's figure of each
    (the ranks agree on the largest) is one rank's: the largest small and the largest large
    CPU came from different ranks in a 3-rank run and left nothing per byte."""
    times, cpu = [], []
    for nbytes in PROBE_BYTES:
        buffer = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
        _wait(allreduce(comm, buffer), device)  # connections and buffers warm
        best = math.inf
        began = time.process_time()
        for _ in range(PROBE_REPEATS):
            start = time.perf_counter()
            _wait(allreduce(comm, buffer), device)
            best = min(best, time.perf_counter() - start)
        cpu.append((time.process_time() - began) / PROBE_REPEATS)
        times.append(best)
    return [*times, cpu[0], cpu[1] - cpu[0]]


def measure_codec(spec: str, params: Sequence[torch.nn.Parameter],
                  min_numel: int) -> tuple[int, float]:
    """``(payload bytes, seconds)`` of encoding and decoding tensors shaped like ``params``
    with codec ``spec`` (tensors below ``min_numel`` travel exact: their raw bytes).

    Each tensor's time is the best of :data:`PROBE_REPEATS` runs, as for the link: on a
    shared machine one run can take many times its usual time (a 1.3 MB ``cast:bf16`` once
    took 4 ms against 0.15 ms for a table twice its size), and one such spike in a layer's
    single timing would price its codec out."""
    codec = make_codec(spec)
    payload, seconds = 0, 0.0
    for param in params:
        raw = param.numel() * param.element_size()
        if param.numel() < min_numel or not param.is_floating_point():
            payload += raw
            continue
        sample = param.detach().clone()
        codec.decode(*codec.encode(sample, CodecState()))  # lazy set-up out of the timing
        best = math.inf
        for _ in range(PROBE_REPEATS):
            start = time.perf_counter()
            sent, ctx = codec.encode(sample, CodecState())
            out = codec.decode(sent, ctx)
            if out.device.type == "cuda":
                torch.cuda.synchronize(out.device)
            best = min(best, time.perf_counter() - start)
        seconds += best
        payload += sum(t.numel() * t.element_size() for t in sent)
    return payload, seconds


def link_model(ranks: int, link: Sequence[float], device: torch.device) -> LinkModel:
    """The line through :func:`measure_link`'s two all-reduces, with their CPU: per
    collective (the small one's) and per byte beyond it (the large one's extra over the
    small one's), which compete with the compute only where the compute is on the CPU."""
    small_s, large_s, small_cpu, extra_cpu = link
    on_cpu = device.type == "cpu"
    per_byte = max(extra_cpu, 0.0) / (PROBE_BYTES[1] - PROBE_BYTES[0])
    return replace(LinkModel.fit(ranks, (PROBE_BYTES[0], small_s), (PROBE_BYTES[1], large_s)),
                   cpu_s_per_message=small_cpu if on_cpu else 0.0,
                   cpu_s_per_byte=per_byte if on_cpu else 0.0)


def codec_models(workload: Workload, specs: Sequence[str],
                 measured: Sequence[tuple[int, float]]) -> dict[str, dict[str, CodecModel]]:
    """Per layer and spec, the measured codec (``measured``: (payload bytes, seconds) per layer
    and spec, in that order); a codec that does not shrink a layer is left out for it."""
    models: dict[str, dict[str, CodecModel]] = {}
    for i, layer in enumerate(workload.layers):
        for j, spec in enumerate(specs):
            payload, seconds = measured[i * len(specs) + j]
            if layer.grad_bytes and 0 < payload < layer.grad_bytes:
                codec = make_codec(spec)
                models.setdefault(layer.name, {})[spec] = CodecModel(
                    name=spec, ratio=payload / layer.grad_bytes,
                    seconds_per_byte=seconds / layer.grad_bytes, summable=codec.summable,
                    multi_round=codec.multi_round, rounds=codec.rounds)
    return models
