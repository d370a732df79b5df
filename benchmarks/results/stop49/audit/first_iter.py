"""How often is a configuration's first timed iteration its fastest, and what does dropping it
do to the run's median?  Reads every stored bench-train JSON under benchmarks/results."""
import glob, json, statistics, sys, collections
root = sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results"
fastest = collections.Counter(); total = collections.Counter()
shift = collections.defaultdict(list); first_ratio = collections.defaultdict(list)
for path in glob.glob(f"{root}/**/*.json", recursive=True):
    try:
        doc = json.load(open(path))
    except Exception:
        continue
    if not isinstance(doc, dict) or "runs" not in doc or not isinstance(doc["runs"], list):
        continue
    for run in doc["runs"]:
        times = run.get("iter_s") if isinstance(run, dict) else None
        if not times or len(times) < 4:
            continue
        name = run["config"].split("+")[0] if run["config"].startswith("scaleout+") else run["config"]
        if name.startswith("ddp-tuned"): name = "ddp-tuned"
        total[name] += 1
        fastest[name] += times[0] == min(times)
        rest = times[1:]
        shift[name].append(statistics.median(rest) / statistics.median(times) - 1)
        first_ratio[name].append(times[0] / statistics.median(rest))
print(f"{'config':<22}{'runs':>6}{'it0 fastest':>13}{'it0/median(rest)':>18}{'median(rest)/median(all)-1':>28}")
for name in sorted(total, key=lambda n: -total[n]):
    if total[name] < 5: continue
    print(f"{name:<22}{total[name]:>6}{fastest[name]/total[name]:>12.0%} {statistics.median(first_ratio[name]):>17.3f}"
          f"{statistics.median(shift[name]):>+27.2%}  (mean {statistics.mean(shift[name]):+.2%})")
