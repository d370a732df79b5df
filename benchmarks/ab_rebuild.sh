#!/bin/bash
# A/B: the gradient path before the rebuild (b30210b) vs main, resnet18 at 1 Gbit/s vs DDP.
cd /tmp  # expects: git worktree add --detach /tmp/old b30210b
i=0
for v in old main main old old main; do
  i=$((i+1))
  src=/tmp/old/src; [ $v = main ] && src=/work/main/src
  echo "$(date -u +%T) run $i $v load $(cut -d' ' -f1-3 /proc/loadavg)" >> /tmp/ab/log
  PYTHONPATH=$src timeout 1200 python3 -m scaleout bench train --workload resnet18 --rounds 3 --iters 6 --warmup 2 --rate 1gbit --vs ddp --compression none --no-progress --json /tmp/ab/$i-$v.json > /tmp/ab/$i-$v.txt 2>&1
  echo "$(date -u +%T) done $i $v rc $?" >> /tmp/ab/log
done
