"""The first-timed-iteration bias on scaleout/ddp (median of per-round ratios) by --iters."""
import glob, json, statistics, collections
by = collections.defaultdict(list)
for path in glob.glob("benchmarks/results/**/*.json", recursive=True):
    try: doc = json.load(open(path))
    except Exception: continue
    if not isinstance(doc, dict) or not isinstance(doc.get("runs"), list): continue
    rounds = collections.defaultdict(dict)
    for run in doc["runs"]:
        if isinstance(run, dict) and run.get("iter_s") and len(run["iter_s"]) >= 4:
            rounds[run["round"]][run["config"]] = run["iter_s"]
    both = [r for r in rounds.values() if "scaleout" in r and "ddp" in r]
    if not both: continue
    n = len(both[0]["scaleout"])
    a = statistics.median([statistics.median(r["ddp"]) / statistics.median(r["scaleout"]) for r in both])
    b = statistics.median([statistics.median(r["ddp"][1:]) / statistics.median(r["scaleout"][1:]) for r in both])
    by[n].append(b / a - 1)
for n in sorted(by):
    v = by[n]
    if len(v) >= 5:
        print(f"--iters {n:>3}: {len(v):>4} benchmarks, scaleout/ddp when iteration 0 is dropped: median {statistics.median(v):+.2%}, "
              f"mean {statistics.mean(v):+.2%}, lowered in {sum(x < 0 for x in v)/len(v):.0%}")
