#!/usr/bin/env bash
# The engine's decode on a GPU machine (device tool, carry .whl): tools/bench_rollout.py with its checks.
# Usage (repository root): OUT=results/ bash tools/gpu_rollout.sh [bench_rollout.py args]
# Default args: 4 layers, batches 1,16,64,256, engines fp4,bf16,fp4-eager,hf, overheads and checks at 64/16.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-results/gpu_rollout}"
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset TRITON_INTERPRET
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
} 2>&1 | tee "$OUT/env.txt"
ARGS=("$@")
[ ${#ARGS[@]} -eq 0 ] && ARGS=(--layers 4 --batches 1,16,64,256 --engines fp4,bf16,fp4-eager,hf --overheads 64 --check 16)
timeout "${BENCH_TIMEOUT:-500}" python3 tools/bench_rollout.py --json "$OUT/rollout.json" "${ARGS[@]}" 2>&1 \
  | tee "$OUT/bench_rollout.log" | grep -v "IS DEPRECATED" | tail -40
echo "bench exit code: ${PIPESTATUS[0]}"
