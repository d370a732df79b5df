"""Issue 16's scaling table from every ``bench train`` JSON a scaling run left, and the cells
still missing from it.

``benchmarks/scaling.sh`` writes one JSON per workload, rank count and rate
(``<workload>-<ranks>-<rate>.json``), a device session at a time (stops 32 and 44 so far, under
``benchmarks/results/stopNN/``). This reads them all, keeps the exact-gradient runs on the
testbed from the machine asked for (``--cpus``, the device machine's 16 by default), takes the
newest run of each cell (``--since`` leaves older ones out, of all workloads or of one: runs of
code since fixed, e.g. ``--since dlrm=2026-11-28T18:30`` for DLRM's tables, dense on torch 2.11
before stop 44's graph-walk fix), and prints
one markdown row per cell, in the columns of RESULTS.md's scaling tables, then the grid's cells
(3 workloads x 2, 4, 8 ranks x 100 Mbit/s, 1 and 10 Gbit/s) that no kept run has, as the
``CELLS`` line ``benchmarks/device.sh`` takes (the fastest first)::

    python3 benchmarks/scaling_table.py benchmarks/results [--since [WORKLOAD=]DATE ...] [--cpus 16]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

WORKLOADS = ("resnet18", "transformer", "dlrm")
RANKS = (2, 4, 8)
RATES = ("10gbit", "1gbit", "100mbit")
#: device seconds a cell takes, roughly (stops 32 and 44: 25-180 s; 100 Mbit/s estimated
#: from the wire time of each workload's exact gradient), to order the missing ones
COST_S = {"dlrm": 60, "transformer": 80, "resnet18": 120}
RATE_FACTOR = {"10gbit": 1, "1gbit": 1.5, "100mbit": 5}

HEADER = ("| workload | ranks | rate | single ms/it | scaleout ms/it (eff) | ddp ms/it (eff) | "
          "lockstep eff | lockstep-traffic eff | scaleout / ddp (rounds) | "
          "scaleout / lockstep-traffic (rounds) | exposed ms/it | MB/it | rounds | date | torch |")


def runs(paths: list[Path]) -> list[dict[str, Any]]:
    """Every ``bench train`` result under ``paths`` (files or folders, searched below)."""
    files: list[Path] = []
    for path in paths:
        files.extend(sorted(path.rglob("*.json")) if path.is_dir() else [path])
    found = []
    for file in files:
        try:
            data = json.loads(file.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and {"settings", "summary", "machine"} <= data.keys():
            found.append({**data, "file": str(file)})
    return found


def kept(result: dict[str, Any], cpus: int, since: dict[str, str]) -> bool:
    """Exact gradients, scaleout beside DDP on the testbed, on a machine with ``cpus`` cores,
    run at ``since[workload]`` (else ``since[""]``, else any time) or later."""
    settings, summary = result["settings"], result["summary"]
    cutoff = since.get(settings.get("workload", ""), since.get("", ""))
    return (settings.get("testbed") is True and settings.get("compression") in (["none"], None)
            and result["machine"].get("cpus") == cpus and result.get("date", "") >= cutoff
            and "scaleout" in summary and "ddp" in summary
            and settings.get("workload") in WORKLOADS and settings.get("rate") in RATES)


def newest(results: list[dict[str, Any]]) -> dict[tuple[str, int, str], dict[str, Any]]:
    """The newest result of each (workload, ranks, rate)."""
    cells: dict[tuple[str, int, str], dict[str, Any]] = {}
    for result in sorted(results, key=lambda r: r.get("date", "")):
        s = result["settings"]
        cells[s["workload"], int(s["ranks"]), s["rate"]] = result
    return cells


def _eff(summary: dict[str, Any], config: str) -> str:
    entry = summary.get(config)
    return "-" if not entry or entry.get("efficiency") is None else f"{entry['efficiency']:.2f}"


def _ratio(scaleout: dict[str, Any], peer: str) -> str:
    value = scaleout["over_peers"].get(peer)
    if value is None:
        return "-"
    rounds = "/".join(f"{r:.3f}" for r in scaleout["over_peers_per_round"].get(peer, []))
    return f"**{value:.3f}** ({rounds})"


def row(result: dict[str, Any]) -> str:
    """One markdown row of the table."""
    s, summary = result["settings"], result["summary"]
    mine, ddp = summary["scaleout"], summary["ddp"]
    single = summary.get("single", {}).get("iter_ms")
    exposed = mine.get("exposed_ms_per_iter")
    cells = [s["workload"], str(s["ranks"]), s["rate"],
             "-" if single is None else f"{single:.1f}",
             f"{mine['iter_ms']:.1f} ({_eff(summary, 'scaleout')})",
             f"{ddp['iter_ms']:.1f} ({_eff(summary, 'ddp')})",
             _eff(summary, "lockstep"), _eff(summary, "lockstep-traffic"),
             _ratio(mine, "ddp"), _ratio(mine, "lockstep-traffic"),
             "-" if exposed is None else f"{exposed:.0f}",
             f"{mine.get('bytes_per_iter', 0) / 1e6:.2f}", str(s["rounds"]),
             result.get("date", "")[:16], result["machine"].get("torch", "")]
    return "| " + " | ".join(cells) + " |"


def missing(cells: dict[tuple[str, int, str], dict[str, Any]]) -> list[str]:
    """The grid's cells without a kept run, as ``WORKLOAD:RANKS:RATE``, cheapest first."""
    absent = [(w, n, r) for w in WORKLOADS for n in RANKS for r in RATES if (w, n, r) not in cells]
    absent.sort(key=lambda c: (COST_S[c[0]] * RATE_FACTOR[c[2]] * (1 + c[1] / 8), c))
    return [f"{w}:{n}:{r}" for w, n, r in absent]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path, help="JSON files or folders")
    parser.add_argument("--cpus", type=int, default=16, help="the machine's cores (default 16)")
    parser.add_argument("--since", action="append", default=[], metavar="[WORKLOAD=]DATE",
                        help="leave out runs before this ISO date (of one workload: "
                             "WORKLOAD=DATE); repeatable")
    args = parser.parse_args(argv)
    since = dict(("", item) if "=" not in item else tuple(item.split("=", 1))  # type: ignore[misc]
                 for item in args.since)
    unknown = set(since) - {"", *WORKLOADS}
    if unknown:
        parser.error(f"--since: no workload {sorted(unknown)} (one of {', '.join(WORKLOADS)})")
    cells = newest([r for r in runs(args.paths) if kept(r, args.cpus, since)])
    order = {w: i for i, w in enumerate(WORKLOADS)}
    print(HEADER)
    print("|" + "---|" * HEADER.count(" | ") + "---|")
    for key in sorted(cells, key=lambda k: (order[k[0]], RATES.index(k[2]), k[1])):
        print(row(cells[key]))
    print()
    print(f"{len(cells)} of {len(WORKLOADS) * len(RANKS) * len(RATES)} cells; "
          f"from: {', '.join(sorted({cells[k]['file'] for k in cells}))}")
    gaps = missing(cells)
    print(f'missing ({len(gaps)}): CELLS="{" ".join(gaps)}"' if gaps else "missing: none")
    return 0


if __name__ == "__main__":
    sys.exit(main())
