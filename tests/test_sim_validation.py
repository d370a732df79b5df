"""Validation groups added for issue 13: bus bandwidth of the testbed's collectives, and the
published points' measured single-GPU rates. Predictions checked by hand from the alpha-beta
formulas and gloo's posting order; the scenarios' shape (one per measured cell, training split left out) and the
GB/s unit's relative error."""

from __future__ import annotations

import json

import pytest

from scaleout.cli.main import main
from scaleout.core import direct, pairwise
from scaleout.sim.collective_cases import (
    DIRECT_MAX_BYTES,
    EXCHANGE_MIN_BLOCK,
    GLOO,
    IMPLEMENTATIONS,
    LINK_EFFICIENCY,
    MEASURED,
    collective_scenarios,
    predicted_busbw,
    scaleout_path,
)
from scaleout.sim.models import model, model_workload
from scaleout.sim.network import preset
from scaleout.sim.published import (
    GOYAL_BACKPROP_S,
    P100_TF_IMAGES_PER_S,
    THEMIS_SYSTEMS,
    goyal_p100,
    p100_measured,
    themis_topology,
)
from scaleout.sim.validation import Scenario, validate

B = 1e9 / 8 * LINK_EFFICIENCY  # 1 Gbit/s x 0.98, bytes/s
HOP = 2 * 50e-6  # host -> bridge -> host


def test_busbw_golden_from_the_alpha_beta_formulas() -> None:
    n = 16 << 20
    ring_allreduce_2 = 2 * (HOP + n / 2 / B)  # RS + AG, one step each of n/2
    assert predicted_busbw("allreduce", 2, "1gbit", n) == pytest.approx(n / ring_allreduce_2)
    # torch's gloo reduce_scatter all-reduces the whole input: an all-reduce's time, and
    # the reduce-scatter bus factor (p-1)/p: half the all-reduce's bus bandwidth at 2 ranks
    assert predicted_busbw("reduce_scatter", 2, "1gbit", n) == pytest.approx(
        n / ring_allreduce_2 / 2)
    binomial_3 = 2 * (HOP + n / B)  # root -> 1, then root -> 2: two full-size steps
    assert predicted_busbw("bcast", 3, "1gbit", n) == pytest.approx(n / binomial_3)
    # gloo's ring all-gather at 3 ranks sends and receives on different pairs: the ring's
    # time, 2 steps of n/3 (in halves, two in flight)
    ring_allgather_3 = 2 * (HOP + n / 3 / B)
    assert predicted_busbw("allgather", 3, "1gbit", n) == pytest.approx(
        n / ring_allgather_3 * 2 / 3, rel=1e-2)
    # send before recv on a pair used both ways (sim/gloo_pairs.py): at 2 ranks all-to-all's
    # two n/2 run one after the other (half the link), all-gather's four n/4 halves in three
    # slots (2/3 of it)
    assert predicted_busbw("alltoall", 2, "1gbit", n) == pytest.approx(B / 2, rel=1e-2)
    assert predicted_busbw("allgather", 2, "1gbit", n) == pytest.approx(B * 2 / 3, rel=1e-2)
    assert predicted_busbw("allreduce", 2, "100mbit", n) < predicted_busbw("allreduce", 2, "1gbit", n)
    assert predicted_busbw("alltoall", 2, "100mbit", n) < predicted_busbw("alltoall", 2, "1gbit", n)
    # scaleout's reduce-scatter, all-to-all and 2-rank all-gather: its receive-first
    # exchange, both directions at once: the link's rate as bus bandwidth
    for op in ("reduce_scatter", "alltoall", "allgather"):
        assert predicted_busbw(op, 2, "1gbit", n, "scaleout") == pytest.approx(B, rel=1e-2)
    assert predicted_busbw("reduce_scatter", 3, "1gbit", n, "scaleout") == pytest.approx(
        B, rel=1e-2)
    # ... but gloo's ring all-gather at 3 ranks, and gloo's collectives below the threshold
    assert predicted_busbw("allgather", 3, "1gbit", n, "scaleout") == predicted_busbw(
        "allgather", 3, "1gbit", n)
    small = 2 * EXCHANGE_MIN_BLOCK - 2
    assert predicted_busbw("alltoall", 2, "1gbit", small, "scaleout") == predicted_busbw(
        "alltoall", 2, "1gbit", small)
    with pytest.raises(ValueError, match="implementation must be one of"):
        predicted_busbw("allreduce", 2, "1gbit", n, "nccl")
    with pytest.raises(ValueError, match="op must be one of"):
        predicted_busbw("reduce", 2, "1gbit", n)
    with pytest.raises(ValueError, match="rate must be one of"):
        predicted_busbw("allreduce", 2, "10gbit", n)


def test_collective_scenarios_cover_every_held_out_cell() -> None:
    scenarios = collective_scenarios()
    assert len(scenarios) == 2 * len(MEASURED) and len(MEASURED) >= 36
    assert {s.group for s in scenarios} == {"collectives"}
    assert {s.unit for s in scenarios} == {"GB/s"}
    cells = {(p, r, op) for p, r, op, *_ in MEASURED}
    assert (2, "1gbit", "allreduce") not in cells  # the training split of LINK_EFFICIENCY
    assert {op for _, _, op in cells} == set(GLOO)
    p, rate, op, nbytes, *times = MEASURED[0]
    factor = {"reduce_scatter": (p - 1) / p}[op]
    for scenario, implementation, ms in zip(scenarios[:2], IMPLEMENTATIONS, times):
        assert scenario.measured == pytest.approx(nbytes / (ms / 1e3) * factor / 1e9)
        assert implementation in scenario.source
    assert scenarios[1].name == "torch " + scenarios[0].name
    for scenario, (p, _, op, nbytes, *_) in zip(scenarios[::2], MEASURED):
        assert scaleout_path(op, p, nbytes)[2] in scenario.assumptions
    assert all(GLOO[s.name.split()[1]][2] in s.assumptions for s in scenarios[1::2])


def test_scaleouts_paths_are_the_runtimes() -> None:
    """The simulator's copy of the exchange's threshold is the runtime's, and the cells
    measured on the testbed took the path the model prices (blocks of n/p per peer)."""
    assert EXCHANGE_MIN_BLOCK == pairwise.MIN_BLOCK_BYTES
    assert DIRECT_MAX_BYTES == direct.MAX_BYTES
    # a small all-reduce: gloo's all-to-all of p copies of the tensor
    for p, bound in DIRECT_MAX_BYTES.items():
        assert scaleout_path("allreduce", p, bound)[:2] == ("alltoall", "gloo_pairs")
        assert scaleout_path("allreduce", p, bound + 4) == GLOO["allreduce"]
    assert scaleout_path("allreduce", 4, 4) == GLOO["allreduce"]
    assert all(n > DIRECT_MAX_BYTES[p] for p, _, op, n, *_ in MEASURED if op == "allreduce")
    # priced as p copies of the tensor through gloo's all-to-all
    n = DIRECT_MAX_BYTES[2]
    assert predicted_busbw("allreduce", 2, "1gbit", n, "scaleout") == pytest.approx(
        predicted_busbw("alltoall", 2, "1gbit", 2 * n, "scaleout"))
    assert scaleout_path("alltoall", 3, 3 * EXCHANGE_MIN_BLOCK)[1] == "exchange"
    assert scaleout_path("alltoall", 3, 3 * EXCHANGE_MIN_BLOCK - 3) == GLOO["alltoall"]
    assert scaleout_path("allgather", 3, 1 << 26) == GLOO["allgather"]
    assert scaleout_path("allreduce", 2, 1 << 26) == GLOO["allreduce"]
    assert scaleout_path("bcast", 2, 1 << 26) == GLOO["bcast"]


def test_gbps_errors_are_relative_and_the_group_reports_its_median() -> None:
    def scenario(predicted: float) -> Scenario:
        return Scenario(name="x", group="collectives", measured=0.1, unit="GB/s", bound=0.15,
                        source="s", assumptions="a", predict=lambda: predicted)

    report = validate([scenario(0.11), scenario(0.13)])
    assert [round(o.error, 6) for o in report.outcomes] == [0.1, 0.3]
    assert [o.ok for o in report.outcomes] == [True, False] and not report.ok
    assert report.summaries == ("collectives: 1/2 within bound; median |error| 20.0%",)
    assert "0.110GB/s" in report.rows()[0]


def test_p100_rates_are_the_measured_single_gpu_throughputs() -> None:
    for name, images in P100_TF_IMAGES_PER_S.items():
        work = model_workload(name, device=p100_measured(name), batch_size=64)
        assert work.compute_s == pytest.approx(64 / images)
    lo, hi = p100_measured("resnet50").flops, p100_measured("resnet152").flops
    assert lo < p100_measured("resnet101").flops < hi
    assert model("vgg16").flops * 3 * 154 > 10.6e12  # above peak: Winograd, not nominal FLOPs
    with pytest.raises(ValueError, match="no measured P100 rate"):
        p100_measured("bert_large")


def test_goyal_setup_as_published() -> None:
    work = model_workload("resnet50", device=goyal_p100(), batch_size=32)
    assert sum(layer.backward_s for layer in work.layers) == pytest.approx(GOYAL_BACKPROP_S)
    inner, outer = preset("goyal-bigbasin").topology.dims
    # one 50 Gbit/s card per server, shared by its 8 GPUs (a dimension's link is one NPU's)
    assert outer.bandwidth * inner.npus == pytest.approx(50e9 / 8)


@pytest.mark.timeout(60)
def test_validate_collectives_exit_code_matches(tmp_path, capsys) -> None:
    out = tmp_path / "v.json"
    rc = main(["sim", "validate", "--only", "collectives", "--json", str(out)])
    report = json.loads(out.read_text())
    assert rc == (0 if report["ok"] else 1)
    assert len(report["outcomes"]) == 2 * len(MEASURED)
    assert "collectives:" in capsys.readouterr().out


def test_themis_systems_are_the_artifacts() -> None:
    # allreduce_themis.sh: 4d_ring_fc_ring_switch is 4x8x4x8, links 2/7/6/1 of 187.5/25/25/100
    topo = themis_topology("4d_ring_fc_ring_switch")
    assert [d.npus for d in topo.dims] == [4, 8, 4, 8]
    assert [d.kind for d in topo.dims] == ["ring", "fully_connected", "ring", "switch"]
    assert [d.bandwidth / 2**30 for d in topo.dims] == pytest.approx([375, 175, 150, 100])
    assert len(THEMIS_SYSTEMS) == 6
    with pytest.raises(ValueError, match="unknown Themis system"):
        themis_topology("5d")


#: The scenarios `scaleout sim validate` fails today, each with its reason in
#: docs/simulator.md ("Validation"). A change that makes another fail, or the median worse,
#: is a regression; one that makes one of these pass updates this list and the docs.
KNOWN_FAILURES = {
    "published": {"horovod inception_v3 512 GPUs", "horovod vgg16 512 GPUs",
                  "goyal resnet50 8->256 GPUs", "mlsl marenostrum4 resnet50 4->256"},
    "testbed": set(),  # (the 100 Mbit/s row-sparse row failed on stop 33's run: +21.8%)
    # stop 38's re-measurement (5 rounds); stop 24's 3-round cells failed 9, these among them
    "collectives": {"reduce_scatter 1MB 3 ranks 1gbit", "torch allgather 1MB 2 ranks 1gbit",
                    "torch alltoall 1MB 2 ranks 1gbit"},
}
MEDIAN_BOUND = {"testbed": 2.75, "collectives": 2.75}  # percent: 2.6 and 2.7 today


@pytest.mark.timeout(120)
def test_validation_holds_its_ground(tmp_path, capsys) -> None:
    """Every prediction group against its documented state (the exit code alone is not a
    check: it is 1 while any bound is exceeded, whatever the predictions are)."""
    out = tmp_path / "v.json"
    assert main(["sim", "validate", "--json", str(out)]) == 1
    capsys.readouterr()
    report = json.loads(out.read_text())
    for group, known in KNOWN_FAILURES.items():
        outcomes = [o for o in report["outcomes"] if o["group"] == group]
        failing = {o["scenario"] for o in outcomes if not o["ok"]}
        assert failing == known, (group, failing ^ known)
        if group in MEDIAN_BOUND:
            errors = sorted(abs(o["error"]) for o in outcomes)
            middle = len(errors) // 2
            median = (errors[middle] if len(errors) % 2
                      else (errors[middle - 1] + errors[middle]) / 2)
            assert median <= MEDIAN_BOUND[group], (group, median)
