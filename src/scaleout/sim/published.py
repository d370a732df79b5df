"""Published scaling results, predicted from first principles (no per-scenario constants).

Every scenario uses only the model table (:mod:`scaleout.sim.models`), a device's sustained
rate from :data:`~scaleout.sim.models.DEVICES`, a network preset
(:data:`~scaleout.sim.network.PRESETS`) and the collective algorithm and fusion the
publication's software used. Each one's assumptions are stated beside it; none is adjusted to
bring its own prediction closer (docs/simulator.md keeps the record of what was assumed
before the first run). Sources: REFERENCES.md §2.
"""

from __future__ import annotations

from scaleout.scheduler.config import SchedulerConfig
from scaleout.sim.config import IterationConfig
from scaleout.sim.models import DEVICES, model_workload
from scaleout.sim.network import parse_topology, preset
from scaleout.sim.scaling import relative_efficiency
from scaleout.sim.themis import themis_gain
from scaleout.sim.validation import Scenario

__all__ = ["THEMIS_TOPOLOGIES", "published_scenarios", "themis_mean_gain"]

MB = 1 << 20
BOUND_POINTS = 3.0

# Stand-ins for Themis's multi-dimensional evaluation networks (the paper's exact per-dimension
# bandwidths are not in REFERENCES.md): fast local dimensions, slower outer ones.
THEMIS_TOPOLOGIES = (
    ("16x16", ["100GB/s", "100GB/s"], ["ring", "ring"]),
    ("4x8x8", ["200GB/s", "100GB/s", "50GB/s"], ["ring", "fully_connected", "switch"]),
    (
        "4x4x4x8",
        ["250GB/s", "200GB/s", "100GB/s", "50GB/s"],
        ["ring", "fully_connected", "ring", "switch"],
    ),
)


def themis_mean_gain(nbytes: int = 1 << 30, chunks: int = 64) -> float:
    """Mean all-reduce time gain of Themis over the fixed order on :data:`THEMIS_TOPOLOGIES`."""
    gains = [
        themis_gain(
            parse_topology(spec, bandwidths=bws, latencies="500ns", kinds=kinds),
            nbytes=nbytes,
            chunks=chunks,
        )[0]
        for spec, bws, kinds in THEMIS_TOPOLOGIES
    ]
    return sum(gains) / len(gains)


def _efficiency(
    model: str,
    device: str,
    batch: int,
    network: str,
    base: int,
    target: int,
    config: IterationConfig,
) -> float:
    workload = model_workload(model, device=DEVICES[device], batch_size=batch)
    return 100.0 * relative_efficiency(workload, preset(network).topology, base, target, config)


def published_scenarios() -> tuple[Scenario, ...]:
    """The published points of REFERENCES.md §2 with their assumptions."""
    horovod = IterationConfig(
        mode="sync",
        algorithm="ring",
        flat=True,
        scheduler=SchedulerConfig(policy="fifo", bucket_bytes=64 * MB, first_bucket_bytes=64 * MB),
    )
    gloo = IterationConfig(
        mode="sync",
        algorithm=("ring", "halving_doubling"),
        scheduler=SchedulerConfig(policy="fifo", bucket_bytes=25 * MB, first_bucket_bytes=1 * MB),
    )
    mlsl = IterationConfig(
        mode="sync",
        algorithm="halving_doubling",
        scheduler=SchedulerConfig(policy="fifo", bucket_bytes=0, first_bucket_bytes=0),
    )
    horovod_note = (
        "P100 at 5.4 TFLOP/s sustained (DEVICES['p100']); 64 images/GPU; preset "
        "horovod-pascal (4 GPUs on PCIe ~10 GB/s x 128 servers on 25 Gbit/s RoCE "
        "switch, 5 us/hop); NCCL2 flat ring over all 512 GPUs; Horovod tensor fusion "
        "64 MB, FIFO; allreduce overlaps backward only (TF synchronous step); "
        "efficiency = T(1 GPU) / T(512 GPUs)"
    )
    out = [
        Scenario(
            name=f"horovod {name} 512 GPUs",
            group="published",
            measured=measured,
            unit="%",
            bound=BOUND_POINTS,
            assumptions=horovod_note,
            source="Horovod (Sergeev & Del Balso 2018): 128 servers x 4 Pascal, 25 Gbit/s RoCE",
            predict=lambda m=model: _efficiency(m, "p100", 64, "horovod-pascal", 1, 512, horovod),
        )
        for name, model, measured in (
            ("resnet101", "resnet101", 90.0),
            ("inception_v3", "inception_v3", 90.0),
            ("vgg16", "vgg16", 68.0),
        )
    ]
    out.append(
        Scenario(
            name="goyal resnet50 8->256 GPUs",
            group="published",
            measured=90.0,
            unit="%",
            bound=BOUND_POINTS,
            source="Goyal et al. 2017 (ImageNet in 1 hour), ~90% from 8 to 256 GPUs",
            assumptions=(
                "P100 at 5.4 TFLOP/s; 32 images/GPU; preset goyal-bigbasin (8 P100 on NVLink "
                "ring ~20 GB/s x 32 servers on 50 Gbit/s Ethernet, 5 us/hop); Gloo: ring in a "
                "server, recursive halving-doubling across; 25 MB buckets, FIFO, overlap with "
                "backward only; efficiency = T(8) / T(256)"
            ),
            predict=lambda: _efficiency("resnet50", "p100", 32, "goyal-bigbasin", 8, 256, gloo),
        )
    )
    for name, device, batch, network, measured, src in (
        (
            "mlsl knl resnet50 4->256",
            "xeon-phi-7250",
            16,
            "knl-omnipath",
            97.0,
            "Intel Caffe + MLSL on Xeon Phi 7250 + Omni-Path (seeds/003): 97% from 4 to 256 nodes",
        ),
        (
            "mlsl marenostrum4 resnet50 4->256",
            "xeon-8160x2",
            32,
            "marenostrum4",
            90.0,
            "Intel Caffe + MLSL on MareNostrum 4 (seeds/003): 90% (4 -> 256 nodes assumed)",
        ),
    ):
        out.append(
            Scenario(
                name=name,
                group="published",
                measured=measured,
                unit="%",
                bound=BOUND_POINTS,
                source=src,
                assumptions=(
                    f"{DEVICES[device].source}; {batch} images/node; preset {network} (one "
                    "Omni-Path 100 Gbit/s switch, 1 us/hop); MPI Rabenseifner all-reduce, one "
                    "per layer as its gradients are ready (MLSL StartGradientComm, no fusion), "
                    "FIFO; efficiency = T(4) / T(256)"
                ),
                predict=lambda d=device, b=batch, n=network: _efficiency(
                    "resnet50", d, b, n, 4, 256, mlsl
                ),
            )
        )
    out.append(
        Scenario(
            name="themis all-reduce utilisation gain",
            group="published",
            measured=1.72,
            unit="x",
            bound=0.03 * 1.72,
            source="Themis (ISCA'22): all-reduce bandwidth utilisation 1.72x on average",
            assumptions=(
                "1 GiB all-reduce in 64 chunks, ring per dimension, 500 ns/hop, one active chunk "
                "per dimension; mean over the stand-in topologies THEMIS_TOPOLOGIES (16x16 "
                "100/100 GB/s; 4x8x8 200/100/50 GB/s; 4x4x4x8 250/200/100/50 GB/s), "
                "gain = fixed-order time / Themis time"
            ),
            predict=themis_mean_gain,
        )
    )
    return tuple(out)
