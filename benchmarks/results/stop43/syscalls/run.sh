#!/bin/bash
# usage: run.sh CONFIG ITERS TAG -- ResNet-18, 2 ranks on loopback, under perf trace -s (syscalls per thread)
cd /work/main
cfg=$1; iters=$2; tag=$3
perf trace -s -o /tmp/perf/$tag.trace -- torchrun --nproc_per_node 2 benchmarks/cpu_per_iteration.py $cfg resnet18 $iters > /tmp/perf/$tag.out 2>&1
echo "$tag rc=$?"
