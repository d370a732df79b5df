#!/bin/bash
# usage: spy.sh CONFIG TAG
cd /work/main
torchrun --nproc_per_node 2 --master_port 29612 benchmarks/cpu_per_iteration.py $1 resnet18 40 > /tmp/s46/spy-$2.out 2>&1 &
sleep 30
pid=$(pgrep -f "cpu_per_iteration.py $1" | while read p; do if grep -q "RANK=0" /proc/$p/environ 2>/dev/null && tr '\0' '\n' < /proc/$p/environ | grep -qx "RANK=0"; then echo $p; fi; done | head -1)
echo "rank0 pid $pid"
py-spy record --pid $pid --native --format raw -r 50 -d 30 -o /tmp/s46/spy-$2.txt > /tmp/s46/spy-$2.log 2>&1
wait
