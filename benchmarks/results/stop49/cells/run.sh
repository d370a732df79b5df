#!/usr/bin/env bash
# Issue 16's cells and the README's ResNet-18 1 Gbit/s figure, on the stop-49 harness (lead-in,
# checks, ddp-tuned with torch's own layout). Run from the repository root.
set -u
out=benchmarks/results/stop49/cells
run() {  # workload rate iters warmup
  scaleout bench train --workload "$1" --rate "$2" --vs ddp,ddp-tuned,lockstep-traffic --rounds 5 \
    --iters "$3" --warmup "$4" --no-progress --json "$out/$1-$2.json" > "$out/$1-$2.txt" 2>&1
  echo "$1 $2 rc=$?"
}
run dlrm 10gbit 40 5
run transformer 1gbit 6 2
run resnet18 10gbit 6 2
run resnet18 1gbit 6 2
