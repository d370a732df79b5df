#!/bin/bash
# issue 16's exact cells on this session's machine, one run each, in sequence
cd "$(dirname "$0")"
for cell in "dlrm 10gbit 40 5" "transformer 1gbit 6 2" "resnet18 10gbit 6 2"; do
  set -- $cell
  s=$(date -u +%H:%M:%S)
  scaleout bench train --workload $1 --rate $2 --vs ddp,lockstep-traffic --rounds 5 --iters $3 --warmup $4 --no-progress --json $1-$2.json > $1-$2.txt 2>&1
  echo "$1 $2 rc=$? $s-$(date -u +%H:%M:%S)"
done
