#!/usr/bin/env bash
# The GPU checks of issue 11, for a machine with a GPU (one H100 here, torch 2.11+cu130,
# the checkout installed with `pip install --no-deps --no-build-isolation -e .`).
# Run from the repository root; results go to $OUT (default benchmarks/results/gpu).
# At most 7 minutes: every step has its own time limit (20 + 300 + 70 + 30 s), a failing
# step does not stop the others, and $OUT/summary.txt lists each step's exit code.
#
#   OUT=/tmp/gpu bash benchmarks/gpu.sh
set -u
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
summary="$OUT/summary.txt"
: > "$summary"

step() {  # name, time limit in seconds, then the command
  local name=$1 limit=$2; shift 2
  local started=$SECONDS
  echo "=== $name: $*" | tee "$OUT/$name.txt"
  timeout "$limit" "$@" >> "$OUT/$name.txt" 2>&1
  local code=$?
  echo "$name: exit $code after $((SECONDS - started)) s (limit $limit s)" | tee -a "$summary"
}

step device 20 bash -c 'date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1;
  python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)"'
# Every gpu-marked test; a skip (no CUDA) is a failure here.
step gpu-tests 300 env SCALEOUT_REQUIRE_GPU=1 python3 -m pytest -q -m gpu -p no:cacheprovider \
  --timeout 280 --junitxml "$OUT/gpu-tests.xml" tests/
# The codec targets: 25M fp32 values, encode + decode vs one device-to-device copy, beside
# torch's fp16 and PowerSGD hooks on the same tensors.
step codecs-cuda 70 python3 -m scaleout.cli.main bench codecs --device cuda --sizes 25M \
  --repeats 10 --warmup 3 --json "$OUT/codecs-cuda.json"
# The same on the CPU (4 threads), for the record: CUDA is hidden from that run.
step codecs-cpu 30 python3 -m scaleout.cli.main bench codecs --device cpu --sizes 1M \
  --threads 4 --repeats 3 --json "$OUT/codecs-cpu.json"
cat "$summary"
