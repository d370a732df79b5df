#!/bin/bash
# stop 38: the stop-24 collectives cells again, 5 rounds (was 3), to check the simulator's
# collectives validation on measurements it was not built on
set -eu
date -u +%FT%TZ; cut -d' ' -f1-3 /proc/loadavg
scaleout testbed up --hosts 3 --rate 1gbit --name cv38a
scaleout bench collectives -n 2 --testbed cv38a --ops allreduce,reduce_scatter,allgather,bcast,alltoall --sizes 1M,4M,16M,64M --rounds 5 --json collectives-testbed-2r-1gbit.json
scaleout bench collectives -n 3 --testbed cv38a --ops allreduce,reduce_scatter,allgather,bcast,alltoall --sizes 1M,4M,16M,64M --rounds 5 --json collectives-testbed-3r-1gbit.json
scaleout testbed down --name cv38a
scaleout testbed up --hosts 2 --rate 100mbit --name cv38b
scaleout bench collectives -n 2 --testbed cv38b --ops allreduce,reduce_scatter,allgather,bcast,alltoall --sizes 1M,4M,16M --rounds 5 --json collectives-testbed-2r-100mbit.json
scaleout testbed down --name cv38b
date -u +%FT%TZ; cut -d' ' -f1-3 /proc/loadavg
