#!/usr/bin/env bash
# One device call for a session lent the GPU machine (15 minutes of device time, all calls
# and starts together): set-up, the gpu tests, then issue 16's scaling cells, within BUDGET
# seconds of the command. Run from the repository root there, carrying `.devdebs` (iproute2,
# ../shared/device/README.md) and `.whl` (cryptography, cffi, pycparser: the H200 image lacks
# cryptography; `pip download --no-deps --only-binary=:all: --python-version 3.12 ...`).
#
#   CELLS="dlrm:8:10gbit dlrm:4:10gbit transformer:8:10gbit" ROUNDS=3 BUDGET=560 \
#     bash benchmarks/device.sh
#
# `python3 benchmarks/scaling_table.py benchmarks/results --since dlrm=2026-11-28T18:30` prints the
# scaling table so far and the cells it still lacks, cheapest first, as a CELLS line.
#
# Stop 44 ran this sequence (its steps by hand): set-up 10 s, gpu tests 77 s, seven cells in
# 390 s. GPU_TESTS=0 skips the tests. Results: $OUT/{device,gpu-tests}.txt, gpu-tests.xml and
# scaling.tgz (the device tool brings back eight files at most).
set -u
OUT=${OUT:-/tmp/device-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
BUDGET=${BUDGET:-560} ROUNDS=${ROUNDS:-2} GPU_TESTS=${GPU_TESTS:-1} CELLS=${CELLS:-}
if compgen -G ".devdebs/*.deb" > /dev/null; then
  ipr=$(mktemp -d) && for f in .devdebs/*.deb; do dpkg -x "$f" "$ipr"; done
  export PATH=$ipr/usr/sbin:$ipr/sbin:$ipr/usr/bin:$ipr/bin:$PATH
  export LD_LIBRARY_PATH=$ipr/usr/lib/x86_64-linux-gnu:$ipr/lib/x86_64-linux-gnu
fi
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
{ date -u; nproc; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import torch, scaleout; print(torch.__version__, torch.version.cuda,
    torch.cuda.is_available(), scaleout.__version__)'
  git log --oneline -1; ip -V; } > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"
if [[ $GPU_TESTS == 1 ]]; then
  XDIST=$(python3 -c 'import xdist' 2>/dev/null && echo "-n 6")
  timeout 150 env SCALEOUT_REQUIRE_GPU=1 python3 -m pytest -q -m gpu -p no:cacheprovider \
    --timeout 140 $XDIST --junitxml "$OUT/gpu-tests.xml" \
    --ignore tests/test_compression_convergence.py tests/ > "$OUT/gpu-tests.txt" 2>&1
  echo "gpu tests: exit $? at $SECONDS s"; tail -3 "$OUT/gpu-tests.txt"
fi
if [[ -n $CELLS ]]; then
  rm -rf /tmp/scaling
  OUT=/tmp/scaling DEADLINE=$((BUDGET - SECONDS - 15)) MIN_LEFT=${MIN_LEFT:-40} ROUNDS=$ROUNDS \
    bash benchmarks/scaling.sh $CELLS
  (cd /tmp && tar czf "$OUT/scaling.tgz" scaling)
  grep -h -B2 -A6 'ms/it' /tmp/scaling/*.txt
fi
echo "done at $SECONDS s"
