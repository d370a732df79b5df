"""Codec benchmark: encode + decode time per codec against the memory-bandwidth limit,
beside torch's own DDP communication hooks on the same tensors.

For each size ``n`` (fp32 values, viewed as a ``rows x cols`` matrix as square as ``n``
allows) and each codec, :func:`run_codec_bench` times, as the median of ``repeats`` runs
after ``warmup`` untimed ones (CUDA events on a GPU, ``perf_counter`` on the CPU):

* ``encode_decode_s``: ``codec.encode`` then ``codec.decode`` (state kept across runs, as
  in training: error feedback, warm starts, reused buffers);
* ``exchange_s``: the codec's whole exchange (:func:`~scaleout.compression.compressed_allreduce`,
  every round) on a process group of two ranks, this process and a peer over loopback
  (:mod:`scaleout.bench.codecs_pair`: a world-size-1 group moves nothing, and scaleout's
  cast codec returns early there; ``exchange_ranks`` says which ran, ``exchange_alone`` why
  one), each timed run started with both ranks together; the peer's tensor is drawn from
  the next seed, as another rank's gradient;
* ``payload_bytes``, ``wire_bytes``, ``dense_bytes``, ``compression_ratio``, ``wire_ratio``:
  the exchange's bytes as its request counts them (:class:`~scaleout.compression.exchange.
  ExchangeStats`; the wire ratio is a dense ring all-reduce's bytes over the exchange's, on
  its group: ``None`` at world size 1, where nothing is sent);
* ``torch_s``: torch's hook for the same job on the same process group and tensor, where
  torch has one: ``fp16_compress_hook`` for ``cast:fp16``, ``powerSGD_hook`` (same rank,
  error feedback and warm start on, compressing from the first timed run) for ``powersgd``;
* ``host_syncs``, ``exchange_host_syncs``, ``torch_host_syncs`` (CUDA only): how many
  times one more encode + decode, exchange, or call of torch's hook made the host wait for
  the GPU;
* ``copy_s``: one device-to-device copy of the same fp32 bytes, the memory-bandwidth limit
  (timed before and after the codecs, the faster kept); every time is also given as a
  multiple of it (``*_x_copy``).

A codec that fails on either rank is reported with its error; the others go on.

Example:
    >>> report = run_codec_bench(CodecBenchConfig(device="cpu", sizes=(4096,), repeats=2))
    >>> report["results"][0]["codec"]                                  # doctest: +SKIP
    'none'
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from scaleout.bench.codecs_pair import Group, describe, exchange_group, join_as_peer, peer_device
from scaleout.core.checks import check_cuda_asked
from scaleout.core.collectives import Communicator
from scaleout.compression import CodecState, compressed_allreduce, make_codec
from scaleout.compression.powersgd import PowerSGDCodec

__all__ = ["DEFAULT_CODECS", "CodecBenchConfig", "matrix_shape", "run_codec_bench"]

DEFAULT_CODECS = ("none", "cast:fp16", "cast:bf16", "blockquant", "sign", "topk:ratio=0.01",
                  "powersgd:rank=4", "rows")


@dataclass(frozen=True, kw_only=True)
class CodecBenchConfig:
    """What ``scaleout bench codecs`` measures.

    Attributes:
        device: ``"cpu"`` or ``"cuda"`` (``"cuda:N"`` for one GPU).
        sizes: values (fp32) per tensor.
        codecs: codec specs.
        repeats: timed runs per measurement (the median is reported).
        warmup: untimed runs before them.
        seed: the tensors' seed (the peer rank's: the next one).
        ranks: ranks of the exchange's group: 2 (a peer process; 1 with a single GPU) or 1.

    Raises:
        ValueError: a bad device, size or count, an unknown codec, or CUDA unavailable.
    """

    device: str = "cpu"
    sizes: tuple[int, ...] = (1 << 20,)
    codecs: tuple[str, ...] = DEFAULT_CODECS
    repeats: int = 5
    warmup: int = 2
    seed: int = 0
    ranks: int = 2

    def __post_init__(self) -> None:
        try:
            device = torch.device(self.device)
        except RuntimeError as err:
            raise ValueError(f"device: expected 'cpu' or 'cuda', got {self.device!r}") from err
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device: expected 'cpu' or 'cuda', got {self.device!r}")
        check_cuda_asked(self.device)
        if not self.sizes or any(not isinstance(n, int) or n < 1 for n in self.sizes):
            raise ValueError(f"sizes: expected positive value counts, got {self.sizes!r}")
        if not self.codecs:
            raise ValueError("codecs: expected at least one codec spec")
        for spec in self.codecs:
            make_codec(spec)  # raises ValueError naming the valid codecs
        if self.ranks not in (1, 2):
            raise ValueError(f"ranks: expected 1 or 2, got {self.ranks!r}")
        for name, low in (("repeats", 1), ("warmup", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")


def matrix_shape(numel: int) -> tuple[int, int]:
    """The most nearly square ``(rows, cols)`` with ``rows * cols == numel``, rows <= cols.

    Example:
        >>> matrix_shape(26214400)
        (5120, 5120)
    """
    rows = math.isqrt(numel)
    while numel % rows:
        rows -= 1
    return rows, numel // rows


class _Timer:
    """Median seconds of a callable on one device, after a warm-up."""

    def __init__(self, device: torch.device, repeats: int, warmup: int) -> None:
        self._cuda = device.type == "cuda"
        self._repeats, self._warmup = repeats, warmup

    def __call__(self, run: Callable[[], object],
                 setup: Callable[[], object] | None = None) -> float:
        times = []
        for index in range(self._warmup + self._repeats):
            if setup is not None:
                setup()
            if self._cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                end.synchronize()
                elapsed = start.elapsed_time(end) / 1e3
            else:
                began = time.perf_counter()
                run()
                elapsed = time.perf_counter() - began
            if index >= self._warmup:
                times.append(elapsed)
        return float(statistics.median(times))


class _Bucket:
    """What torch's DDP hooks read of a ``GradBucket`` (which Python cannot construct)."""

    def __init__(self, buffer: torch.Tensor, shapes: list[tuple[int, ...]]) -> None:
        self._buffer = buffer
        self._grads, at = [], 0
        for shape in shapes:
            numel = math.prod(shape)
            self._grads.append(buffer[at:at + numel].view(shape))
            at += numel

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer.copy_(tensor)

    def gradients(self) -> list[torch.Tensor]:
        return self._grads

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True


def _torch_hook(spec: str) -> tuple[str, Callable[[_Bucket], Any]] | None:
    """torch's hook doing ``spec``'s job, as ``(name, bucket -> future)``, or ``None``."""
    codec = make_codec(spec)
    if spec.startswith("cast") and getattr(codec, "dtype", None) in ("fp16", "float16", "half"):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        return "fp16_compress_hook", lambda bucket: default_hooks.fp16_compress_hook(None, bucket)
    if isinstance(codec, PowerSGDCodec):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        # start_powerSGD_iter must be > 1 with error feedback / warm start; the warm-up
        # runs pass it, so every timed run compresses.
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=codec.rank, start_powerSGD_iter=2,
            min_compression_rate=1.0, use_error_feedback=codec.error_feedback,
            warm_start=codec.warm_start, random_seed=codec.seed)
        return (f"powerSGD_hook(rank={codec.rank})",
                lambda bucket: powerSGD_hook.powerSGD_hook(state, bucket))
    return None


def _measure(spec: str, x: torch.Tensor, timer: _Timer, group: Group) -> dict[str, Any]:
    """One codec on one tensor: encode + decode (rank 0), its exchange and torch's hook if
    any (every rank). Raises what failed on this rank, :class:`PeerFailed` on the other."""
    codec = make_codec(spec)
    row: dict[str, Any] = {"codec": spec}
    state = CodecState()

    def local() -> None:
        if group.lead:
            row["encode_decode_s"] = timer(lambda: codec.decode(*codec.encode(x, state)))
            if x.is_cuda:
                row["host_syncs"] = _host_syncs(lambda: codec.decode(*codec.encode(x, state)))

    group.phase(local)
    work, ex_state, comm = torch.empty_like(x), CodecState(), Communicator.of_group(name="bench")
    last: list[Any] = []

    def exchange() -> None:
        request = compressed_allreduce(codec, work, ex_state, comm, group=None)
        request.wait()
        last[:] = [request]

    def exchanges() -> None:
        row["exchange_s"] = timer(exchange, setup=lambda: (work.copy_(x), group.meet()))
        row.update(_bytes(last[0].stats))
        if x.is_cuda:  # one more, counting the times the host waited for the GPU
            work.copy_(x)
            row["exchange_host_syncs"] = _host_syncs(exchange)

    group.phase(exchanges)
    hook = _torch_hook(spec)
    if hook is not None:
        group.phase(lambda: _time_hook(hook, x, timer, group, row))
        row["ours_over_torch"] = row["exchange_s"] / row["torch_s"]
    return row


def _bytes(stats: Any) -> dict[str, Any]:
    """An exchange's bytes (its request's ``stats``), ratios ``None`` where infinite."""
    def finite(value: float) -> float | None:
        return value if math.isfinite(value) else None

    return {"payload_bytes": stats.payload_bytes, "wire_bytes": stats.wire_bytes,
            "dense_bytes": stats.dense_bytes,
            "compression_ratio": finite(stats.compression_ratio),
            "wire_ratio": finite(stats.wire_ratio) if stats.wire_bytes else None}


def _time_hook(hook: tuple[str, Callable[[_Bucket], Any]], x: torch.Tensor, timer: _Timer,
               group: Group, row: dict[str, Any]) -> None:
    """torch's hook on ``x``: its time (and host syncs on CUDA) into ``row``."""
    name, call = hook
    buffer = torch.empty(x.numel(), dtype=x.dtype, device=x.device)
    bucket = _Bucket(buffer, [tuple(x.shape)])
    row["torch_hook"] = name
    for _ in range(2):  # past powerSGD_hook's start_powerSGD_iter, whatever the warm-up
        buffer.copy_(x.reshape(-1))
        call(bucket).wait()
    row["torch_s"] = timer(lambda: call(bucket).wait(),
                           setup=lambda: (buffer.copy_(x.reshape(-1)), group.meet()))
    if x.is_cuda:
        buffer.copy_(x.reshape(-1))
        row["torch_host_syncs"] = _host_syncs(lambda: call(bucket).wait())


def _host_syncs(run: Callable[[], object]) -> int:
    """How many synchronising CUDA calls ``run`` makes (``torch.cuda.set_sync_debug_mode``)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def _with_copy(row: dict[str, Any], numel: int, shape: tuple[int, int], copy_s: float) -> dict[str, Any]:
    """``row`` with its size, the copy's time and every time as a multiple of it."""
    out = {"codec": row["codec"], "numel": numel, "shape": list(shape), "copy_s": copy_s, **row}
    for key in ("encode_decode", "exchange", "torch"):
        if f"{key}_s" in row:
            out[f"{key}_x_copy"] = row[f"{key}_s"] / copy_s
    return out


def run_codec_bench(config: CodecBenchConfig,
                    progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Time every codec at every size; see the module doc for what each figure is.

    Args:
        config: what to measure.
        progress: called with a line after every measurement (e.g. ``print``).

    Returns:
        ``{"config": ..., "device_name": ..., "torch": ..., "exchange_ranks": ...,
        "results": [row, ...]}``; a row holds ``codec``, ``numel``, ``shape``, ``copy_s``
        and the figures, or ``error``.

    Raises:
        RuntimeError: the peer rank failed.
    """
    device = torch.device(config.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    peer = ["-m", "scaleout.bench.codecs", "--config", json.dumps(asdict(config)),
            "--device", str(peer_device(device)), "--threads", str(torch.get_num_threads())]
    with exchange_group(device, config.ranks, peer) as group:
        results = run_rank(config, group, progress)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"config": asdict(config), "device": str(device), "device_name": name,
            "torch": torch.__version__, "threads": torch.get_num_threads(), **describe(group),
            "results": results}


def run_rank(config: CodecBenchConfig, group: Group,
             progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Every rank's part of :func:`run_codec_bench`: the rows (rank 0's are the results)."""
    timer = _Timer(group.device, config.repeats, config.warmup)
    gen = torch.Generator().manual_seed(config.seed + group.rank)
    results = []
    for numel in config.sizes:
        shape = matrix_shape(numel)
        x = torch.randn(shape, generator=gen).to(group.device)
        target = torch.empty_like(x)
        copy_s = timer(lambda: target.copy_(x)) if group.lead else 0.0
        rows = []
        for spec in config.codecs:
            try:
                rows.append(_measure(spec, x, timer, group))
            except Exception as err:  # noqa: BLE001 - reported in its row, the rest go on
                rows.append({"codec": spec, "error": f"{type(err).__name__}: {err}"})
            if progress is not None:
                progress(_progress_line(rows[-1], numel))
        if group.lead:  # the copy again, after the codecs: the faster is nearer the limit
            copy_s = min(copy_s, timer(lambda: target.copy_(x)))
            results += [_with_copy(row, numel, shape, copy_s) for row in rows]
        x = target = torch.empty(0)  # (this size's tensors freed before the next's)
    return results


def _progress_line(row: dict[str, Any], numel: int) -> str:
    if "error" in row:
        return f"{row['codec']:>18} {numel:>10}  failed: {row['error']}"
    return (f"{row['codec']:>18} {numel:>10}  encode+decode {row['encode_decode_s'] * 1e3:8.3f} ms, "
            f"exchange {row['exchange_s'] * 1e3:8.3f} ms")


def _peer_main(argv: list[str] | None = None) -> None:
    """The peer rank (:mod:`scaleout.bench.codecs_pair`): the same program, nothing reported."""
    parser = argparse.ArgumentParser(description="peer rank of `scaleout bench codecs`")
    parser.add_argument("--config", required=True, help="CodecBenchConfig as JSON")
    parser.add_argument("--device", required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    fields = json.loads(args.config)
    config = CodecBenchConfig(**{k: tuple(v) if isinstance(v, list) else v
                                 for k, v in fields.items()})
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    import torch.distributed as tdist

    group = join_as_peer(device, args.port)
    try:
        run_rank(config, group)
    finally:
        tdist.destroy_process_group()


if __name__ == "__main__":
    _peer_main()
