#!/usr/bin/env bash
# The GPU checks of issue 11, for a machine with a GPU (one H100 here, torch 2.11+cu130,
# the checkout installed with `pip install --no-deps --no-build-isolation -e .`).
# Run from the repository root; results go to $OUT (default benchmarks/results/gpu).
# At most 9.5 minutes: every step has its own time limit (20 + 300 + 70 + 130 + 60 + 25 s;
# the two halves of the gpu tests run at once), a failing step does not stop the others,
# and $OUT/summary.txt lists each step's exit code. The device tool brings back at most eight
# files: give it OUT=$OUT/gpu and pack them after (`cd $OUT && tar czf gpu.tgz gpu && rm -r gpu`).
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
# Every gpu-marked test; a skip (no CUDA) is a failure here. The convergence grid (about 90 s
# alone) runs beside the others: one GPU, 16 cores, and neither half asserts a timing.
GPU_PYTEST="env SCALEOUT_REQUIRE_GPU=1 python3 -m pytest -q -m gpu -p no:cacheprovider
  --timeout 280"
# With pytest-xdist there (the H200 image has it), six workers: 27 tests in 77 s (stop 44).
XDIST=$(python3 -c 'import xdist' 2>/dev/null && echo "-n 6")
step gpu-tests 300 $GPU_PYTEST $XDIST --junitxml "$OUT/gpu-tests.xml" \
  --ignore tests/test_compression_convergence.py tests/ &
step gpu-convergence 300 $GPU_PYTEST --junitxml "$OUT/gpu-convergence.xml" \
  tests/test_compression_convergence.py &
wait
# The codec targets: 25M fp32 values, encode + decode vs one device-to-device copy, beside
# torch's fp16 and PowerSGD hooks on the same tensors.
step codecs-cuda 70 python3 -m scaleout.cli.main bench codecs --device cuda --sizes 25M \
  --repeats 10 --warmup 3 --json "$OUT/codecs-cuda.json"
# Training targets: ResNet-18, two ranks sharing the GPU over gloo, against DDP (>= 1.0x),
# and a lone rank over NCCL against the plain model in the same process (<= 3% over it).
step train-cuda-2 130 python3 -m scaleout.cli.main bench train --workload resnet18 --device cuda \
  --no-testbed --ranks 2 --vs ddp --rounds 3 --iters 20 --warmup 5 --threads 4 --no-progress \
  --json "$OUT/train-cuda-2.json"
step alone-cuda 60 env ROUNDS=5 python3 -m scaleout.cli.main run -n 1 benchmarks/gpu_alone.py
# The codecs on the CPU (4 threads), for the record: CUDA is hidden from that run.
step codecs-cpu 25 python3 -m scaleout.cli.main bench codecs --device cpu --sizes 1M \
  --threads 4 --repeats 3 --json "$OUT/codecs-cpu.json"
cat "$summary"
