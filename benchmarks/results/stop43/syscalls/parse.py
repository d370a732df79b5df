"""Per-thread syscall counts from perf trace -s; per-iteration by difference of two runs."""
import re, sys, collections
def parse(path):
    threads = {}  # (name, tid) -> {syscall: (calls, msec)}
    cur = None
    for line in open(path):
        m = re.match(r"^ (\S.*) \((\d+)\), (\d+) events", line)
        if m:
            cur = (m.group(1), int(m.group(2))); threads[cur] = {}
            continue
        m = re.match(r"^\s+(\w+)\s+(\d+)\s+(\d+)\s+([\d.]+)", line)
        if m and cur:
            threads[cur][m.group(1)] = (int(m.group(2)), float(m.group(4)))
    return threads
def by_name(threads):
    # aggregate by thread name, but keep python threads apart by order of tid within process? sum by name
    agg = collections.defaultdict(lambda: collections.Counter())
    t = collections.defaultdict(lambda: collections.Counter())
    for (name, tid), calls in threads.items():
        for sc, (n, ms) in calls.items():
            agg[name][sc] += n; t[name][sc] += ms
    return agg, t
a, b, iters = sys.argv[1], sys.argv[2], float(sys.argv[3])
A, At = by_name(parse(a)); B, Bt = by_name(parse(b))
for name in sorted(set(A) | set(B)):
    rows = []
    for sc in set(A[name]) | set(B[name]):
        d = (B[name][sc] - A[name][sc]) / iters
        dt = (Bt[name][sc] - At[name][sc]) / iters
        if abs(d) >= 2:
            rows.append((d, dt, sc))
    if rows:
        print(name, " ".join(f"{sc}={d:.0f}({dt:.1f}ms)" for d, dt, sc in sorted(rows, reverse=True)))
