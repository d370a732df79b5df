#!/bin/bash
# usage: wloop.sh SRC N -- the bench worker (ddp-tuned:5) from SRC, N times, 2 busy loops beside
src=$1; n=$2
for k in 1 2; do (timeout 900 python3 -c "while True: pass" &) ; done
hangs=0
for i in $(seq 1 $n); do
  PYTHONPATH=$src timeout 40 python3 -m scaleout.cli.main run -n 2 -m scaleout.bench.train_worker --config ddp-tuned:5 --workload digits-mlp --batch 32 --warmup 1 --iters 3 --threads 1 --seed 0 --policy default --mode overlap --timeout 300.0 --device cpu --json /tmp/dl/out.json > /tmp/dl/w.log 2>&1
  rc=$?
  [ $rc != 0 ] && { hangs=$((hangs+1)); echo "run $i rc=$rc"; }
done
pkill -f "while True: pass"
echo "src=$src runs=$n bad=$hangs"
