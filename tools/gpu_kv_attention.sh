#!/usr/bin/env bash
# Packed KV-cache kernels on a GPU machine: their tests on the device (tests/test_kernels_kv_cache.py with
# QRL_KERNEL_TESTS_DEVICE=cuda), then the decode-attention benchmark (tools/bench_attention.py).
# Usage (repository root): OUT=results/attn bash tools/gpu_kv_attention.sh [bench_attention.py args, e.g. --configs all]
# SKIP_TESTS=1 / SKIP_BENCH=1 skip a part; TEST_TIMEOUT / BENCH_TIMEOUT (s) bound them.
# As tools/gpu_kernels.sh: megatron_qrl/ and kernels/ (as megatron_qrl/kernels) are copied into a scratch dir on
# PYTHONPATH, so only torch + triton (+ pytest) are needed on the machine.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-results/gpu_kv_attention}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
export PYTHONUNBUFFERED=1
SHIM="$(mktemp -d)"
cp -r megatron_qrl "$SHIM/" && rm -rf "$SHIM/megatron_qrl/kernels" && cp -r kernels "$SHIM/megatron_qrl/kernels"
mkdir -p "$SHIM/tests" "$SHIM/tools" && cp tests/test_kernels_kv_cache.py "$SHIM/tests/"
cp tools/bench_attention.py tools/bench_kernels.py "$SHIM/tools/"
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
} 2>&1 | tee "$OUT/env.txt"
rc=0
if [ "${SKIP_TESTS:-0}" != "1" ]; then
  XDIST=""
  python3 -c "import xdist" 2>/dev/null && XDIST="-n ${TEST_WORKERS:-8}"
  (cd "$SHIM" && QRL_KERNEL_TESTS_DEVICE=cuda timeout "${TEST_TIMEOUT:-120}" python3 -m pytest -q -p no:cacheprovider \
    $XDIST tests/test_kernels_kv_cache.py) 2>&1 | tee "$OUT/tests_gpu.txt" | tail -25
  rc=${PIPESTATUS[0]}
  echo "gpu tests exit code: $rc"
fi
brc=0
if [ "${SKIP_BENCH:-0}" != "1" ]; then
  (cd "$SHIM" && timeout "${BENCH_TIMEOUT:-200}" python3 tools/bench_attention.py --out "$OUT" "$@") 2>&1 \
    | tee "$OUT/bench_log.txt" | tail -40
  brc=${PIPESTATUS[0]}
  echo "bench exit code: $brc"
fi
[ "$rc" -eq 0 ] && [ "$brc" -eq 0 ]
