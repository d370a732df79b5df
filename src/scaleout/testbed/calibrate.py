"""Measure what a testbed delivers: gloo allreduce bandwidth and latency, TCP RTT.

One rank per host (the first ``ranks`` hosts), plain ``torch.distributed`` over gloo
bound to the testbed interface. Bus bandwidth follows the nccl-tests convention for
allreduce: ``busbw = bytes / time * 2 * (n - 1) / n`` (for 2 ranks it equals the
algorithm bandwidth ``bytes / time``), compared with the configured link rate.

From Python::

    with Testbed(TestbedConfig(hosts=2, rate="1gbit")) as tb:
        result = calibrate(tb, nbytes=64 << 20)
        print(result.busbw_ratio)      # ~0.98

As a worker (what :func:`calibrate` starts inside each host)::

    python -m scaleout.testbed.calibrate --rank 0 --world 2 \
        --init tcp://10.213.0.1:41234 --nbytes 67108864 --iters 5
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta

from scaleout.testbed.errors import TestbedError
from scaleout.testbed.testbed import Testbed

__all__ = ["CalibrationResult", "calibrate", "check_sizes", "main"]


@dataclass(frozen=True, kw_only=True)
class CalibrationResult:
    """What one calibration run measured.

    Attributes:
        ranks: number of ranks (one per host).
        rate_bps: configured link rate per direction, bit/s.
        delay_s: configured one-way added latency.
        nbytes: allreduce size for the bandwidth measurement.
        busbw_bps: per-iteration bus bandwidth, bit/s, in run order.
        small_allreduce_s: median time of a 4-byte allreduce.
        tcp_rtt_s: median round trip of a 1-byte TCP ping-pong, host 0 <-> host 1
            (``0.0`` with one rank).
    """

    ranks: int
    rate_bps: int
    delay_s: float
    nbytes: int
    busbw_bps: tuple[float, ...]
    small_allreduce_s: float
    tcp_rtt_s: float

    @property
    def busbw_median_bps(self) -> float:
        """Median bus bandwidth over the iterations, bit/s."""
        return statistics.median(self.busbw_bps)

    @property
    def busbw_ratio(self) -> float:
        """Median bus bandwidth over the configured rate (1.0 = at line rate)."""
        return self.busbw_median_bps / self.rate_bps

    @property
    def busbw_spread(self) -> float:
        """(max - min) / median of the per-iteration bus bandwidths."""
        return (max(self.busbw_bps) - min(self.busbw_bps)) / self.busbw_median_bps

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready dict, derived figures included."""
        data = asdict(self)
        data["busbw_bps"] = list(self.busbw_bps)
        data.update(
            busbw_median_bps=self.busbw_median_bps,
            busbw_ratio=self.busbw_ratio,
            busbw_spread=self.busbw_spread,
        )
        return data


def calibrate(
    testbed: Testbed,
    *,
    ranks: int = 2,
    nbytes: int = 64 << 20,
    iters: int = 5,
    warmup: int = 1,
    latency_iters: int = 200,
    timeout_s: float = 120.0,
) -> CalibrationResult:
    """Run the calibration workers inside the first ``ranks`` hosts of ``testbed``.

    Args:
        testbed: an up testbed.
        ranks: ranks to run, one per host: 2 (a lone rank sends nothing over a link) up
            to the number of hosts.
        nbytes: allreduce size (float32 elements, rounded down) for bandwidth.
        iters: timed large allreduces.
        warmup: untimed large allreduces first (TCP slow start, connection setup).
        latency_iters: timed small allreduces and TCP ping-pongs.
        timeout_s: limit for the whole run; ranks are killed past it.

    Returns:
        The measurements (from rank 0).

    Raises:
        ValueError: ``ranks`` out of range, or sizes not positive.
        TestbedError: a rank failed or timed out (message holds its output).
    """
    hosts = testbed.hosts
    if not 2 <= ranks <= len(hosts):
        raise ValueError(f"ranks: expected 2 to {len(hosts)} (one per host; a lone rank's "
                         f"allreduce crosses no link, its bus bandwidth is 0), got {ranks}")
    check_sizes(nbytes=nbytes, iters=iters, warmup=warmup, latency_iters=latency_iters)
    port = testbed.free_port(0)
    init = f"tcp://{testbed.master_addr}:{port}"
    procs = []
    for rank in range(ranks):
        host = hosts[rank]
        argv = host.command([
            sys.executable, "-m", "scaleout.testbed.calibrate",
            "--rank", str(rank), "--world", str(ranks), "--init", init,
            "--nbytes", str(nbytes), "--iters", str(iters), "--warmup", str(warmup),
            "--latency-iters", str(latency_iters), "--timeout", str(timeout_s),
            "--addr", host.address, "--peer", hosts[min(1, ranks - 1)].address,
        ])
        env = {**os.environ, **host.env(master_port=port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = _collect(procs, timeout_s)
    failed = [(r, p.returncode, err) for r, (p, (_, err)) in enumerate(zip(procs, outputs)) if p.returncode != 0]
    if failed:
        detail = "; ".join(f"rank {r} exit {rc}: {err.strip()[-800:]}" for r, rc, err in failed)
        raise TestbedError(f"calibration on testbed {testbed.config.name!r} failed: {detail}")
    data = json.loads(outputs[0][0].strip().splitlines()[-1])
    cfg = testbed.config
    return CalibrationResult(
        ranks=ranks,
        rate_bps=cfg.rate_bps,
        delay_s=cfg.delay_s,
        nbytes=data["nbytes"],
        busbw_bps=tuple(data["busbw_bps"]),
        small_allreduce_s=data["small_allreduce_s"],
        tcp_rtt_s=data["tcp_rtt_s"],
    )


def check_sizes(*, nbytes: int | None, iters: int, warmup: int = 1,
                latency_iters: int = 200) -> None:
    """Check :func:`calibrate`'s sizes (``nbytes`` ``None``: not chosen yet, nothing to check).

    Raises:
        ValueError: ``nbytes`` < 4 (one float32), ``iters`` < 1, ``warmup`` < 0 or
            ``latency_iters`` < 1.
    """
    if (nbytes is not None and nbytes < 4) or iters < 1 or warmup < 0 or latency_iters < 1:
        raise ValueError(
            f"expected nbytes >= 4, iters >= 1, warmup >= 0, latency_iters >= 1; got "
            f"nbytes={nbytes}, iters={iters}, warmup={warmup}, latency_iters={latency_iters}"
        )


def _collect(procs: list[subprocess.Popen[str]], timeout_s: float) -> list[tuple[str, str]]:
    deadline = time.monotonic() + timeout_s
    outputs = []
    for rank, proc in enumerate(procs):
        try:
            outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired as err:
            for other in procs:
                other.kill()
            for other in procs:
                other.communicate()
            raise TestbedError(f"calibration rank {rank} timed out after {timeout_s:g} s") from err
    return outputs


# -- worker (runs inside a host namespace) ---------------------------------------


def _worker(args: argparse.Namespace) -> dict[str, object]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group(
        "gloo", init_method=args.init, rank=args.rank, world_size=args.world, timeout=timeout
    )
    try:
        n = args.world
        big = torch.ones(args.nbytes // 4, dtype=torch.float32)
        nbytes = big.numel() * 4
        busbw = []
        for i in range(args.warmup + args.iters):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(big)
            elapsed = time.perf_counter() - start
            if i >= args.warmup:
                busbw.append(nbytes * 8 / elapsed * 2 * (n - 1) / n)
        small = torch.ones(1, dtype=torch.float32)
        times = []
        dist.barrier()
        for _ in range(args.latency_iters):
            start = time.perf_counter()
            dist.all_reduce(small)
            times.append(time.perf_counter() - start)
        rtt = _tcp_rtt(args, n) if n > 1 else 0.0
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return {
        "nbytes": nbytes,
        "busbw_bps": busbw,
        "small_allreduce_s": statistics.median(times),
        "tcp_rtt_s": rtt,
    }


def _tcp_rtt(args: argparse.Namespace, world: int) -> float:
    """Median 1-byte TCP round trip between ranks 0 and 1 (others just wait)."""
    import torch
    import torch.distributed as dist

    rank, count = args.rank, args.latency_iters
    server = None
    port = torch.zeros(1, dtype=torch.int64)  # a tensor, never a pickle on the wire
    if rank == 1:
        server = socket.create_server((args.addr, 0))
        port[0] = server.getsockname()[1]
    dist.broadcast(port, src=1)
    rtts: list[float] = []
    if rank == 1 and server is not None:
        conn, _ = server.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn, server:
            for _ in range(count + 10):
                conn.sendall(conn.recv(1))
    elif rank == 0:
        with socket.create_connection((args.peer, int(port.item()))) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for i in range(count + 10):
                start = time.perf_counter()
                conn.sendall(b"x")
                conn.recv(1)
                if i >= 10:
                    rtts.append(time.perf_counter() - start)
    return statistics.median(rtts) if rtts else 0.0


def main(argv: Sequence[str] | None = None) -> int:
    """Worker entry point: ``python -m scaleout.testbed.calibrate --rank R ...``."""
    parser = argparse.ArgumentParser(prog="python -m scaleout.testbed.calibrate")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--init", required=True, help="tcp://ADDR:PORT of rank 0")
    parser.add_argument("--nbytes", type=int, default=64 << 20)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--latency-iters", type=int, default=200)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--addr", default="", help="this host's testbed address")
    parser.add_argument("--peer", default="", help="host 1's testbed address (TCP ping)")
    args = parser.parse_args(argv)
    result = _worker(args)
    if args.rank == 0:
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
