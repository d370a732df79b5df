"""The testbed scenarios' link and host CPU are the probe's measurements, taken by the stated
rule (issue 13: nothing fitted to the predicted rows)."""

from __future__ import annotations

import json
import subprocess
import sys
import statistics
from pathlib import Path

import pytest

from scaleout.pytorch import tune_measure
from scaleout.sim.collectives import collective_cost
from scaleout.sim.config import codec_model
from scaleout.sim.testbed_cases import (
    HOST_PROBE,
    LONE_CALLS,
    LONE_CALLS_FILES,
    PROBE_BYTES,
    PROBE_FILES,
    CODEC_ROWS,
    ROW_SPARSE_ROWS,
    SLOWDOWN,
    TESTBED_ROWS,
    probed_link,
    row_sparse,
    single_rank_trace,
)
from scaleout.sim.testbed_cases import testbed_workload as row_workload  # (not a test)

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks/results"
LINKS = sorted(HOST_PROBE)  # (ranks, rate)


def _figures(rows: list[dict], ranks: int, rate: str, *gets) -> tuple[float, ...]:
    """Per getter, the slower rank's figure of each run at ``rate``, then the median over
    the runs."""
    runs: dict[int, list[dict]] = {}
    for row in rows:
        if row["rate"] == rate:
            runs.setdefault(row["repeat"], []).append(row)
    assert len(runs) >= 2 and all(len(r) == ranks for r in runs.values())
    return tuple(statistics.median(max(get(r) for r in run) for run in runs.values())
                 for get in gets)


@pytest.mark.parametrize("ranks,rate", LINKS)
def test_host_probe_table_is_the_recorded_probe(ranks: int, rate: str) -> None:
    rows = json.loads((RESULTS / PROBE_FILES[ranks]).read_text())["rows"]
    assert all(r["link"]["probe_bytes"] == list(PROBE_BYTES) for r in rows)
    figures = _figures(rows, ranks, rate, lambda r: r["link"]["seconds"][0],
                       lambda r: r["link"]["seconds"][1], lambda r: r["link"]["cpu_s_per_message"],
                       lambda r: r["cpu_ms_per_mb"])
    assert HOST_PROBE[ranks, rate] == pytest.approx(figures, rel=2e-3)


@pytest.mark.parametrize("ranks,rate", sorted(LONE_CALLS))
def test_lone_calls_table_is_the_recorded_probe(ranks: int, rate: str) -> None:
    # the median call of each size on idle ranks: the slower rank's of each run, then the
    # median of the runs
    rows = [r for r in json.loads((RESULTS / LONE_CALLS_FILES[ranks]).read_text())["rows"]
            if r["ranks"] == ranks]
    figures = _figures(rows, ranks, rate, *(
        lambda r, size=size: r["sizes"][str(size)]["idle_ms"] / 1e3 for size in PROBE_BYTES))
    assert LONE_CALLS[ranks, rate] == pytest.approx(figures, rel=2e-3)


def test_every_rows_link_was_probed_at_its_ranks_and_rate() -> None:
    links = {(ranks, rate) for _, ranks, rate, *_ in TESTBED_ROWS}
    assert links <= set(HOST_PROBE) and links <= set(LONE_CALLS)
    probed = {ranks for ranks, _ in (*HOST_PROBE, *LONE_CALLS)}
    assert probed <= set(PROBE_FILES) and probed <= set(LONE_CALLS_FILES)  # (a file for each)


def test_probe_sizes_are_the_autotuners() -> None:
    assert PROBE_BYTES == tune_measure.PROBE_BYTES


@pytest.mark.parametrize("ranks,rate", LINKS)
def test_the_simulated_link_reproduces_both_probe_points(ranks: int, rate: str) -> None:
    _, _, per_message, ms_per_mb = HOST_PROBE[ranks, rate]
    small, large = LONE_CALLS[ranks, rate]  # the median lone calls (since stop 35)
    link = probed_link(rate, ranks)
    assert link.ranks == ranks
    assert link.cpu_s_per_message == per_message
    assert link.cpu_s_per_byte * 1e6 * 1e3 == pytest.approx(ms_per_mb)  # (ms per 1e6 bytes)
    topology = link.topology()
    for nbytes, seconds in zip(PROBE_BYTES, (small, large)):
        assert link.allreduce_s(nbytes) == pytest.approx(seconds, rel=1e-9)
        cost = collective_cost(topology, op="allreduce", algorithm="ring", nbytes=nbytes)
        assert cost.time == pytest.approx(seconds, rel=1e-6)


def _probe_rows(script: str, *args: str) -> list[dict]:
    """Run ``benchmarks/<script>`` on two loopback ranks; each rank's JSON line."""
    done = subprocess.run([sys.executable, "-m", "scaleout", "run", "-n", "2",
                           str(RESULTS.parent / script), *args],
                          capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads(line.split("] ", 1)[1]) for line in done.stdout.splitlines()
            if line.startswith("[rank") and "{" in line]
    assert sorted(r["rank"] for r in rows) == [0, 1]
    return rows


@pytest.mark.timeout(120)
def test_the_probe_runs_on_two_ranks() -> None:
    """``benchmarks/host_cpu_probe.py`` over loopback, tiny: each rank prints its figures."""
    for row in _probe_rows("host_cpu_probe.py", "0.1", "2", "1"):
        assert row["link"]["probe_bytes"] == list(PROBE_BYTES)
        small, large = row["link"]["seconds"]
        assert 0 < small and 0 < large
        assert row["transfer_alone_cpu_ms"] > 0 and row["small_allreduce_cpu_ms"] > 0


@pytest.mark.timeout(120)
def test_the_lone_call_probe_runs_on_two_ranks() -> None:
    """``benchmarks/lone_call_probe.py`` over loopback, tiny: each rank prints its medians."""
    for row in _probe_rows("lone_call_probe.py", "1", "2", "0"):
        assert {str(size) for size in PROBE_BYTES} <= set(row["sizes"])
        assert all(0 < f["idle_ms"] and 0 < f["loaded_ms"] for f in row["sizes"].values())


@pytest.mark.parametrize("row", TESTBED_ROWS, ids=lambda r: f"{r[0]}-{r[1]}-{r[2]}")
def test_a_rows_layers_are_its_single_rank_trace_scaled(row) -> None:
    workload, ranks, _, single_ms, _, _, mb, _ = row
    trace = single_rank_trace(workload)
    # the trace is the bench's workload: the same gradient bytes as the table's MB/it
    assert sum(lay.grad_bytes for lay in trace.layers) / 1e6 == pytest.approx(mb, abs=0.005)
    w = row_workload(workload, single_ms, mb, ranks)
    assert [lay.name for lay in w.layers] == [lay.name for lay in trace.layers]
    total = sum(lay.forward_s + lay.backward_s for lay in w.layers)
    assert total * 1e3 == pytest.approx(single_ms * SLOWDOWN[workload, ranks])
    ratio = w.layers[0].backward_s / trace.layers[0].backward_s
    assert all(lay.forward_s == pytest.approx(t.forward_s * ratio)
               for lay, t in zip(w.layers, trace.layers))


SLOWDOWN_TABLES = {
    ("resnet18", 2): "stop24/testbed/resnet18-1gbit.json",
    ("transformer", 2): "stop30/transformer-1gbit-lockstep.json",
    ("dlrm", 2): "stop30/dlrm-1gbit-lockstep.json",
    ("resnet18", 3): "stop31/testbed3/resnet18-1gbit.json",
    ("transformer", 3): "stop31/testbed3/transformer-1gbit.json",
    ("dlrm", 3): "stop31/testbed3/dlrm-1gbit.json",
}


@pytest.mark.parametrize("key", sorted(SLOWDOWN_TABLES), ids=lambda k: f"{k[0]}-{k[1]}")
def test_each_workloads_slowdown_is_its_own_lockstep_row(key: tuple[str, int]) -> None:
    # the one fitted figure per workload and rank count: a run that trains no shared model
    # (lockstep), at 1 Gbit/s, against the one-rank run of the same table
    data = json.loads((RESULTS / SLOWDOWN_TABLES[key]).read_text())
    assert data["settings"]["ranks"] == key[1]
    summary = data["summary"]
    ratio = summary["lockstep"]["iter_ms"] / summary["single"]["iter_ms"]
    assert SLOWDOWN[key] == pytest.approx(ratio, rel=1e-4)
    assert set(SLOWDOWN) == {(row[0], row[1]) for row in TESTBED_ROWS} == set(SLOWDOWN_TABLES)


def _summary(table: str, workload: str, ranks: int, rate: str) -> dict:
    """The bench run ``table``'s summary, checked to be of ``workload`` at ``ranks`` and ``rate``."""
    data = json.loads((RESULTS / f"{table}.json").read_text())
    assert (data["settings"]["workload"], data["settings"]["ranks"],
            data["settings"]["rate"]) == (workload, ranks, rate)
    return data["summary"]


@pytest.mark.parametrize("row", TESTBED_ROWS, ids=lambda r: f"{r[0]}-{r[1]}-{r[2]}")
def test_a_rows_figures_are_its_tables(row) -> None:
    # what each scenario predicts from and is scored against is the recorded bench run
    workload, ranks, rate, single_ms, ours_ms, ddp_ms, mb, table = row
    summary = _summary(table, workload, ranks, rate)
    for figure, name in ((single_ms, "single"), (ours_ms, "scaleout"), (ddp_ms, "ddp")):
        assert figure == pytest.approx(summary[name]["iter_ms"], abs=0.051)
    assert mb == pytest.approx(summary["scaleout"]["bytes_per_iter"] / 1e6, abs=0.005)


@pytest.mark.parametrize("row", ROW_SPARSE_ROWS, ids=lambda r: f"{r[0]}-{r[1]}-{r[2]}")
def test_a_row_sparse_rows_figures_are_its_table_and_its_tables_move_its_bytes(row) -> None:
    workload, ranks, rate, single_ms, ours_ms, mb, table, peer = row
    summary = _summary(table, workload, ranks, rate)
    assert single_ms == pytest.approx(summary["single"]["iter_ms"], abs=0.051)
    assert ours_ms == pytest.approx(summary[peer]["iter_ms"], abs=0.051)
    assert mb == pytest.approx(summary[peer]["bytes_per_iter"] / 1e6, abs=0.0005)
    assert (ranks, rate) in HOST_PROBE and (workload, ranks) in SLOWDOWN
    # the tables' codec moves what the row measured, the dense MLPs the rest, whole
    work = row_workload(workload, single_ms, 5.21, ranks)
    codecs = row_sparse(work, mb, SLOWDOWN[workload, ranks])
    assert len(codecs) == 26 and {c.rounds for c in codecs.values()} == {2}
    moved = sum(lay.grad_bytes * (codecs[lay.name].ratio if lay.name in codecs else 1.0)
                for lay in work.layers)
    assert moved == pytest.approx(mb * 1e6, rel=1e-6)
    assert 0 < next(iter(codecs.values())).ratio < 0.1


@pytest.mark.parametrize("row", CODEC_ROWS, ids=lambda r: f"{r[0]}-{r[1]}-{r[2]}-{r[8]}")
def test_a_codec_rows_figures_are_its_table_and_its_codec_moves_its_bytes(row) -> None:
    workload, ranks, rate, single_ms, ours_ms, mb, table, peer, spec = row
    summary = _summary(table, workload, ranks, rate)
    assert single_ms == pytest.approx(summary["single"]["iter_ms"], abs=0.051)
    assert ours_ms == pytest.approx(summary[peer]["iter_ms"], abs=0.051)
    assert (ranks, rate) in HOST_PROBE and (workload, ranks) in SLOWDOWN
    # the codec's ratio of the row's dense bytes is what the run measured on the wire
    moved = mb * codec_model(spec).ratio
    assert moved == pytest.approx(summary[peer]["bytes_per_iter"] / 1e6, rel=0.03)
