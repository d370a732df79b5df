#!/bin/bash
cd /work/main
for i in 1 2 3; do
  for c in scaleout ddp; do
    CPU_JSON=/tmp/s46/cpu.jsonl torchrun --nproc_per_node 2 --master_port 29611 benchmarks/cpu_per_iteration.py $c resnet18 25 2>&1 | grep -v Warning
  done
done
