"""The simulator's collectives cells against a re-measurement it was not built on.

python3 heldout.py DIR: every cell of DIR/collectives-testbed-{2r-1gbit,3r-1gbit,2r-100mbit}.json
(bus bandwidth, the bench's median over rounds) against ``predicted_busbw``, beside the stop-24
measurement the validation stores (``MEASURED``); the 2-rank 1 Gbit/s allreduce, the link's
training split, is left out as there. Prints a table and the within-15% counts.
"""
import json
import statistics
import sys
from pathlib import Path

from scaleout.sim.collective_cases import MEASURED, RELATIVE_BOUND, _bus, predicted_busbw

old = {(r, rate, op, n): times for r, rate, op, n, *times in MEASURED}
rows, errors_new, errors_old = [], [], []
for name, ranks, rate in (("2r-1gbit", 2, "1gbit"), ("3r-1gbit", 3, "1gbit"),
                          ("2r-100mbit", 2, "100mbit")):
    data = json.loads((Path(sys.argv[1]) / f"collectives-testbed-{name}.json").read_text())
    for cell in data["results"]:
        op, nbytes = cell["op"], cell["bytes"]
        if (ranks, rate, op, nbytes) not in old:  # (the training split)
            continue
        for impl, key, was in (("scaleout", "time_s", 0), ("torch", "torch_time_s", 1)):
            measured = nbytes / cell[key] * _bus(op, ranks) / 1e9
            before = nbytes / (old[ranks, rate, op, nbytes][was] / 1e3) * _bus(op, ranks) / 1e9
            predicted = predicted_busbw(op, ranks, rate, nbytes, impl) / 1e9
            err_new, err_old = predicted / measured - 1, predicted / before - 1
            errors_new.append(abs(err_new))
            errors_old.append(abs(err_old))
            rows.append(f"| {impl} {op} {nbytes / 2**20:.0f}MB | {ranks} | {rate} | {before:.3f} "
                        f"| {measured:.3f} | {predicted:.3f} | {100 * err_old:+.1f}% "
                        f"| {100 * err_new:+.1f}%{' FAIL' if abs(err_new) > RELATIVE_BOUND else ''} |")
print("| cell | ranks | rate | stop 24 GB/s | stop 38 GB/s | predicted | error (stop 24) | error (stop 38) |")
print("|---|---:|---|---:|---:|---:|---:|---:|")
print("\n".join(rows))
for label, errs in (("stop 24", errors_old), ("stop 38", errors_new)):
    inside = sum(e <= RELATIVE_BOUND for e in errs)
    print(f"{label}: {inside}/{len(errs)} within {RELATIVE_BOUND:.0%}; median |error| "
          f"{100 * statistics.median(errs):.1f}%")
