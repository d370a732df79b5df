#!/bin/bash
# alternate scaleout tune on the old (sequential) and new (choice, runner-up, choice) check
out=$1; pairs=$2; shift 2
cd /work/main
for i in $(seq 1 $pairs); do
  for tree in before after; do
    src=/work/main/src; [ $tree = before ] && src=/tmp/wt-base/src
    name=$out/$tree-$i
    start=$(date -u +%H:%M:%S)
    PYTHONPATH=$src scaleout tune --workload resnet18 --rate 100mbit --iters 3 --json $name.json "$@" > $name.txt 2>&1
    echo "$tree $i rc=$? $start-$(date -u +%H:%M:%S) $(grep -E 'measured per iteration' $name.txt | head -1)"
  done
done
