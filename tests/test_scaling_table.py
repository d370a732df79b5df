"""``benchmarks/scaling_table.py``: issue 16's scaling table from the runs' JSON files, the
newest run of each cell, and the cells still missing."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks/scaling_table.py"
_spec = importlib.util.spec_from_file_location("scaling_table", SCRIPT)
assert _spec is not None and _spec.loader is not None
table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(table)


def _result(path: Path, workload: str, ranks: int, rate: str, date: str, ms: float,
            cpus: int = 16, compression: list[str] | None = None) -> None:
    summary = {
        "single": {"iter_ms": 100.0, "efficiency": None},
        "scaleout": {"iter_ms": ms, "efficiency": 0.5, "exposed_ms_per_iter": 7.0,
                     "bytes_per_iter": 2.5e6, "over_peers": {"ddp": 1.01},
                     "over_peers_per_round": {"ddp": [1.0, 1.02]}},
        "ddp": {"iter_ms": 101.0, "efficiency": 0.49},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "date": date, "machine": {"cpus": cpus, "torch": "2.13.0"}, "summary": summary,
        "settings": {"workload": workload, "ranks": ranks, "rate": rate, "rounds": 2,
                     "testbed": True, "compression": compression or ["none"]}}))


def test_the_newest_exact_run_of_each_cell_on_the_machine_asked_for(tmp_path: Path) -> None:
    _result(tmp_path / "stop1/dlrm-4-1gbit.json", "dlrm", 4, "1gbit", "2026-11-25T13:00", 90.0)
    _result(tmp_path / "stop2/dlrm-4-1gbit.json", "dlrm", 4, "1gbit", "2026-11-28T19:00", 80.0)
    _result(tmp_path / "stop2/x.json", "dlrm", 8, "1gbit", "2026-11-28T19:00", 70.0, cpus=2)
    _result(tmp_path / "stop2/y.json", "dlrm", 2, "1gbit", "2026-11-28T19:00", 60.0,
            compression=["powersgd:2"])
    (tmp_path / "stop2/other.json").write_text('{"not": "a bench result"}')
    cells = table.newest([r for r in table.runs([tmp_path]) if table.kept(r, 16, {})])
    assert list(cells) == [("dlrm", 4, "1gbit")]
    line = table.row(cells["dlrm", 4, "1gbit"])
    assert line.startswith("| dlrm | 4 | 1gbit | 100.0 | 80.0 (0.50) | 101.0 (0.49) | - | - | "
                           "**1.010** (1.000/1.020) | - | 7 | 2.50 | 2 | 2026-11-28T19:00 |")
    gaps = table.missing(cells)
    assert len(gaps) == 26 and "dlrm:4:1gbit" not in gaps and gaps[0] == "dlrm:2:10gbit"
    assert gaps[-1] == "resnet18:8:100mbit"  # (the slowest last)
    later = {"dlrm": "2026-11-28T20:00"}
    assert not [r for r in table.runs([tmp_path]) if table.kept(r, 16, later)]


def test_the_command_prints_the_table_and_the_missing_cells(tmp_path: Path) -> None:
    _result(tmp_path / "a.json", "resnet18", 8, "10gbit", "2026-11-28T17:38", 960.9)
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--since",
                          "dlrm=2026-11-28T18:30"], capture_output=True, text=True, check=True)
    assert "| resnet18 | 8 | 10gbit |" in out.stdout and "1 of 27 cells" in out.stdout
    assert 'missing (26): CELLS="dlrm:2:10gbit' in out.stdout
    wrong = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--since", "bert=1"],
                           capture_output=True, text=True)
    assert wrong.returncode == 2 and "no workload ['bert']" in wrong.stderr
