#!/usr/bin/env bash
# The last device call of the 2026-12-02 session (nvidia-h200, carry .whl): the fused decode kernels' GPU tests,
# the TRACE + R3 capture overhead at batch 64, and the RL loop of configs/single_h200.yaml (issue 27's loop step).
set -uo pipefail
cd "$(dirname "$0")/.."
O="${OUT:-results/gpu_session_final}"
mkdir -p "$O"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset TRITON_INTERPRET
QRL_KERNEL_TESTS_DEVICE=cuda timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_decode_fused.py \
  > "$O/tests_fused_gpu.txt" 2>&1
echo "fused decode kernel GPU tests rc=$? $(tail -1 "$O/tests_fused_gpu.txt")"; grep "^FAILED" "$O/tests_fused_gpu.txt" | head
OUT=$O/over BENCH_TIMEOUT=110 bash tools/gpu_rollout.sh --layers 4 --batches 64 --engines fp4 --overheads 64 --reps 2 \
  | grep "^overheads\|^| 64\|exit code"
OUT=$O/loop STEPS="${STEPS:-8}" SFT=20 NEW=256 TRAIN_TIMEOUT="${TRAIN_TIMEOUT:-250}" bash tools/gpu_train_single.sh | tail -14
cd "$O" && tar czf all.tgz over loop tests_fused_gpu.txt && rm -rf over loop
