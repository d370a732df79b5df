"""Per configuration, in stored bench-train runs: the first and the last timed iteration
against the median of the iterations between them."""
import glob, json, statistics, collections, sys
root = sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results"
first = collections.defaultdict(list); last = collections.defaultdict(list)
for path in glob.glob(f"{root}/**/*.json", recursive=True):
    try: doc = json.load(open(path))
    except Exception: continue
    if not isinstance(doc, dict) or not isinstance(doc.get("runs"), list): continue
    for run in doc["runs"]:
        t = run.get("iter_s") if isinstance(run, dict) else None
        if not t or len(t) < 5: continue
        name = run["config"]
        name = "scaleout+*" if name.startswith("scaleout+") else "ddp-tuned*" if name.startswith("ddp-tuned") else name
        mid = statistics.median(t[1:-1])
        first[name].append(t[0] / mid); last[name].append(t[-1] / mid)
print(f"{'config':<20}{'runs':>6}{'first/mid':>11}{'last/mid':>10}")
for name in sorted(first, key=lambda n: -len(first[n])):
    if len(first[name]) >= 20:
        print(f"{name:<20}{len(first[name]):>6}{statistics.median(first[name]):>11.3f}{statistics.median(last[name]):>10.3f}")
