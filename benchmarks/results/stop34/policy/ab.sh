#!/bin/bash
# usage: ab.sh WORKLOAD RATE PAIRS EXTRA...
w=$1; r=$2; n=$3; shift 3
for i in $(seq 1 $n); do for t in before after; do
  src=/work/main/src; [ $t = before ] && src=/tmp/before/src
  PYTHONPATH=$src scaleout bench train --workload $w --rate $r --no-progress --json /tmp/pol/$t-$w-$r-$i.json "$@" > /tmp/pol/$t-$w-$r-$i.txt 2>&1
  echo "$t $i $(grep -E '^ +scaleout ' /tmp/pol/$t-$w-$r-$i.txt)"
done; done
