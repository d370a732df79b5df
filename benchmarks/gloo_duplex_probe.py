"""torch gloo between two testbed hosts: point-to-point one way / both ways, and 16 MB collectives.

benchmarks/RESULTS.md §1 ("Bus bandwidth on the testbed"). Run, as root, one rank per host::

    scaleout testbed up --hosts 2 --rate 1gbit --name si1
    for h in 0 1; do ip netns exec so-si1-h$h env GLOO_SOCKET_IFNAME=so-eth0 \\
        MASTER_ADDR=10.213.0.1 MASTER_PORT=29533 RANK=$h WORLD_SIZE=2 OMP_NUM_THREADS=1 \\
        python3 benchmarks/gloo_duplex_probe.py & done; wait
    scaleout testbed down --name si1

Rank 0 prints the best of three of each (a barrier before each), in ms, and the mean of four
calls back to back (as ``bench collectives`` times them) for the two orders of posting a
send and a receive (docs/simulator.md, "Validation": gloo's recv-ready protocol).
"""

import datetime
import time

import torch
import torch.distributed as dist

N = 4 << 20  # floats: 16 MB


def best_ms(fn, reps: int = 3) -> float:
    dist.barrier()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        dist.barrier()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    peer = 1 - rank
    a, b = torch.ones(N), torch.empty(N)

    def both_ways() -> None:  # send posted first, as gloo's all-to-all and all-gather do
        for work in [dist.isend(a, peer), dist.irecv(b, peer)]:
            work.wait()

    def both_ways_recv_first() -> None:  # recv posted first, as gloo's all-reduce does
        for work in [dist.irecv(b, peer), dist.isend(a, peer)]:
            work.wait()

    def back_to_back(fn, calls: int = 4) -> float:  # ms per call, no barrier in between
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - start) / calls * 1e3

    results = {
        "send 16 MB one way": best_ms(lambda: dist.send(a, peer) if rank == 0 else dist.recv(b, peer)),
        "isend+irecv 16 MB both ways": best_ms(both_ways),
        "irecv+isend 16 MB both ways": best_ms(both_ways_recv_first),
        "isend+irecv x4 back to back": back_to_back(both_ways),
        "irecv+isend x4 back to back": back_to_back(both_ways_recv_first),
        "all_reduce 16 MB": best_ms(lambda: dist.all_reduce(a)),
        "all_gather_into_tensor 32 MB out": best_ms(
            lambda: dist.all_gather_into_tensor(torch.empty(2 * N), a)),
        "all_to_all_single 16 MB": best_ms(lambda: dist.all_to_all_single(b, a)),
    }
    if rank == 0:
        for name, ms in results.items():
            print(f"{name:34s} {ms:8.1f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
