"""Published scaling results, predicted from first principles (no per-scenario constants).

Every scenario uses only the model table (:mod:`scaleout.sim.models`), a device's sustained
rate from :data:`~scaleout.sim.models.DEVICES`, a network preset
(:data:`~scaleout.sim.network.PRESETS`) and the collective algorithm and fusion the
publication's software used. Each one's assumptions are stated beside it; none is adjusted to
bring its own prediction closer (docs/simulator.md keeps the record of what was assumed
before the first run). Sources: REFERENCES.md §2.
"""

from __future__ import annotations

from types import MappingProxyType

from scaleout.scheduler.config import SchedulerConfig
from scaleout.sim.config import IterationConfig
from scaleout.sim.models import DEVICES, Device, model, model_workload
from scaleout.sim.network import Topology, parse_topology, preset
from scaleout.sim.scaling import relative_efficiency
from scaleout.sim.themis import themis_gain
from scaleout.sim.validation import Scenario

__all__ = [
    "GOYAL_BACKPROP_S",
    "P100_TF_IMAGES_PER_S",
    "THEMIS_SYSTEMS",
    "goyal_p100",
    "p100_measured",
    "published_scenarios",
    "themis_mean_gain",
    "themis_topology",
]

MB = 1 << 20
BOUND_POINTS = 3.0

# One P100 training alone in TensorFlow's tf_cnn_benchmarks, synthetic ImageNet, batch 64, sgd
# (images/s): tensorflow/docs_src/performance/benchmarks.md, "Details for NVIDIA DGX-1 (NVIDIA
# Tesla P100)", May 2017, CUDA 8 / cuDNN 5.1, the "1 GPU" row. Assumed: Horovod's runs used the
# same benchmark (its benchmark instructions run tf_cnn_benchmarks) on P100s as fast as the
# DGX-1's SXM2 ones (a PCIe P100 is clocked ~12% lower). A single device's rate differs per model (cuDNN's Winograd / FFT 3x3
# convolutions do fewer multiplies than the layer's nominal FLOPs: VGG-16 reads 14.3 TFLOP/s
# "nominal", above the P100's 10.6 peak), so one FLOP/s figure for every model is wrong.
P100_TF_IMAGES_PER_S = MappingProxyType(
    {"inception_v3": 142.0, "resnet50": 219.0, "resnet152": 91.8, "vgg16": 154.0}
)


def p100_measured(name: str) -> Device:
    """A P100 whose rate on model ``name`` is the measured single-GPU throughput above.

    The rate is images/s x 3 x the table's forward FLOPs (forward + 2 x backward), so one
    image costs exactly ``1 / images_per_s``. ResNet-101 is not in the benchmark table: its
    rate per FLOP is interpolated linearly in forward FLOPs between ResNet-50's and ResNet-152's
    (an assumption; the two measured rates differ by 18%).

    Raises:
        ValueError: a model that is neither measured nor ResNet-101.
    """
    def rate(m: str) -> float:
        return P100_TF_IMAGES_PER_S[m] * 3 * model(m).flops

    if name in P100_TF_IMAGES_PER_S:
        flops = rate(name)
    elif name == "resnet101":
        lo, hi = model("resnet50").flops, model("resnet152").flops
        w = (model(name).flops - lo) / (hi - lo)
        flops = (1 - w) * rate("resnet50") + w * rate("resnet152")
    else:
        raise ValueError(f"no measured P100 rate for {name!r}")
    return Device(name=f"p100-tf:{name}", flops=flops,
                  source="tf_cnn_benchmarks, 1 x P100 (DGX-1), batch 64, May 2017")


# Goyal et al. 2017, §4 ("Communication"): "backprop for ResNet-50 on a single NVIDIA P100 GPU
# takes 120 ms" (their per-GPU batch, 32 images); a single-GPU figure, not one of the scaling
# runs. Forward is taken as half the backward, as in the model table.
GOYAL_BACKPROP_S = 0.120


def goyal_p100() -> Device:
    """A P100 whose ResNet-50 backward of 32 images takes :data:`GOYAL_BACKPROP_S`."""
    return Device(
        name="p100-caffe2",
        flops=32 * 2 * model("resnet50").flops / GOYAL_BACKPROP_S,
        source="Goyal et al. 2017 §4: ResNet-50 backprop on one P100 takes 120 ms",
    )


# Themis's six evaluation systems as its artifact runs them: ASTRA-sim's analytical backend,
# themis_inputs/script/allreduce_themis.sh (github.com/aakash-sharma/astra-sim, commit 97c7392,
# an ASTRA-sim fork carrying the Themis inputs; the same table in its run_DDL_themis script):
# units per dimension, links per NPU x GB/s per link (the command line's values, which
# override the JSON files'), 1 ns per link; topology per dimension from the system's name.
THEMIS_SYSTEMS = (
    ("2d_switch", "16x64", (6, 1), (25, 100), ("switch", "switch")),
    ("3d_switch_homo", "16x8x8", (4, 4, 1), (25, 25, 100), ("switch",) * 3),
    ("3d_switch_hetero", "16x8x8", (8, 4, 1), (25, 25, 50), ("switch",) * 3),
    ("3d_fc_ring_switch", "8x16x8", (7, 4, 1), (25, 25, 50),
     ("fully_connected", "ring", "switch")),
    ("4d_ring_switch_switch_switch", "4x4x8x8", (2, 8, 4, 1), (125, 25, 25, 50),
     ("ring", "switch", "switch", "switch")),
    ("4d_ring_fc_ring_switch", "4x8x4x8", (2, 7, 6, 1), (187.5, 25, 25, 100),
     ("ring", "fully_connected", "ring", "switch")),
)
THEMIS_LINK_LATENCY = "1ns"


def themis_topology(name: str) -> Topology:
    """One of :data:`THEMIS_SYSTEMS` as a topology: a dimension's per-NPU bandwidth is its
    links per NPU times the bandwidth of one (ASTRA-sim's ``links-count`` x
    ``link-bandwidth``).

    Raises:
        ValueError: a name not in :data:`THEMIS_SYSTEMS`.
    """
    for system, spec, links, per_link, kinds in THEMIS_SYSTEMS:
        if system == name:
            bandwidths = [f"{n * gbs}GB/s" for n, gbs in zip(links, per_link)]
            return parse_topology(spec, bandwidths=bandwidths, latencies=THEMIS_LINK_LATENCY,
                                  kinds=list(kinds))
    raise ValueError(f"unknown Themis system {name!r}; known: "
                     f"{', '.join(s[0] for s in THEMIS_SYSTEMS)}")


def themis_mean_gain(nbytes: int = 1 << 30, chunks: int = 64) -> float:
    """Mean all-reduce time gain of Themis over the fixed order on :data:`THEMIS_SYSTEMS`."""
    gains = [themis_gain(themis_topology(system[0]), nbytes=nbytes, chunks=chunks)[0]
             for system in THEMIS_SYSTEMS]
    return sum(gains) / len(gains)


def _efficiency(
    name: str,
    device: str | Device,
    batch: int,
    network: str,
    base: int,
    target: int,
    config: IterationConfig,
) -> float:
    rate = DEVICES[device] if isinstance(device, str) else device
    workload = model_workload(name, device=rate, batch_size=batch)
    return 100.0 * relative_efficiency(workload, preset(network).topology, base, target, config)


def published_scenarios() -> tuple[Scenario, ...]:
    """The published points of REFERENCES.md §2 with their assumptions."""
    horovod = IterationConfig(
        mode="sync",
        algorithm="ring",
        flat=True,
        scheduler=SchedulerConfig(policy="fifo", bucket_bytes=64 * MB, first_bucket_bytes=64 * MB),
    )
    gloo = IterationConfig(  # Caffe2 + Gloo: one all-reduce per gradient, no fusion
        mode="sync",
        algorithm=("ring", "halving_doubling"),
        scheduler=SchedulerConfig(policy="fifo", bucket_bytes=0, first_bucket_bytes=0),
    )
    mlsl = IterationConfig(
        mode="sync",
        algorithm="halving_doubling",
        scheduler=SchedulerConfig(policy="fifo", bucket_bytes=0, first_bucket_bytes=0),
    )
    horovod_note = (
        "P100 at its measured tf_cnn_benchmarks rate for the model (P100_TF_IMAGES_PER_S: "
        "VGG-16 154, Inception V3 142 images/s; ResNet-101 interpolated between ResNet-50 and "
        "-152); 64 images/GPU; preset "
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
            predict=lambda m=spec: _efficiency(
                m, p100_measured(m), 64, "horovod-pascal", 1, 512, horovod
            ),
        )
        for name, spec, measured in (
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
                "P100 backprop of 32 images in 120 ms (the paper's own figure), forward half "
                "that; 32 images/GPU; preset goyal-bigbasin (8 P100 on NVLink ring ~20 GB/s x "
                "32 servers, one 50 Gbit/s Ethernet card per server: 6.25 Gbit/s per GPU, "
                "5 us/hop); Gloo: reduce in a server, recursive halving-doubling across; one "
                "all-reduce per gradient blob as backprop produces it (Caffe2 "
                "data_parallel_model), FIFO; synchronous step; efficiency = T(8) / T(256)"
            ),
            predict=lambda: _efficiency(
                "resnet50", goyal_p100(), 32, "goyal-bigbasin", 8, 256, gloo
            ),
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
                "1 GiB all-reduce in 64 chunks, ring per dimension, one active chunk per "
                "dimension; baseline: fixed order, FIFO dimensions; Themis: least-loaded "
                "order, smallest-chunk-first dimensions (ASTRA-sim's SCF); mean over Themis's "
                "six evaluation systems as its artifact's allreduce_themis.sh runs them "
                "(THEMIS_SYSTEMS: units, links x GB/s per link, 1 ns per link; "
                "github.com/aakash-sharma/astra-sim themis_inputs), "
                "gain = fixed-order time / Themis time"
            ),
            predict=themis_mean_gain,
        )
    )
    return tuple(out)
