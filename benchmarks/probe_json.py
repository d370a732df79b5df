"""The probes' output, as ``benchmarks/scaling.sh`` (``PROBE=1``) writes it, in the JSON form
``scaleout.sim.testbed_cases`` reads: the host probe's as ``PROBE_FILES`` names them
(``stop31/host-probe-3.json``), the lone calls' as ``LONE_CALLS_FILES`` does
(``stop35/lone-calls.json``). One row per rank and repeat, with the repeat's time and load.

    python benchmarks/probe_json.py OUT/probe-4-*.txt > benchmarks/results/stopNN/host-probe-4.json
    python benchmarks/probe_json.py OUT/lone-4-*.txt > benchmarks/results/stopNN/lone-calls-4.json
"""
import json
import os
import re
import sys

MACHINE = re.compile(r"^=== machine (\{.*\})\s*$")
COMMAND = re.compile(r"^=== command (.*\S)\s*$")
REPEAT = re.compile(r"^=== repeat (\d+) utc (\S+) loadavg (\S+) (\S+) (\S+)")
ROW = re.compile(r"^\[rank \d+\] (\{.*\})\s*$")


def machine(path: str) -> dict:
    """The machine the probe ran on, as scaling.sh wrote it into the file."""
    with open(path) as lines:
        for line in lines:
            if (m := MACHINE.match(line)):
                return json.loads(m[1])
    raise ValueError(f"{path}: no '=== machine' line")


def command(path: str) -> str | None:
    """The probe's command, where scaling.sh wrote it into the file (since stop 45)."""
    with open(path) as lines:
        for line in lines:
            if (m := COMMAND.match(line)):
                return m[1]
    return None


def rows(path: str) -> list[dict]:
    """Every rank's row in one probe file, each with its repeat, time and load."""
    found, meta = [], None
    with open(path) as lines:
        for line in lines:
            if (m := REPEAT.match(line)):
                meta = {"repeat": int(m[1]), "utc": m[2],
                        "loadavg_before": [float(m[i]) for i in (3, 4, 5)]}
            elif (m := ROW.match(line)) and meta is not None:
                found.append({**json.loads(m[1]), **meta})
    if not found:
        raise ValueError(f"{path}: no probe rows after a '=== repeat' line")
    return found


def main(paths: list[str]) -> dict:
    per_file = [rows(path) for path in paths]
    every = [row for found in per_file for row in found]
    hosts = {len({row["rank"] for row in found}) for found in per_file}
    said = command(paths[0]) or "benchmarks/host_cpu_probe.py 8 11 8, twice per rate"
    return {"command": f"PROBE=1 bash benchmarks/scaling.sh ... ({said}; "
                       f"{'/'.join(map(str, sorted(hosts)))} hosts)",
            "machine": machine(paths[0]),
            "files": [os.path.basename(p) for p in paths], "rows": every}


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    json.dump(main(sys.argv[1:]), sys.stdout, indent=1)
    print()
