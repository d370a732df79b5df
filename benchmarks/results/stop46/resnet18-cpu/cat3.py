import sys, re, collections
def short(f): return re.sub(r"\s*\(.*", "", f)
def cat(stack):
    frames = stack.split(";")
    py = [f for f in frames if ".py:" in f]
    s = ";".join(py)
    if "cpu_per_iteration.py:101" in s: phase = "fwd"
    elif "cpu_per_iteration.py:103" in s: phase = "bwd"
    elif "cpu_per_iteration.py:104" in s or "cpu_per_iteration.py:105" in s: phase = "step"
    else: return None
    nat = frames[-1] if ".py:" not in frames[-1] else ""
    natname = "(py)" if not nat else ("jit?" if nat.startswith("0x") else short(nat)[:50])
    if "torch/optim" in s: return phase, "optim"
    inner = py[-1]
    # first scaleout frame that is not forward nor the workload
    sc = [f for f in py if "scaleout/" in f and "workloads" not in f and "DataParallel.forward" not in f and "Module._call_impl" not in f]
    if sc: return phase, "scaleout>" + short(sc[0])
    m = re.search(r"\((.*)\)", inner)
    return phase, (m.group(1) if m else inner) + "|" + natname
import itertools
res = {}
for fn in sys.argv[1:]:
    c = collections.Counter(); total = 0
    for line in open(fn):
        stack, n = line.rsplit(" ", 1); n = int(n)
        r = cat(stack)
        if r is None: continue
        c[r] += n; total += n
    res[fn] = (c, total)
keys = set()
for c, t in res.values(): keys |= {k for k in c if k[0] != "bwd" or True}
agg = []
for k in keys:
    vals = [100 * res[f][0][k] / res[f][1] for f in sys.argv[1:]]
    agg.append((max(vals), k, vals))
agg.sort(reverse=True)
print("files:", [f.split('/')[-1] for f in sys.argv[1:]], "samples", [res[f][1] for f in sys.argv[1:]])
for _, k, vals in agg[:45]:
    print(" ".join(f"{v:6.2f}" for v in vals), k[0], k[1])
