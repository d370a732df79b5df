#!/usr/bin/env bash
# Issue 16's scaling table: `scaleout bench train` at several rank counts and rates on the
# testbed, for a machine with spare cores (the device machine: 16 cores, CUDA hidden). Each
# argument is one run, WORKLOAD:RANKS:RATE; every run has scaleout (exact gradients), DDP and
# the ceiling lockstep-traffic, and lockstep too at 1 Gbit/s (the simulator's slowdown), with
# 2 torch threads per rank at every rank count (8 x 2 = 16 cores), 2 interleaved rounds.
# Runs go in the order given; one is skipped when less than MIN_LEFT seconds remain before
# DEADLINE (seconds from the start), and the last is cut off at the deadline. Results:
# $OUT/<workload>-<ranks>-<rate>.{json,txt}, and $OUT/summary.txt. PROBE=1 runs the probes of
# the simulator's testbed link (issue 13) on a testbed of the same size and rate before each
# run, twice each: the host's CPU (`benchmarks/host_cpu_probe.py 8 11 8`,
# $OUT/probe-<ranks>-<rate>.txt) and the lone calls (`benchmarks/lone_call_probe.py 5 15 3`, 3
# trials at 100 Mbit/s; $OUT/lone-<ranks>-<rate>.txt). `python benchmarks/probe_json.py
# $OUT/probe-R-*.txt` (and `$OUT/lone-R-*.txt`) makes the JSON sim/testbed_cases reads.
# The device tool brings back at most eight files: pack them (`cd $OUT && tar czf all.tgz *`).
#
#   OUT=/tmp/scaling DEADLINE=570 bash benchmarks/scaling.sh resnet18:8:1gbit resnet18:4:1gbit
set -u
OUT=${OUT:-benchmarks/results/scaling}
DEADLINE=${DEADLINE:-3600}
MIN_LEFT=${MIN_LEFT:-90}
ROUNDS=${ROUNDS:-2}
PROBE=${PROBE:-0}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=
summary="$OUT/summary.txt"
for spec in "$@"; do
  IFS=: read -r workload ranks rate <<< "$spec"
  name="$workload-$ranks-$rate"
  left=$((DEADLINE - SECONDS))
  if (( left < MIN_LEFT )); then
    echo "$name: skipped, $left s left" | tee -a "$summary"; continue
  fi
  if [[ $PROBE == 1 && ! -e $OUT/probe-$ranks-$rate.txt ]]; then
    testbed=probe$ranks trials=5
    [[ $rate == 100mbit ]] && trials=3
    scaleout testbed up --name $testbed --hosts $ranks --rate $rate > "$OUT/testbed-$ranks-$rate.txt" 2>&1
    # the host's CPU per collective and per MB, then the median lone call of each size (the
    # simulator's link: sim/testbed_cases.HOST_PROBE and LONE_CALLS), each twice
    for kind in probe lone; do
      file=$OUT/$kind-$ranks-$rate.txt args="8 11 8" script=host_cpu_probe.py
      [[ $kind == lone ]] && args="$trials 15 3" script=lone_call_probe.py
      echo "=== $kind: $ranks hosts at $rate" | tee "$file"
      echo "=== command SCALEOUT_PROBE_RATE=$rate scaleout run -n $ranks --testbed NAME" \
        "benchmarks/$script $args (twice)" >> "$file"
      python3 -c 'import json, os, platform, torch; print("=== machine", json.dumps({"cpus":
        os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__}))' >> "$file"
      for repeat in 1 2; do
        utc=$(date -u +%Y-%m-%dT%H:%M:%SZ) load=$(cut -d' ' -f1-3 /proc/loadavg)
        echo "=== repeat $repeat utc $utc loadavg $load" >> "$file"
        SCALEOUT_PROBE_RATE=$rate timeout $((left / 6)) scaleout run -n $ranks \
          --testbed $testbed benchmarks/$script $args >> "$file" 2>&1
      done
    done
    scaleout testbed down --name $testbed >> "$OUT/testbed-$ranks-$rate.txt" 2>&1
    left=$((DEADLINE - SECONDS))
  fi
  case $workload in
    resnet18) iters="--iters 6 --warmup 2";;
    transformer) iters="--iters 8 --warmup 2";;
    *) iters="--iters 40 --warmup 5";;
  esac
  vs=ddp,lockstep-traffic
  [[ $rate == 1gbit ]] && vs=ddp,lockstep,lockstep-traffic
  cmd="scaleout bench train --workload $workload --ranks $ranks --rate $rate --vs $vs
    --rounds $ROUNDS $iters --threads 2 --no-progress --json $OUT/$name.json"
  echo "=== $name: $cmd" | tee "$OUT/$name.txt"
  started=$SECONDS
  timeout "$left" $cmd >> "$OUT/$name.txt" 2>&1
  echo "$name: exit $? after $((SECONDS - started)) s" | tee -a "$summary"
done
