#!/usr/bin/env bash
# One device call (nvidia-h200, carry .whl) for the decode work of issue 27, each part under its own timeout,
# everything packed into $OUT/all.tgz (the device tool returns <= 8 files):
#  1. GPU tests of the decode kernels (routing, fused norms, cache attention, packed KV cache);
#  2. the rollout bench at 4 layers: FP4 vs BF16 vs HF, per-kernel profiles, TRACE / sampling overheads,
#     graph-vs-eager checks; 3. at 48 layers FP4 vs BF16 in a process of its own (memory);
#  4. long prompts: FP4 weights with a bf16 / packed FP8 / packed NVFP4 KV cache;
#  5. a host<->device copy probe (what the TRACE capture assembly pays per byte on this machine).
set -uo pipefail
cd "$(dirname "$0")/.."
O="${OUT:-results/gpu_session_decode}"
mkdir -p "$O"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset TRITON_INTERPRET
QRL_KERNEL_TESTS_DEVICE=cuda timeout "${T_TESTS:-100}" python3 -m pytest -q -p no:cacheprovider \
  tests/test_kernels_decode_routing.py tests/test_kernels_decode_fused.py tests/test_kernels_kv_cache.py \
  "tests/test_rollout_static.py::test_cache_decode_attention_kernel_matches_reference" > "$O/tests_gpu.txt" 2>&1
echo "decode kernel GPU tests rc=$? $(tail -1 "$O/tests_gpu.txt")"; grep "^FAILED" "$O/tests_gpu.txt" | head
OUT=$O/roll4 BENCH_TIMEOUT="${T_ROLL4:-200}" bash tools/gpu_rollout.sh ${ROLL4_ARGS:---layers 4 --batches 1,16,64,256 \
  --engines fp4,bf16,hf --overheads 64 --check 16 --profile 16,256 --reps 2} | grep -v "^\[bench\]\|top kernels" | tail -32
OUT=$O/roll48 BENCH_TIMEOUT="${T_ROLL48:-170}" bash tools/gpu_rollout.sh ${ROLL48_ARGS:---layers 48 --batches 16,64,256 \
  --engines fp4,bf16 --profile 64 --reps 2} | grep -v "^\[bench\]\|top kernels" | tail -22
OUT=$O/kv BENCH_TIMEOUT="${T_KV:-120}" bash tools/gpu_rollout.sh ${KV_ARGS:---layers 4 --batches 8,16 --engines \
  fp4,fp4-kv8,fp4-kv4 --prompt-len 4096 --new-tokens 32 --reps 2} | grep -v "^\[bench\]\|top kernels" | tail -12
timeout 60 python3 - <<'PY' 2>&1 | tee "$O/copy_probe.txt"
import time, torch
n = 137 << 20
dev = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
def t(f, reps=3):
    best = 1e9
    for _ in range(reps):
        torch.cuda.synchronize(); t0 = time.perf_counter(); f(); torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best
pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
pageable = torch.empty(n, dtype=torch.uint8)
print(f"137 MiB: pinned alloc {t(lambda: torch.empty(n, dtype=torch.uint8, pin_memory=True)) * 1e3:.1f} ms (cached), "
      f"D2H into pinned {n / t(lambda: pinned.copy_(dev, non_blocking=True)) / 1e9:.1f} GB/s, "
      f"into pageable {n / t(lambda: pageable.copy_(dev)) / 1e9:.1f} GB/s, "
      f"H2D from pinned {n / t(lambda: dev.copy_(pinned, non_blocking=True)) / 1e9:.1f} GB/s")
PY
cd "$O" && tar czf all.tgz $(ls -d roll4 roll48 kv tests_gpu.txt copy_probe.txt 2>/dev/null) && rm -rf roll4 roll48 kv
