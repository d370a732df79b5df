"""The hybrid DLRM's ratio over DDP (median of per-round ratios of median iterations) in every
stored run, as reported, with every configuration's first and last timed iteration dropped,
and with two middle iterations dropped instead (control)."""
import glob, json, statistics, collections, sys
root = sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results"
def ratio(rounds, a, b, cut):
    rs = [statistics.median(cut(r[b])) / statistics.median(cut(r[a])) for r in rounds if a in r and b in r]
    return statistics.median(rs) if rs else None
mid = lambda t: t[: len(t)//2 - 1] + t[len(t)//2 + 1:]
out = collections.defaultdict(list)
for path in sorted(glob.glob(f"{root}/**/*.json", recursive=True)):
    try: doc = json.load(open(path))
    except Exception: continue
    if not isinstance(doc, dict) or not isinstance(doc.get("runs"), list): continue
    rounds = collections.defaultdict(dict)
    for run in doc["runs"]:
        if isinstance(run, dict) and run.get("iter_s") and len(run["iter_s"]) >= 6:
            rounds[run["round"]][run["config"]] = run["iter_s"]
    rounds = list(rounds.values())
    for a, b in (("hybrid", "ddp"), ("hybrid", "hybrid-lockstep"), ("scaleout", "ddp"), ("scaleout", "lockstep-traffic")):
        r0 = ratio(rounds, a, b, lambda t: t)
        if r0 is None: continue
        r1 = ratio(rounds, a, b, lambda t: t[1:-1]); rc = ratio(rounds, a, b, mid)
        out[(a, b)].append((r0, r1, rc, path.split("results/")[1]))
for (a, b), rows in out.items():
    d1 = [r1 / r0 - 1 for r0, r1, rc, _ in rows]; dc = [rc / r0 - 1 for r0, r1, rc, _ in rows]
    print(f"{a}/{b}: {len(rows)} runs; dropping first+last: median {statistics.median(d1):+.2%} "
          f"(lowered in {sum(x < 0 for x in d1)/len(d1):.0%}); control (two middle): median {statistics.median(dc):+.2%} "
          f"(lowered in {sum(x < 0 for x in dc)/len(dc):.0%})")
for r0, r1, rc, p in out[("hybrid", "ddp")]:
    if "stop27/hyb" in p or "stop29" in p or "stop34" in p:
        print(f"   {p}: hybrid/ddp reported {r0:.2f}x, steady-state {r1:.2f}x")
