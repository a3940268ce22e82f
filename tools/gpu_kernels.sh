#!/usr/bin/env bash
# W4A16 kernels on a GPU machine: correctness tests on the device, the benchmark (tools/bench_kernels.py),
# and optionally (NCU=1) an Nsight Compute profile of a few kernels.
# Usage (repository root): OUT=results/ bash tools/gpu_kernels.sh [extra bench_kernels.py args]
# (SKIP_TESTS=1 / SKIP_BENCH=1 skip a part; STRESS=1 [STRESS_ARGS=...] adds tools/stress_gluon.py; TEST_K=expr passes -k expr to the GPU tests; NCU_KERNELS=regex
# and NCU_EXTRA="--section ..." narrow or widen the profile; NCU_BENCH_ARGS="..." go to the benchmark's --profile run; NCU_SOURCE=1 adds per-instruction stall samples; NCU_ONLY=prefixes profiles those configs at M = 128 on both dense shapes)
# The package is made importable without installing its dependencies (the kernels need torch + triton
# only): megatron_qrl/ and kernels/ (as megatron_qrl/kernels) are copied into a scratch dir on PYTHONPATH,
# and the tests run from there (so the checkout's own megatron_qrl/ cannot shadow the copy).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$(pwd)"
OUT="${OUT:-results/gpu_kernels}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SHIM="$(mktemp -d)"
cp -r megatron_qrl "$SHIM/" && rm -rf "$SHIM/megatron_qrl/kernels" && cp -r kernels "$SHIM/megatron_qrl/kernels"
TESTS="${TESTS:-tests/test_kernels_gemm.py}"      # GPU tests to run (QRL_KERNEL_TESTS_DEVICE=cuda)
BENCH="${BENCH:-tools/bench_kernels.py}"          # the benchmark script (args: --out DIR, then "$@")
mkdir -p "$SHIM/tests" && cp $TESTS "$SHIM/tests/"
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
  (cd "$SHIM" && QRL_KERNEL_TESTS_DEVICE=cuda timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider \
    $XDIST ${TEST_K:+-k "$TEST_K"} $TESTS) 2>&1 | tee "$OUT/tests_gpu.txt" | tail -25
  rc=${PIPESTATUS[0]}
  echo "gpu tests exit code: $rc"
fi
brc=0
if [ "${SKIP_BENCH:-0}" != "1" ]; then
  timeout "${BENCH_TIMEOUT:-400}" python3 "$BENCH" --out "$OUT" "$@" 2>&1 | tee "$OUT/bench_log.txt" | tail -70
  brc=${PIPESTATUS[0]}
  echo "bench exit code: $brc"
fi
src=0
if [ "${STRESS:-0}" = "1" ]; then   # hang / determinism stress of the Gluon kernels (tools/stress_gluon.py)
  timeout "${STRESS_TIMEOUT:-300}" python3 tools/stress_gluon.py ${STRESS_ARGS:-} 2>&1 | tee "$OUT/stress.txt" | tail -40
  src=${PIPESTATUS[0]}
  echo "stress exit code: $src"
fi
if [ "${NCU:-0}" = "1" ]; then
  NCU_BIN="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)"
  if [ -n "$NCU_BIN" ]; then
    NCU_RUN=(python3 "$BENCH" --out "$OUT/prof" --profile)    # + NCU_ONLY (bench_kernels) or NCU_BENCH_ARGS (any)
    [ -n "${NCU_ONLY:-}" ] && NCU_RUN+=(--only "$NCU_ONLY")
    # shellcheck disable=SC2206
    [ -n "${NCU_BENCH_ARGS:-}" ] && NCU_RUN+=($NCU_BENCH_ARGS)
    timeout "${NCU_TIMEOUT:-120}" "$NCU_BIN" --clock-control none --profile-from-start off --target-processes all \
      -k regex:"${NCU_KERNELS:-w4a16|moe_gemm|moe_gluon|gemv|gemm|nvjet|xmma|cutlass}" \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section MemoryWorkloadAnalysis ${NCU_EXTRA:-} \
      "${NCU_RUN[@]}" > "$OUT/ncu.txt" 2>&1
    echo "ncu exit code: $?"
    if [ "${NCU_SOURCE:-0}" = "1" ]; then   # per-SASS-instruction stall samples of the NCU_ONLY configs (CSV)
      timeout "${NCU_TIMEOUT:-120}" "$NCU_BIN" --clock-control none --profile-from-start off --target-processes all \
        -k regex:"${NCU_SOURCE_KERNELS:-gluon_ss}" --section SourceCounters --section WarpStateStats \
        --page source --print-source sass --csv \
        "${NCU_RUN[@]}" > "$OUT/ncu_source.csv" 2>&1
      echo "ncu source exit code: $? ($(wc -l < "$OUT/ncu_source.csv") lines)"
    fi
    grep -E "^  [_a-zA-Z].*\(|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Issue Slots|Warp Cycles Per Issued|profiled case" "$OUT/ncu.txt" | head -150
  else
    echo "ncu not found"
  fi
fi
[ "$rc" -eq 0 ] && [ "$brc" -eq 0 ] && [ "$src" -eq 0 ]
