"""CPU seconds per MB of each codec's whole exchange, on this machine (not a collective run).

``scaleout.sim.config.CODECS`` charges a codec its CPU work per input byte. This measures it
the way ``scaleout bench codecs`` times the exchange (``compressed_allreduce`` on a
world-size-1 gloo group: encode, the codec's rounds, decode; no network), but as the
process's CPU time rather than wall time, so that other load on the machine does not count:
on a 2-core machine shared with other work the wall time reads ~2x the CPU time, and the
simulator already shares the cores between compute and this work (processor sharing). One
thread, ResNet-18's 11.2M gradient values by default, median of the timed runs. Run::

    PYTHONPATH=src python3 benchmarks/codec_cpu_probe.py [VALUES] [REPEATS]
"""

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as tdist

from scaleout.compression import compressed_allreduce, make_codec
from scaleout.compression.state import CodecState
from scaleout.core.communicator import Communicator

CODECS = ("none", "cast:fp16", "blockquant", "sign", "topk:ratio=0.01", "powersgd:rank=2")


def main(numel: int = 11_176_512, repeats: int = 7, warmup: int = 2) -> None:
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1,
                             timeout=timedelta(seconds=120))
    x = torch.randn(numel)
    mb = numel * 4 / 2**20
    for spec in CODECS:
        codec, work, state = make_codec(spec), torch.empty_like(x), CodecState()
        comm = Communicator.of_group(name="probe")
        wall, cpu = [], []
        for index in range(warmup + repeats):
            work.copy_(x)
            began, began_cpu = time.perf_counter(), time.process_time()
            compressed_allreduce(codec, work, state, comm, group=None).wait()
            if index >= warmup:
                wall.append(time.perf_counter() - began)
                cpu.append(time.process_time() - began_cpu)
        wall.sort(), cpu.sort()
        w, c = wall[len(wall) // 2], cpu[len(cpu) // 2]
        print(f"{spec:16s} {mb:6.2f} MB  wall {w * 1e3:7.1f} ms  cpu {c * 1e3:7.1f} ms  "
              f"cpu {c * 1e3 / mb:.2f} ms/MB", flush=True)
    tdist.destroy_process_group()


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
