"""Summaries of ``scaleout bench train`` results: figures per configuration, table, JSON, plot.

From the raw runs of :func:`scaleout.bench.train.run_benchmark`:

* throughput of a run = global samples per second = ``ranks x batch / median iteration time``;
* per configuration: the median throughput over rounds and its min..max spread;
* scaling efficiency = throughput / (ranks x ``single``'s throughput of the same round),
  the median over rounds;
* ``scaleout/this`` = scaleout's throughput / this peer's, the median of per-round ratios
  (above 1: scaleout is faster);
* scaleout's exposed and in-flight communication per iteration and bytes sent per
  iteration, from its :class:`~scaleout.session.Statistics` on rank 0, medians over rounds;
* the last loss: rank 0's loss of the last timed iteration, the median over rounds;
* ``vs best tuned`` (with ``ddp-tuned`` peers): scaleout's throughput over that of the
  fastest of ``ddp`` and every ``ddp-tuned[:MB]`` of the run (the lowest median iteration
  time), the median of per-round ratios;
* whether each configuration trained what it should (:mod:`scaleout.bench.train_checks`):
  ``WRONG:`` lines, and configurations faster than their ceiling as suspect.
"""

from __future__ import annotations

import datetime
import shlex
import statistics
import sys
from collections.abc import Sequence

from scaleout.bench.provenance import machine_facts, scaleout_env, source_facts
from scaleout.bench.train_checks import EXACT_TOLERANCE, check_rounds, suspects
from scaleout.table import format_table

__all__ = ["summarize", "build_report", "format_report", "plot_report", "machine_facts",
           "best_tuned", "wrong_lines"]

#: The column of scaleout's ratio to the fastest of ``ddp`` and the ``ddp-tuned`` peers.
BEST_TUNED = "best tuned"


def _median(values: Sequence[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def summarize(raw: dict) -> dict[str, dict[str, object]]:
    """Per-configuration figures (see the module docstring) from raw runs.

    Args:
        raw: what :func:`run_benchmark` returned.

    Returns:
        ``{configuration: {...}}`` in the order the configurations were asked for.
    """
    config = raw["config"]
    ranks = config["ranks"]
    peers = list(config["peers"])
    names = ["single", *(_variant(c) for c in config["compression"]), *peers]
    by_round: dict[int, dict[str, dict]] = {}
    failures: dict[str, str] = {}
    for run in raw["runs"]:
        if "error" in run:  # a failed configuration: its reason, no figures
            failures.setdefault(run["config"], run.get("reason") or "failed")
            continue
        thr = run["batch_per_rank"] * run["ranks"] / run["median_iter_s"]
        by_round.setdefault(run["round"], {})[run["config"]] = {**run, "throughput": thr}
    rounds = [by_round[r] for r in sorted(by_round)]
    checks = check_rounds(raw["runs"])
    summary: dict[str, dict[str, object]] = {}
    for name in names:
        present = [rnd for rnd in rounds if name in rnd]
        thr = [rnd[name]["throughput"] for rnd in present]
        eff = [rnd[name]["throughput"] / (ranks * rnd["single"]["throughput"])
               for rnd in present if name != "single" and "single" in rnd]
        entry: dict[str, object] = {
            "ranks": 1 if name == "single" else ranks,
            "throughput": _median(thr), "throughput_min": min(thr, default=None),
            "throughput_max": max(thr, default=None), "throughput_per_round": thr,
            "iter_ms": _median([rnd[name]["median_iter_s"] * 1e3 for rnd in present]),
            "efficiency": _median(eff), "efficiency_per_round": eff,
            "over_peers": {}, "over_peers_per_round": {},
        }
        if name.startswith("scaleout"):  # (scaleout, scaleout+SPEC, scaleout-sharded)
            for peer in (p for p in peers if p != name):
                ratios = [rnd[name]["throughput"] / rnd[peer]["throughput"]
                          for rnd in present if peer in rnd]
                entry["over_peers"][peer] = _median(ratios)
                entry["over_peers_per_round"][peer] = ratios
        stats = [rnd[name]["scaleout_stats"] for rnd in present if rnd[name].get("scaleout_stats")]
        if stats:
            for key in ("exposed_ms", "comm_ms", "bytes", "raw_bytes"):
                entry[f"{key}_per_iter"] = _median([s[key] for s in stats])
        losses = [rnd[name]["final_loss"] for rnd in present if "final_loss" in rnd[name]]
        entry["final_loss"] = _median(losses)
        details = [rnd[name].get("details") for rnd in present]
        entry["details"] = details[0] if details else {}
        if name in failures:
            entry["failed"] = failures[name]
        if name in checks:
            entry["check"] = checks[name]
        summary[name] = entry
    best = best_tuned(summary, peers)
    for name, entry in summary.items():
        if best is not None and name.startswith("scaleout"):
            ratios = [rnd[name]["throughput"] / rnd[best]["throughput"]
                      for rnd in rounds if name in rnd and best in rnd]
            entry["over_best_tuned"] = {"peer": best, "ratio": _median(ratios),
                                        "per_round": ratios}
    return summary


def best_tuned(summary: dict[str, dict[str, object]], peers: Sequence[str]) -> str | None:
    """The fastest (lowest median iteration time) of ``ddp`` and every ``ddp-tuned[:MB]``
    among ``peers``, when a ``ddp-tuned`` one ran; else ``None``."""
    if not any(p.startswith("ddp-tuned") for p in peers):
        return None
    timed = [(summary[p]["iter_ms"], p) for p in peers
             if (p == "ddp" or p.startswith("ddp-tuned")) and p in summary
             and summary[p]["iter_ms"] is not None]
    return min(timed)[1] if timed else None


def _short(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _variant(spec: str) -> str:
    return "scaleout" if spec == "none" else f"scaleout+{spec}"


def build_report(raw: dict, *, argv: Sequence[str] | None = None,
                 started: datetime.datetime | None = None,
                 machine_before: dict[str, object] | None = None) -> dict[str, object]:
    """The JSON document ``--json`` writes: command, date, machine, settings, summary, runs.

    Args:
        raw: what :func:`run_benchmark` returned.
        argv: the command line (default ``sys.argv``).
        started: when the benchmark started (default now).
        machine_before: :func:`machine_facts` taken before the run (its load average).
    """
    argv = list(sys.argv if argv is None else argv)
    started = started or datetime.datetime.now(datetime.timezone.utc)
    machine = machine_facts()
    if machine_before is not None and "loadavg" in machine_before:
        machine["loadavg_before"] = machine_before["loadavg"]
    summary = summarize(raw)
    return {
        "command": " ".join(shlex.quote(a) for a in argv), "argv": argv,
        "date": started.isoformat(timespec="seconds"), "machine": machine,
        "source": source_facts(), "scaleout_env": scaleout_env(),
        "settings": raw["config"], "network": raw["network"],
        "warm_ranks": raw.get("warm_ranks", False),
        "summary": summary, "checks": {"wrong": wrong_lines(summary),
                                       "suspect": suspects(summary),
                                       "exact_tolerance": EXACT_TOLERANCE},
        "runs": raw["runs"],
    }


def wrong_lines(summary: dict[str, dict[str, object]]) -> list[str]:
    """``"NAME: what differed"`` for every configuration that trained wrong."""
    return [f"{name}: {why}" for name, entry in summary.items()
            for why in (entry.get("check") or {}).get("wrong", ())]


def _check_notes(summary: dict[str, dict[str, object]]) -> list[str]:
    """What the parameter checks found: which configurations hold one model on every rank,
    the exact ones' largest distance to the reference, each lossy one's distance."""
    checked = {n: e["check"] for n, e in summary.items() if e.get("check")}
    if not checked:
        return []
    right = {n: c for n, c in checked.items() if not c["wrong"]}
    reference = next((c["reference"] for c in checked.values() if c["reference"]), None)
    exact = [n for n, c in right.items() if c["exact"] and n != reference]
    lossy = [f"{n} {c['distance']:.3g}" for n, c in right.items()
             if not c["exact"] and c["distance"] is not None]
    worst = max((right[n]["distance"] or 0.0 for n in exact), default=0.0)
    line = (f"checked: {len(right)} of {len(checked)} trainers right (parameters digested after "
            "every round: the same on every rank"
            + (f"; {', '.join(exact)} the same as {reference}'s, up to {worst:.2g} of the "
               f"movement, tolerance {EXACT_TOLERANCE:g}" if exact and reference else "")
            + (f"; lossy, distance to {reference}'s: {', '.join(lossy)}" if lossy else "") + ")")
    return [line]


def format_report(report: dict) -> str:
    """A header saying what ran where, the table, and how to read it."""
    s, net, summary = report["settings"], report["network"], report["summary"]
    header = (f"{s['workload']} on {s.get('device', 'cpu')}, {s['ranks']} ranks x {s['batch']} samples, "
              f"{_count(s['rounds'], 'round')} x {_count(s['iters'], 'timed iteration')} "
              f"({s['warmup']} warm-up, {s.get('lead_in', 0)} lead-in not counted), "
              f"{_count(s['threads'], 'thread')} per rank, "
              f"{'warm ranks' if report.get('warm_ranks') else 'fresh ranks every round'}\n"
              f"network: {net['description']}")
    peers = list(s["peers"])
    best = best_tuned(summary, peers)
    columns = [*peers, *([BEST_TUNED] if best is not None else [])]
    rows, failed = [], []
    for name, e in summary.items():
        if e.get("failed") and e["throughput"] is None:
            rows.append([name, f"FAILED: {_short(e['failed'])}", *([""] * (7 + len(columns)))])
            failed.append(f"{name} FAILED: {e['failed']}")
            continue
        if e.get("failed"):
            failed.append(f"{name} failed in a later round: {e['failed']}")
        spread = (f"{e['throughput_min']:.1f}..{e['throughput_max']:.1f}"
                  if e["throughput_min"] is not None else "-")
        mb = e.get("bytes_per_iter")
        rows.append([
            name if name != "single" else "single (1 rank)", _fmt(e["throughput"], ".1f"), spread,
            _fmt(e["iter_ms"], ".1f"), _fmt(e["efficiency"], ".0%"),
            *(_fmt(e["over_peers"].get(p), ".3f") for p in peers),
            *([_fmt((e.get("over_best_tuned") or {}).get("ratio"), ".3f")] if best else []),
            _fmt(e.get("exposed_ms_per_iter"), ".1f"), _fmt(e.get("comm_ms_per_iter"), ".1f"),
            _fmt(None if mb is None else mb / 1e6, ".2f"), _fmt(e.get("final_loss"), ".5f"),
        ])
    headers = ["configuration", "samples/s", "min..max", "iter ms", "efficiency",
               *(f"vs {p}" for p in columns), "exposed ms/it", "comm ms/it", "MB/it", "last loss"]
    so = next((e["details"] for n, e in summary.items() if n.startswith("scaleout")), {}) or {}
    notes = [
        f"efficiency = samples/s / ({s['ranks']} x single's, same round); vs PEER = median "
        "of per-round throughput ratios scaleout/PEER (> 1: scaleout faster); medians over rounds",
        f"scaleout: policy {so.get('policy')}"
        + (f" (ran {so['policy_in_use']})" if so.get("policy_in_use") not in (None, so.get("policy"))
           else "")
        + f", mode {so.get('mode')}; exposed/comm ms and MB "
        "per iteration are its Statistics on rank 0 (MB after compression)",
        "last loss: rank 0's loss on its part of the last timed batch (the same data in every "
        "configuration of 2+ ranks: those that train the same model agree to rounding)",
    ]
    psgd = summary.get("ddp-powersgd", {}).get("details")
    if psgd:
        notes.append(f"ddp-powersgd: matrix_approximation_rank {psgd['matrix_approximation_rank']}"
                     f", start_powerSGD_iter {psgd['start_powerSGD_iter']} (plain allreduce "
                     "before), error feedback and warm start on")
    for name in ("scaleout+auto", "scaleout+auto-exact"):
        tuned = (summary.get(name, {}).get("details") or {}).get("tuning")
        if tuned:  # what the self-tuning variant chose in the first round, on rank 0
            notes.append(f"{name} tuned itself (first round):\n      "
                         + tuned["summary"].replace("\n", "\n      "))
    if best is not None:
        notes.append(f"vs best tuned: against {best}, the fastest of ddp and the ddp-tuned "
                     "peers (lowest median iteration time)")
    notes += _check_notes(summary)
    notes += failed
    notes += [f"SUSPECT: {line}" for line in report.get("checks", {}).get("suspect", ())]
    notes += [f"WRONG: {line}" for line in report.get("checks", {}).get("wrong", ())]
    if not net.get("testbed"):
        notes.append("NO TESTBED: ranks talk over loopback with no rate limit; these numbers "
                     "say little about a real network")
    return f"{header}\n{format_table(headers, rows)}\n" + "\n".join(f"  {n}" for n in notes)


def plot_report(report: dict, path: str) -> None:
    """A bar chart of median throughput (min..max as error bars) with the ideal as a line.

    Raises:
        RuntimeError: matplotlib is not installed (``pip install matplotlib``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise RuntimeError("--plot needs matplotlib, which is not installed: "
                           "pip install matplotlib  (or pip install 'scaleout[plot]')") from err
    s, summary = report["settings"], report["summary"]
    names = list(summary)
    values = [summary[n]["throughput"] or 0.0 for n in names]
    low = [v - (summary[n]["throughput_min"] or v) for n, v in zip(names, values)]
    high = [(summary[n]["throughput_max"] or v) - v for n, v in zip(names, values)]
    fig, ax = plt.subplots(figsize=(1.6 * len(names) + 2, 4))
    colors = ["#999999" if n == "single" else "#d62728" if n.startswith("scaleout") else "#1f77b4"
              for n in names]
    ax.bar(names, values, yerr=[low, high], capsize=4, color=colors)
    ideal = s["ranks"] * (summary["single"]["throughput"] or 0.0)
    ax.axhline(ideal, linestyle="--", color="black", linewidth=1,
               label=f"ideal: {s['ranks']} x single")
    for i, name in enumerate(names):
        eff = summary[name]["efficiency"]
        if eff is not None:
            ax.annotate(f"{eff:.0%}", (i, values[i] + high[i]), ha="center", va="bottom",
                        xytext=(0, 3), textcoords="offset points")
    ax.set_ylim(0, 1.15 * max([ideal, *(v + h for v, h in zip(values, high))]))
    ax.set_ylabel("samples/s (median over rounds)")
    ax.set_title(f"{s['workload']}, {s['ranks']} ranks, {report['network']['description']}",
                 fontsize=9)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
