#!/bin/bash
# usage: hostrun.sh SRC CONFIG WORKLOAD ITERS: 2 ranks on this machine meeting on its host name
export GLIBC_TUNABLES=glibc.malloc.trim_threshold=1073741824:glibc.malloc.mmap_threshold=1073741824
SRC=$1; shift
mpirun --allow-run-as-root -np 2 bash -c "RANK=\$OMPI_COMM_WORLD_RANK WORLD_SIZE=\$OMPI_COMM_WORLD_SIZE LOCAL_RANK=\$OMPI_COMM_WORLD_LOCAL_RANK LOCAL_WORLD_SIZE=\$OMPI_COMM_WORLD_LOCAL_SIZE MASTER_ADDR=$(hostname) MASTER_PORT=29561 OMP_NUM_THREADS=1 PYTHONPATH=$SRC exec python3 /work/main/benchmarks/cpu_per_iteration.py $*" 2>&1 | grep -E 'ranks:'
