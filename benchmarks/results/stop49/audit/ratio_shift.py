"""Recompute each stored run's scaleout/PEER ratio (median of per-round ratios, as
train_report.summarize) with every configuration's first timed iteration dropped."""
import glob, json, statistics, sys, collections
root = sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results"
changes = collections.defaultdict(list); worst = []
for path in glob.glob(f"{root}/**/*.json", recursive=True):
    try: doc = json.load(open(path))
    except Exception: continue
    if not isinstance(doc, dict) or not isinstance(doc.get("runs"), list) or "summary" not in doc: continue
    rounds = collections.defaultdict(dict)
    for run in doc["runs"]:
        if isinstance(run, dict) and run.get("iter_s") and len(run["iter_s"]) >= 4:
            rounds[run["round"]][run["config"]] = run["iter_s"]
    for so in {c for r in rounds.values() for c in r if c.startswith("scaleout")}:
        for peer in {c for r in rounds.values() for c in r if c.startswith("ddp")}:
            both = [r for r in rounds.values() if so in r and peer in r]
            if not both: continue
            a = statistics.median([statistics.median(r[peer]) / statistics.median(r[so]) for r in both])
            b = statistics.median([statistics.median(r[peer][1:]) / statistics.median(r[so][1:]) for r in both])
            changes[peer.split(":")[0]].append(b / a - 1)
            worst.append((b / a - 1, path.split("results/")[1], so, peer, round(a, 3), round(b, 3)))
for peer, ch in changes.items():
    print(f"{so if False else 'scaleout*'}/{peer}: {len(ch)} benchmarks; ratio change when iteration 0 is dropped: "
          f"median {statistics.median(ch):+.2%}, mean {statistics.mean(ch):+.2%}, "
          f"share lowered {sum(c < 0 for c in ch)/len(ch):.0%}, share raised {sum(c > 0 for c in ch)/len(ch):.0%}")
worst.sort()
print("largest drops:")
for w in worst[:8]: print("  %+.2f%%  %s  %s vs %s  %s -> %s" % (w[0]*100, *w[1:]))
