#!/bin/bash
# A/B of two source trees on one bench train command: runs alternate before/after, PAIRS
# times; each run's JSON and text go to OUT/<before|after>-<workload>-<rate>-<i>.*, and each
# run's scaleout row is printed. The trees' src/ go on PYTHONPATH (e.g. a `git worktree add
# --detach /tmp/before <commit>` beside the working tree).
#   usage: ab_trees.sh BEFORE_SRC AFTER_SRC OUT PAIRS WORKLOAD RATE [bench train options...]
#   e.g.:  ab_trees.sh /tmp/before/src src /tmp/ab 4 transformer 1gbit --vs ddp --rounds 3
set -u
before=$1; after=$2; out=$3; pairs=$4; workload=$5; rate=$6; shift 6
mkdir -p "$out"
for i in $(seq 1 "$pairs"); do
  for tree in before after; do
    src=$after; [ "$tree" = before ] && src=$before
    name="$out/$tree-$workload-$rate-$i"
    PYTHONPATH=$src scaleout bench train --workload "$workload" --rate "$rate" --no-progress \
      --json "$name.json" "$@" > "$name.txt" 2>&1
    echo "$tree $i $(grep -E '^ +scaleout ' "$name.txt")"
  done
done
