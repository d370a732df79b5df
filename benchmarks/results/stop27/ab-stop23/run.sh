cd /tmp
i=0
for v in old main main old old main; do
  i=$((i+1))
  src=/tmp/old23/src; [ $v = main ] && src=/work/main/src
  echo "$(date -u +%T) run $i $v load $(cut -d' ' -f1-3 /proc/loadavg)" >> /tmp/ab27/log
  PYTHONPATH=$src flock /tmp/scaleout-bench.lock timeout 900 python3 -m scaleout bench train --workload dlrm --parallel hybrid --vs ddp --rounds 5 --iters 40 --warmup 3 --rate 1gbit --memory-budget 4m --no-progress --json /tmp/ab27/$i-$v.json > /tmp/ab27/$i-$v.txt 2>&1
  echo "$(date -u +%T) done $i $v rc $?" >> /tmp/ab27/log
done
