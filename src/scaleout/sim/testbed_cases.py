"""This machine's testbed runs, predicted from single-rank numbers.

What is predicted: the iteration time of the 2-rank ``scaleout`` row (priority policy,
cross-iteration overlap) and ``ddp`` row (FIFO, 25 MB buckets, synchronous step) of each
table of stop 24's re-measurement (three workloads x 100 Mbit/s, 1 Gbit/s, 10 Gbit/s: 18
scenarios; ``benchmarks/results/stop24/testbed/*.json``, main's code on a quiet machine,
commands in benchmarks/RESULTS.md), and the ``scaleout+blockquant`` row of the 100 Mbit/s and
1 Gbit/s tables (6 more), whose codec is ``CODECS["blockquant"]`` (its bytes on the wire also
count for the CPU-per-MB charge, and its own CPU, measured by
``benchmarks/codec_cpu_probe.py``, is charged on the compute's cores the same way). Until
stop 24 the rows were stop 7's tables (RESULTS.md §3), of code since rebuilt, on a machine
whose ResNet-18 then took 0.73 s per iteration alone (1.6-1.7 s at stop 24). Since stop 31
also the ``scaleout`` and ``ddp`` rows of the same nine tables at 3 ranks (three hosts on the
two cores; ``benchmarks/results/stop31/testbed3/*.json``): 18 more, predicted with the model
unchanged, from the 3-rank link and CPU the probe measured and the 3-rank ``lockstep`` rows.
Since stop 34 also DLRM's ``scaleout`` rows with its tables row-sparse (stop 33's default on
the testbed; :data:`ROW_SPARSE_ROWS`, the tables' codec :func:`row_sparse`), run again at
stops 38 and 40 with the runtime as it now runs them (FIFO, early chunks, the row flags as
bits, the rows from the forward's ids). Since stop 41 also runs with a codec the user names,
from runs of their own (:data:`CODEC_ROWS`: ResNet-18 at 100 Mbit/s with PowerSGD).

What goes in, and nothing else:

* the ``single (1 rank)`` iteration time of the same table (a one-rank run), split over the
  layers, forward and backward, by the shares of a single-rank trace of the workload
  (``testbed_traces/<workload>.json``, recorded by ``benchmarks/record_single_trace.py``:
  one rank, one thread, DataParallel's per-layer timing; each sample the median over the
  iterations). Until stop 29 the split was the model table's FLOPs (1/3 forward, 2/3
  backward; DLRM as two stylised layers, half each), an assumption: the traces moved the
  median error from 4.9% to 3.6% with the same three rows over 15%, and were adopted after
  both results had been seen (docs/simulator.md);
* gradient bytes per layer: the table's MB/it (bytes / 1e6: ``BENCH_MB``; until stop 24 they
  were read as MiB, 4.9% too many) spread by the trace's per-layer gradient bytes;
* the link, measured on the testbed at each rate and rank count by
  ``benchmarks/lone_call_probe.py`` (:data:`LONE_CALLS`, ``stop35/lone-calls.json``; two runs
  per rate, no training; each figure the slower rank's, the median of the runs): the line
  through the median all-reduce of 1 KB and of 4 MiB called one at a time on idle ranks, as
  training calls a bucket's collective. Until stop 35 it was the line through the autotuner's
  own all-reduces of the same sizes (``scaleout.pytorch.tune_measure.measure_link``: the best
  of three called back to back), which at 3 ranks is a quarter of the median lone call
  (0.7 against 3-4 ms for 1 KB: docs/simulator.md, "Stop 35");
* the link's CPU, measured at each rate and rank count by ``benchmarks/host_cpu_probe.py``
  (``benchmarks/results/stop25/host-probe.json`` at 2 ranks, ``stop31/host-probe-3.json`` at 3;
  two runs per rate, no training; each figure is the slower rank's, the median of the runs,
  as the autotuner takes it): its CPU per collective (``host_s_per_message``),
  and the process's CPU time per byte of a bare 8 MB all-reduce beyond that
  (``host_s_per_byte``: gloo's threads and the kernel's TCP path, 0.82-1.39 ms per MB at 2
  ranks, 0.68-0.77 at 3). The simulator charges that CPU to the compute only for the share of
  a transfer that runs while the rank computes (processor sharing), and a transfer takes at
  least that CPU time (docs/simulator.md);
* one parameter per workload and rank count fitted on a stated training split, the ``lockstep``
  row of a 1 Gbit/s run of that workload at that many ranks (a run that trains no shared
  model, so none of the predicted rows): ranks sharing the two cores do their own work
  ``lockstep / single`` slower (:data:`SLOWDOWN`), the compute and (since stop 30) a codec's
  CPU alike. ResNet-18's comes from its stop 24 table; the DLRM's and the transformer's from
  stop 30's runs (``benchmarks/results/stop30/*-lockstep.json``), whose stop 24 tables have no
  lockstep row; the 3-rank figures from the 3-rank 1 Gbit/s tables (1.70, 1.66, 2.43: three
  ranks on two cores). Until stop 30 ResNet-18's figure (1.05) stood for all three workloads,
  and DLRM's compute, bound by memory, slows 1.69x beside another rank: its rows were 9-32%
  short. Until stop 25 a second parameter came from ResNet-18's run too, every MB moved
  costing ``(lockstep-traffic - lockstep) / MB`` of CPU (8.28 ms at stop 24; stop 7's split
  gave 3.89); the probe measures about a tenth of that, and the per-rate link it replaced was
  the ``tc`` rate x 0.98.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from importlib import resources
from types import MappingProxyType

from scaleout.scheduler.config import SchedulerConfig
from scaleout.sim.config import CodecModel, IterationConfig, codec_model
from scaleout.sim.iteration import simulate
from scaleout.sim.link import LinkModel
from scaleout.sim.trace import read_trace
from scaleout.sim.validation import Scenario
from scaleout.sim.workload import Layer, Workload

__all__ = [
    "BLOCKQUANT_ROWS",
    "CODEC_ROWS",
    "ROW_SPARSE_ROWS",
    "TESTBED_ROWS",
    "HOST_PROBE",
    "LONE_CALLS",
    "LONE_CALLS_FILES",
    "PROBE_FILES",
    "SLOWDOWN",
    "probed_link",
    "single_rank_trace",
    "testbed_workload",
    "testbed_scenarios",
]

MB = 1 << 20
BENCH_MB = 1e6  # the bench tables' "MB/it" (bench/train_report.py divides bytes by 1e6)
#: (workload, ranks) -> ``lockstep / single`` iteration ms of its 1 Gbit/s run at that many
#: ranks (the files named in the module docstring; tests/test_sim_testbed_probe.py derives them
#: again from the files)
SLOWDOWN = MappingProxyType({
    ("resnet18", 2): 1832.854 / 1743.427,  # stop24/testbed/resnet18-1gbit.json
    ("transformer", 2): 835.041 / 782.563,  # stop30/transformer-1gbit-lockstep.json
    ("dlrm", 2): 8.2516 / 4.8775,  # stop30/dlrm-1gbit-lockstep.json
    ("resnet18", 3): 2643.3315 / 1553.1134,  # stop31/testbed3/resnet18-1gbit.json
    ("transformer", 3): 1317.8782 / 794.6677,  # stop31/testbed3/transformer-1gbit.json
    ("dlrm", 3): 12.8809 / 5.3091,  # stop31/testbed3/dlrm-1gbit.json
})
#: ranks -> the probe's recorded runs on the testbed at that many ranks (under benchmarks/results)
PROBE_FILES = MappingProxyType({2: "stop25/host-probe.json", 3: "stop31/host-probe-3.json"})
#: (ranks, rate) -> (1 KB all-reduce s, 4 MiB all-reduce s, CPU s per collective, CPU ms per
#: MB of 1e6 bytes) from ``PROBE_FILES[ranks]`` (tests/test_sim_testbed_probe.py derives them
#: again from the files). The first two are the autotuner's link (the best of three calls
#: back to back), the testbed's until stop 35 (now :data:`LONE_CALLS`); the CPU figures stay.
HOST_PROBE = MappingProxyType({
    (2, "100mbit"): (0.611e-3, 338.408e-3, 1.221e-3, 1.388),
    (2, "1gbit"): (0.608e-3, 33.924e-3, 0.677e-3, 0.854),
    (2, "10gbit"): (0.878e-3, 5.365e-3, 1.600e-3, 0.820),
    (3, "100mbit"): (0.640e-3, 452.185e-3, 0.450e-3, 0.766),
    (3, "1gbit"): (0.726e-3, 45.221e-3, 0.476e-3, 0.677),
    (3, "10gbit"): (0.755e-3, 5.896e-3, 0.521e-3, 0.684),
})
PROBE_BYTES = (1 << 10, 4 << 20)  # scaleout.pytorch.tune_measure.PROBE_BYTES (a test checks)
#: ranks -> the lone-call probe's recorded runs on the testbed at that many ranks (under
#: benchmarks/results; ``PROBE=1 benchmarks/scaling.sh`` and ``probe_json.py`` make more)
LONE_CALLS_FILES = MappingProxyType({2: "stop35/lone-calls.json", 3: "stop35/lone-calls.json"})
#: (ranks, rate) -> (1 KB all-reduce s, 4 MiB all-reduce s): the median call of each size,
#: called one at a time on idle ranks, from :data:`LONE_CALLS_FILES` (the slower rank's figure
#: of each run, then the median of the runs; tests/test_sim_testbed_probe.py derives them
#: again from the file). The testbed's link since stop 35 (:func:`probed_link`).
LONE_CALLS = MappingProxyType({
    (2, "100mbit"): (1.526e-3, 337.154e-3),
    (2, "1gbit"): (0.763e-3, 34.253e-3),
    (2, "10gbit"): (0.803e-3, 5.830e-3),
    (3, "100mbit"): (3.709e-3, 452.670e-3),
    (3, "1gbit"): (3.637e-3, 45.434e-3),
    (3, "10gbit"): (3.835e-3, 8.209e-3),
})
RELATIVE_BOUND = 0.15  # issue 13: none above 15% (median <= 5% is checked by validate())

# (workload, ranks, rate, single ms, scaleout ms, ddp ms, MB/it, JSON under benchmarks/results)
TESTBED_ROWS = (
    ("resnet18", 2, "100mbit", 1724.1, 4056.8, 4497.1, 44.70, "stop24/testbed/resnet18-100mbit"),
    ("resnet18", 2, "1gbit", 1743.4, 1972.0, 2125.8, 44.70, "stop24/testbed/resnet18-1gbit"),
    ("resnet18", 2, "10gbit", 1599.1, 1801.2, 1768.0, 44.70, "stop24/testbed/resnet18-10gbit"),
    ("transformer", 2, "100mbit", 846.9, 2232.9, 2256.9, 16.96,
     "stop24/testbed/transformer-100mbit"),
    ("transformer", 2, "1gbit", 886.3, 1083.1, 1085.6, 16.96, "stop24/testbed/transformer-1gbit"),
    ("transformer", 2, "10gbit", 841.4, 944.3, 897.0, 16.96, "stop24/testbed/transformer-10gbit"),
    ("dlrm", 2, "100mbit", 7.1, 435.1, 432.8, 5.21, "stop24/testbed/dlrm-100mbit"),
    ("dlrm", 2, "1gbit", 6.4, 53.7, 53.1, 5.21, "stop24/testbed/dlrm-1gbit"),
    ("dlrm", 2, "10gbit", 6.1, 20.7, 17.0, 5.21, "stop24/testbed/dlrm-10gbit"),
    ("resnet18", 3, "100mbit", 1612.1, 6275.9, 5970.1, 44.70, "stop31/testbed3/resnet18-100mbit"),
    ("resnet18", 3, "1gbit", 1553.1, 2715.6, 2831.3, 44.70, "stop31/testbed3/resnet18-1gbit"),
    ("resnet18", 3, "10gbit", 1593.5, 2886.2, 2621.3, 44.70, "stop31/testbed3/resnet18-10gbit"),
    ("transformer", 3, "100mbit", 839.7, 3007.0, 3018.4, 16.96,
     "stop31/testbed3/transformer-100mbit"),
    ("transformer", 3, "1gbit", 794.7, 1388.0, 1457.8, 16.96, "stop31/testbed3/transformer-1gbit"),
    ("transformer", 3, "10gbit", 826.3, 1409.4, 1411.7, 16.96,
     "stop31/testbed3/transformer-10gbit"),
    ("dlrm", 3, "100mbit", 6.8, 590.7, 577.7, 5.21, "stop31/testbed3/dlrm-100mbit"),
    ("dlrm", 3, "1gbit", 5.3, 73.7, 69.8, 5.21, "stop31/testbed3/dlrm-1gbit"),
    ("dlrm", 3, "10gbit", 7.4, 36.0, 26.3, 5.21, "stop31/testbed3/dlrm-10gbit"),
)
# the 2-rank tables' scaleout+blockquant rows (iteration ms); blockquant is only at 100 Mbit/s
# and 1 Gbit/s there. Its CPU cost is CODECS["blockquant"]'s (the CPU time of its whole
# exchange on one thread, benchmarks/codec_cpu_probe.py).
BLOCKQUANT_ROWS = MappingProxyType(
    {
        ("resnet18", 2, "100mbit"): 1963.0,
        ("resnet18", 2, "1gbit"): 2039.7,
        ("transformer", 2, "100mbit"): 1191.3,
        ("transformer", 2, "1gbit"): 1038.3,
        ("dlrm", 2, "100mbit"): 134.1,
        ("dlrm", 2, "1gbit"): 36.3,
    }
)


# DLRM's tables row-sparse, scaleout's default on the CPU across machines since stop 33 (its
# ``scaleout`` rows): (workload, ranks, rate, single ms, scaleout ms, MB/it, JSON under
# benchmarks/results, row). The tables' codec is :func:`row_sparse`'s. Since stop 40 the runs
# of that stop: the exchange handed the forward's ids (stop 39) and its faster host steps
# (stop 40), the runtime's FIFO for this plan and its row flags as bits (both since stop 34).
# Stop 38's runs read 44.91 / 14.10 / 13.96 ms at 2 ranks and 30.30 ms at 3 (that stop's
# ``scaleout+rows:dense_above=0.9`` row: a codec the user names for every layer, whose
# exchange still searches for the rows, since the runtime hands the ids only to the tables it
# sends row-sparse itself); stop 33's, under priority with byte flags, 46.68 /
# 21.42 / 21.32 / 41.09 ms (benchmarks/RESULTS.md, stops 38 and 40).
ROW_SPARSE_ROWS = (
    ("dlrm", 2, "100mbit", 3.85, 44.35, 0.47, "stop40/rows/dlrm-100mbit", "scaleout"),
    ("dlrm", 2, "1gbit", 3.70, 12.57, 0.47, "stop40/rows/dlrm-1gbit", "scaleout"),
    ("dlrm", 2, "10gbit", 3.68, 11.86, 0.47, "stop40/rows/dlrm-10gbit", "scaleout"),
    ("dlrm", 3, "1gbit", 3.82, 27.18, 0.547, "stop40/rows/dlrm-3ranks-1gbit-rows", "scaleout"),
)
# scaleout with a codec the user names, from runs of their own: (workload, ranks, rate, single
# ms, scaleout ms, dense MB/it, JSON under benchmarks/results, row, codec). The codec is
# ``CODECS[codec]`` (its ratio and its CPU, x the workload's slowdown); the runtime of the run:
# the open policy (FIFO here: a compressed bucket travels whole, so the bulk lane has no
# bucket of several chunks). Stop 41's first run after PowerSGD's fewer passes, taken as the
# row before it was predicted (the second read 971.9 ms, single 854.9).
CODEC_ROWS = (
    ("resnet18", 2, "100mbit", 876.5, 1022.7, 44.70, "stop41/powersgd/after-resnet18-100mbit-1",
     "scaleout+powersgd:2", "powersgd:rank=2"),
)
DENSE_MB = {"dlrm": 5.21}  # the workload's gradient MB/it when sent whole (TESTBED_ROWS)
#: The rows codec's CPU per byte of the tables it reads: building the flags from the batch's
#: ids, both rounds and decode on a group of one, one thread (``benchmarks/rows_cpu_probe.py``,
#: "rows (ids)", stop 40: 0.133-0.147 ms/MiB in three runs). Until stop 40 0.15 ms/MiB, which
#: the probe had measured with the bucket passed as one 1-D tensor: the codec's copies of a
#: dense send, not a row-sparse exchange (which then cost 0.23-0.27 ms/MiB with ids, 0.39-0.43
#: searching).
ROWS_S_PER_BYTE = 0.142e-3 / MB


def row_sparse(workload: Workload, grad_mb: float, slowdown: float) -> dict[str, CodecModel]:
    """The ``rows`` codec of each embedding table (``embeddings.*``) of ``workload``: the bytes
    the tables moved (``grad_mb`` less the other layers' dense bytes) as one share of their
    dense bytes (the runtime sends a table that a batch reads nearly whole dense, and the
    others row-sparse: the share is their mean), two rounds (the row flags, then the rows),
    and its CPU, :data:`ROWS_S_PER_BYTE` x ``slowdown``."""
    tables = [lay for lay in workload.layers if lay.name.startswith("embeddings.")]
    table_bytes = sum(lay.grad_bytes for lay in tables)
    share = (grad_mb * BENCH_MB - (workload.grad_bytes - table_bytes)) / table_bytes
    codec = CodecModel(name="rows", ratio=share, seconds_per_byte=ROWS_S_PER_BYTE * slowdown,
                       multi_round=True, rounds=2)
    return {lay.name: codec for lay in tables}


@cache
def single_rank_trace(workload: str) -> Workload:
    """The recorded single-rank trace of ``workload`` (``resnet18``, ``transformer`` or
    ``dlrm``) that splits its testbed rows' time over the layers (read once: a
    :class:`Workload` is immutable)."""
    source = resources.files("scaleout.sim") / "testbed_traces" / f"{workload}.json"
    with resources.as_file(source) as path:
        return read_trace(path)


def testbed_workload(workload: str, single_ms: float, grad_mb: float,
                     ranks: int = 2) -> Workload:
    """One rank's layers for a testbed row: measured time (x the workload's ``SLOWDOWN`` at
    ``ranks`` ranks) and ``grad_mb`` split by the single-rank trace's per-layer shares
    (:func:`single_rank_trace`)."""
    trace = single_rank_trace(workload)
    scale = single_ms * SLOWDOWN[workload, ranks] / 1e3 / (trace.forward_s + trace.backward_s)
    return Workload(
        name=workload,
        layers=tuple(
            Layer(
                name=lay.name,
                forward_s=lay.forward_s * scale,
                backward_s=lay.backward_s * scale,
                grad_bytes=int(grad_mb * BENCH_MB * lay.grad_bytes / trace.grad_bytes),
            )
            for lay in trace.layers
        ),
    )


def probed_link(rate: str, ranks: int = 2) -> LinkModel:
    """The link of ``ranks`` ranks at ``rate``: the line through the median lone all-reduce of
    1 KB and 4 MiB on the testbed (:data:`LONE_CALLS`), with the CPU per collective and per
    byte (of a bare 8 MB all-reduce) the host probe measured (:data:`HOST_PROBE`)."""
    small, large = LONE_CALLS[ranks, rate]
    _, _, per_message, ms_per_mb = HOST_PROBE[ranks, rate]
    return replace(LinkModel.fit(ranks, (PROBE_BYTES[0], small), (PROBE_BYTES[1], large)),
                   cpu_s_per_message=per_message, cpu_s_per_byte=ms_per_mb / 1e3 / BENCH_MB)


_CODEC_RUNS = {row: spec for *_, row, spec in CODEC_ROWS}
_CODEC_OF = {"scaleout+blockquant": "blockquant", **_CODEC_RUNS}


def _predict(workload: str, ranks: int, rate: str, single_ms: float, grad_mb: float,
             peer: str) -> float:
    codec, layer_codecs = CodecModel(), {}
    spec = _CODEC_OF.get(peer)
    if spec:  # its CPU (one thread alone) slows as the compute does
        codec = codec_model(spec)
        codec = replace(codec, seconds_per_byte=codec.seconds_per_byte * SLOWDOWN[workload, ranks])
    link = probed_link(rate, ranks)
    topology = link.topology()
    host = {"host_s_per_byte": link.cpu_s_per_byte, "host_s_per_message": link.cpu_s_per_message}
    work = testbed_workload(workload, single_ms, grad_mb, ranks)
    if peer == "scaleout, row-sparse tables":  # dense bytes per layer; the tables' codec moves
        work = testbed_workload(workload, single_ms, DENSE_MB[workload], ranks)  # the row's MB
        layer_codecs = row_sparse(work, grad_mb, SLOWDOWN[workload, ranks])
        # run at stop 38: the open policy decided as the runtime decides it (FIFO for this
        # plan, its bulk lane holding no bucket of several chunks), chunks leaving early
        config = IterationConfig(scheduler=SchedulerConfig(), mode="overlap",
                                 layer_codecs=layer_codecs, **host)
    elif peer in _CODEC_RUNS:  # today's runtime: the open policy, as the runtime decides it
        config = IterationConfig(scheduler=SchedulerConfig(), mode="overlap", codec=codec, **host)
    elif peer.startswith("scaleout"):  # (every row ran before a chunk could leave early, and
        # with the priority policy whatever its plan: the default until stop 34)
        config = IterationConfig(scheduler=SchedulerConfig(policy="priority"), mode="overlap",
                                 codec=codec, layer_codecs=layer_codecs, early_chunks=False,
                                 **host)
    else:
        config = IterationConfig(
            mode="sync",
            scheduler=SchedulerConfig(
                policy="fifo", bucket_bytes=25 * MB, first_bucket_bytes=1 * MB
            ),
            **host,
        )
    return simulate(work, topology, config).iteration_s * 1e3


def _codec_said(spec: str, digits: int, mb: str) -> str:
    """``CODECS[spec]`` in words, from its figures."""
    codec = codec_model(spec)
    return (f"{spec} as CODECS['{spec}'] (ratio {codec.ratio:.{digits}f}, "
            f"{codec.seconds_per_byte * MB * 1e3:.2f} ms of CPU per {mb} alone, on the "
            "compute's cores, two rounds)")


_PEERS = MappingProxyType({
    "scaleout": "priority, overlap, a bucket's chunks sent when its last layer is in (the "
    "runtime until stop 34)",
    "ddp": "FIFO 25 MB buckets, sync",
    "scaleout+blockquant": "priority, overlap, " + _codec_said("blockquant", 3, "MB"),
    "scaleout+powersgd:2": "the open policy as the runtime decides it (FIFO here), overlap, "
    + _codec_said("powersgd:rank=2", 4, "MiB"),
    "scaleout, row-sparse tables": "the open policy as the runtime decides it (FIFO here), "
    "overlap, early chunks (the runtime of stop 40); the tables' bytes are the MB/it less the "
    f"dense MLPs', two rounds, {ROWS_S_PER_BYTE * MB * 1e3:.3f} ms of CPU per MiB of table "
    "alone, the rows from the batch's ids (rows_cpu_probe.py)",
})


def testbed_scenarios() -> tuple[Scenario, ...]:
    """Every table's scaleout and ddp rows, its blockquant row where it has one, the
    row-sparse tables' scaleout rows, and the runs with a codec (:data:`CODEC_ROWS`)."""
    out = []
    tables = [(w, n, r, single, mb, table, [("scaleout", ours, "scaleout"), ("ddp", ddp, "ddp")]
               + ([("scaleout+blockquant", BLOCKQUANT_ROWS[w, n, r], "scaleout+blockquant")]
                  if (w, n, r) in BLOCKQUANT_ROWS else []))
              for w, n, r, single, ours, ddp, mb, table in TESTBED_ROWS]
    tables += [(w, n, r, single, mb, table, [("scaleout, row-sparse tables", ours, row)])
               for w, n, r, single, ours, mb, table, row in ROW_SPARSE_ROWS]
    tables += [(w, n, r, single, mb, table, [(row, ours, row)])
               for w, n, r, single, ours, mb, table, row, _ in CODEC_ROWS]
    for workload, ranks, rate, single, mb, table, peers in tables:
        for peer, measured, row in peers:
            out.append(
                Scenario(
                    name=f"{workload} {rate} {peer.replace(',', '')}"
                    + ("" if ranks == 2 else f" {ranks} ranks"),
                    group="testbed",
                    measured=measured,
                    unit="ms",
                    bound=RELATIVE_BOUND,
                    source=f"benchmarks/results/{table}.json, row {row}",
                    assumptions=(
                        f"{ranks} ranks; single rank {single} ms (same table), split over the "
                        f"layers as in testbed_traces/{workload}.json; {mb} MB/it; the {rate} "
                        f"link of {ranks} ranks as lone_call_probe.py measured it (the median "
                        f"lone 1 KB and 4 MiB all-reduce, {LONE_CALLS_FILES[ranks]}), its CPU per "
                        f"collective and per MB as host_cpu_probe.py measured them "
                        f"({PROBE_FILES[ranks]}), the CPU "
                        "charged to compute only while both run; compute and codec CPU x "
                        f"{SLOWDOWN[workload, ranks]:.3f}, the lockstep row of {workload}'s "
                        f"{ranks}-rank 1 Gbit/s run; {_PEERS[peer]}"
                    ),
                    predict=lambda w=workload, n=ranks, r=rate, s=single, m=mb, p=peer: _predict(
                        w, n, r, s, m, p
                    ),
                )
            )
    return tuple(out)
