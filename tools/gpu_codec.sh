#!/usr/bin/env bash
# FP4 codec kernels on a CUDA machine: install, benchmark, GPU tests. Writes everything under $OUT.
# Used with the device tool (`run`, kind nvidia-h200):  bash tools/gpu_codec.sh [--quick]
#   --quick: the benchmark without the launch sweep. BENCH_TIMEOUT / TEST_TIMEOUT / JOBS override limits.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_codec_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
T0=$(date +%s)
{
  date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
  python3 -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  python3 -c "import pydantic; print('pydantic', pydantic.VERSION)" 2>&1 | tail -1
} 2>&1 | tee "$OUT/env.txt"

# No install: `pip install -e .` fails offline there (setuptools' develop re-runs pip with build isolation,
# which wants to download setuptools). The repo root goes on PYTHONPATH and the tests/bench alias the
# top-level kernels/ package as megatron_qrl.kernels (the name an install gives it).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

echo "== benchmark ($(( $(date +%s) - T0 )) s)"
SWEEP=""; [ "${1:-}" = "--quick" ] && SWEEP="--no-sweep"
timeout ${BENCH_TIMEOUT:-130} python3 tools/bench_codec.py --out "$OUT" --rep-ms 100 $SWEEP 2>&1 | tee "$OUT/bench.log"
echo "bench rc=${PIPESTATUS[0]} ($(( $(date +%s) - T0 )) s)"

echo "== kernel tests on CUDA ($(( $(date +%s) - T0 )) s)"
QRL_KERNEL_TEST_DEVICE=cuda QRL_KERNEL_TEST_JOBS=${JOBS:-8} timeout ${TEST_TIMEOUT:-130} \
  python3 -m pytest -q -p no:cacheprovider tests/test_kernels_codec.py 2>&1 | tee "$OUT/tests.log"
echo "tests rc=${PIPESTATUS[0]}; total $(( $(date +%s) - T0 )) s"
