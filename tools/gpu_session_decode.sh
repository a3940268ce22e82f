#!/usr/bin/env bash
# Device calls (nvidia-h200, carry .whl) for the decode work of issue 27: the parts named in PARTS, each under
# its own timeout, everything packed into $OUT/all.tgz (the device tool returns <= 8 files).
#   tests     GPU tests of the decode kernels (TEST_FILES: routing, fused norms, packed KV cache)
#   roll4     rollout bench at 4 layers: FP4 vs BF16 vs HF, per-kernel profiles, TRACE / sampling overheads,
#             graph-vs-eager checks
#   roll48    48 layers, FP4 vs BF16, in a process of its own (memory)
#   kv        long prompts: FP4 weights with a bf16 / packed FP8 / packed NVFP4 KV cache
#   probe     host<->device copy rates (what the TRACE capture assembly pays per byte on this machine)
#   overheads the TRACE + R3 capture and sampling overheads alone (batch 64, OVER_REPS reps)
#   genprof   one generate() call at batch 64 profiled (tools/profile_generate.py), W4A4 without and with TRACE + R3,
#             after unprofiled calls with their phase times
#   launch    what a kernel boundary costs inside a CUDA graph (tools/probe_graph_launch.py: plain, PDL, cuBLAS)
#   loop      the RL loop of configs/single_h200.yaml (tools/gpu_train_single.sh; STEPS, TRAIN_TIMEOUT)
#   attn      the packed-KV attention kernel: its Gluon GPU tests, then tools/bench_attention.py with the module knobs
#             in KV_CONFIGS / KV_FP8_CONFIGS (default: both vector knobs off) beside the default
#   moeblocks the grouped expert kernel at T = MOE_TOKENS (256,128): the heuristic against 16- / 32-row block
#             variants (tools/bench_kernels.py --configs blocks)
#   block32   48 layers, batch 256, FP4: the decode step on 32-row expert blocks above 8 assignments per expert
#             (bench_rollout --moe-block32-from 8), then the default, each in a process of its own (BLOCK32_FROM:
#             the thresholds to run, "8 0"; 0 is the default)
#   attnb1    batch-1 attention (latency-bound) against its split knobs: --shapes B1_SHAPES, KV_B1_CONFIGS
#   lean48    48 layers, FP4 only, batches LEAN48_BATCHES (64,256): the engine without dense copies of its FP4
#             weights (fits an 80 GB H100), floor at HBM_TBS TB/s (default 4.0, the issue's H200 figure)
#   moencu    Nsight Compute on the grouped expert kernel (_moe_gemm_kernel) of tools/bench_kernels.py --profile's MoE
#             cases (T = 32 and 256, the heuristic's tiles): speed of light, occupancy, warp states, and per-SASS
#             stall samples (moencu/ncu_source.csv.gz) -- where the latency-bound kernel waits
#   moesync   the grouped expert kernel at T = MOE_TOKENS (512,256,128,64): the heuristic against the kernel before
#             2026-12-07 (byte-wise scales, no sync_dots), against sync_dots (dots that wait for the MMAs in flight, so
#             ptxas pipelines the wgmmas) switched on gate/up, down, both, against gate/up tiles with fewer loop
#             instructions per weight byte, two K steps per loop trip (unroll), persistent programs and register caps
#             (tools/bench_kernels.py --configs sync), after its GPU tests (-k moe)
#   moelayout the grouped expert kernel at T = MOE_TOKENS (256,128): the heuristic against tile-major expert stacks
#             (each loop trip's weight tile one contiguous run of codes and one of scales) on gate/up, down, both
#             (tools/bench_kernels.py --configs layout), after its GPU tests (-k tile_major)
#   tile48    48 layers, FP4 only, batches LEAN48_BATCHES: the decode step over tile-major expert stacks of the tiles
#             in TILE48 (default "off 64x128": bench_rollout --moe-tile-major), each in a process of its own
#   sync48    48 layers, FP4 only, batches LEAN48_BATCHES: the decode step with sync_dots on the projections
#             SYNC48 names (default "off gate_up": bench_rollout --moe-sync-dots), each in a process of its own
#   pers48    48 layers, FP4 only, batches PERS48_BATCHES (64,128: 16-row expert blocks): the decode step with the
#             16-row gate/up expert kernel's persistent programs per SM in PERS48 (default "0 5": bench_rollout
#             --moe-persistent), each in a process of its own
# Usage (repository root): OUT=results/ [PARTS="tests roll4"] bash tools/gpu_session_decode.sh
set -uo pipefail
cd "$(dirname "$0")/.."
O="${OUT:-results/gpu_session_decode}"
PARTS=" ${PARTS:-tests roll4 roll48 kv probe} "
mkdir -p "$O"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset TRITON_INTERPRET
part() { [[ "$PARTS" == *" $1 "* ]]; }
if part tests; then
  QRL_KERNEL_TESTS_DEVICE=cuda timeout "${T_TESTS:-100}" python3 -m pytest -q -p no:cacheprovider \
    ${TEST_FILES:-tests/test_kernels_decode_routing.py tests/test_kernels_decode_fused.py tests/test_kernels_kv_cache.py} \
    > "$O/tests_gpu.txt" 2>&1
  echo "decode kernel GPU tests rc=$? $(tail -1 "$O/tests_gpu.txt")"; grep "^FAILED" "$O/tests_gpu.txt" | head
fi
if part roll4; then
  OUT=$O/roll4 BENCH_TIMEOUT="${T_ROLL4:-200}" bash tools/gpu_rollout.sh ${ROLL4_ARGS:---layers 4 --batches 1,16,64,256 \
    --engines fp4,bf16,hf --overheads 64 --check 16 --profile 16,256 --reps 2} | grep -v "^\[bench\]\|top kernels" | tail -32
fi
if part roll48; then
  OUT=$O/roll48 BENCH_TIMEOUT="${T_ROLL48:-170}" bash tools/gpu_rollout.sh ${ROLL48_ARGS:---layers 48 --batches 16,64,256 \
    --engines fp4,bf16 --profile 64 --reps 2} | grep -v "^\[bench\]\|top kernels" | tail -22
fi
if part kv; then
  OUT=$O/kv BENCH_TIMEOUT="${T_KV:-120}" bash tools/gpu_rollout.sh ${KV_ARGS:---layers 4 --batches 8,16 --engines \
    fp4,fp4-kv8,fp4-kv4 --prompt-len 4096 --new-tokens 32 --reps 2} | grep -v "^\[bench\]\|top kernels" | tail -12
fi
if part overheads; then
  OUT=$O/over BENCH_TIMEOUT="${T_OVER:-110}" bash tools/gpu_rollout.sh --layers 4 --batches 64 --engines fp4 \
    --overheads 64 --reps "${OVER_REPS:-5}" | grep "^overheads\|^| 64\|exit code"
fi
if part probe; then
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
fi
if part genprof; then
  for e in w4a4 w4a4-trace; do
    timeout "${T_GENPROF:-120}" python3 tools/profile_generate.py --engine $e --batch 64 --new-tokens 128 --rows 30 \
      > "$O/genprof_$e.txt" 2>&1; echo "genprof $e rc=$?"; grep "^unprofiled\|^generate:" "$O/genprof_$e.txt"
  done
fi
if part launch; then
  timeout "${T_LAUNCH:-90}" python3 tools/probe_graph_launch.py --out "$O/graph_launch.json" 2>&1 | tail -12
fi
if part loop; then
  OUT=$O/loop STEPS="${STEPS:-8}" SFT=20 NEW=256 TRAIN_TIMEOUT="${TRAIN_TIMEOUT:-250}" bash tools/gpu_train_single.sh | tail -14
fi
if part attn; then
  KNOBS="default:vector_stores=0,q_vector_loads=0"   # the defaults beside the kernel before 2026-12-07 (third)
  OUT=$O/attn TEST_K=gluon TEST_TIMEOUT="${T_ATTN_TESTS:-120}" BENCH_TIMEOUT="${T_ATTN:-200}" bash tools/gpu_kv_attention.sh \
    --shapes 16x4096,32x8192,1x8192,64x2048 --heads 32/4,32/8 --rep-ms 10 --nvfp4-configs "${KV_CONFIGS:-$KNOBS}" \
    --fp8-configs "${KV_FP8_CONFIGS:-$KNOBS}" 2>&1 | tail -40
fi
if part moeblocks; then
  OUT=$O/moeblocks SKIP_TESTS=1 BENCH_TIMEOUT="${T_MOEBLOCKS:-150}" bash tools/gpu_kernels.sh --skip-dense \
    --moe-tokens "${MOE_TOKENS:-256,128}" --configs blocks --rep-ms 40 2>&1 | grep "moe T=\|exit code" | tail -20
fi
if part moencu; then
  OUT=$O/moencu SKIP_TESTS=1 SKIP_BENCH=1 NCU=1 NCU_KERNELS=moe_gemm NCU_SOURCE=1 NCU_SOURCE_KERNELS=moe_gemm \
    NCU_TIMEOUT="${T_MOENCU:-120}" bash tools/gpu_kernels.sh 2>&1 | tail -60
  gzip -f "$O/moencu/ncu_source.csv" 2>/dev/null
fi
if part moesync; then
  OUT=$O/moesync TEST_K=moe BENCH_TIMEOUT="${T_MOESYNC:-200}" bash tools/gpu_kernels.sh --skip-dense \
    --moe-tokens "${MOE_TOKENS:-512,256,128,64}" --configs sync --rep-ms 40 2>&1 \
    | grep "moe T=\|exit code\|passed\|failed" | tail -30
fi
if part moelayout; then
  OUT=$O/moelayout TEST_K=tile_major BENCH_TIMEOUT="${T_MOELAYOUT:-150}" bash tools/gpu_kernels.sh --skip-dense \
    --moe-tokens "${MOE_TOKENS:-256,128}" --configs layout --rep-ms 40 2>&1 | grep "moe T=\|exit code\|passed\|failed" | tail -16
fi
if part sync48; then
  for v in ${SYNC48:-off gate_up}; do
    OUT=$O/sync48_$v BENCH_TIMEOUT="${T_SYNC48:-150}" bash tools/gpu_rollout.sh --layers 48 \
      --batches "${LEAN48_BATCHES:-64,256}" --engines fp4 --reps 2 --hbm-tbs "${HBM_TBS:-4.0}" \
      --moe-sync-dots $v 2>&1 | grep -v "^\[bench\]\|top kernels" | tail -8
  done
fi
if part tile48; then
  for v in ${TILE48:-off 64x128}; do
    OUT=$O/tile48_$v BENCH_TIMEOUT="${T_TILE48:-160}" bash tools/gpu_rollout.sh --layers 48 \
      --batches "${LEAN48_BATCHES:-64,256}" --engines fp4 --reps 2 --hbm-tbs "${HBM_TBS:-4.0}" \
      $([ "$v" = off ] || echo "--moe-tile-major $v") 2>&1 | grep -v "^\[bench\]\|top kernels" | tail -8
  done
fi
if part pers48; then
  for v in ${PERS48:-0 5}; do
    OUT=$O/pers48_$v BENCH_TIMEOUT="${T_PERS48:-150}" bash tools/gpu_rollout.sh --layers 48 \
      --batches "${PERS48_BATCHES:-64,128}" --engines fp4 --reps 2 --hbm-tbs "${HBM_TBS:-4.0}" \
      --moe-persistent $v 2>&1 | grep -v "^\[bench\]\|top kernels" | tail -8
  done
fi
if part block32; then
  for from in ${BLOCK32_FROM:-8 0}; do
    OUT=$O/block32_$from BENCH_TIMEOUT="${T_BLOCK32:-150}" bash tools/gpu_rollout.sh --layers 48 --batches 256 \
      --engines fp4 --reps 2 --moe-block32-from $from 2>&1 | grep -v "^\[bench\]\|top kernels" | tail -8
  done
fi
if part attnb1; then
  B1="${KV_B1_CONFIGS:-default:min_blocks=2:min_blocks=8:programs_per_sm=8:prefetch=2:fused_merge=1,merge_round=8}"
  OUT=$O/attnb1 SKIP_TESTS=1 BENCH_TIMEOUT="${T_ATTNB1:-150}" bash tools/gpu_kv_attention.sh \
    --shapes "${B1_SHAPES:-1x4096,1x8192,1x16384}" --heads 32/4,32/8 --rep-ms 10 --nvfp4-configs "$B1" \
    --fp8-configs "$B1" 2>&1 | grep "^| \|NOT MET\|met\|exit code" | tail -14
fi
if part lean48; then
  OUT=$O/lean48 BENCH_TIMEOUT="${T_LEAN48:-240}" bash tools/gpu_rollout.sh --layers 48 \
    --batches "${LEAN48_BATCHES:-64,256}" --engines fp4 --reps 2 --hbm-tbs "${HBM_TBS:-4.0}" 2>&1 \
    | grep -v "top kernels" | tail -14
  grep "GPU memory" "$O/lean48/bench_rollout.log"
fi
DIRS="roll4 roll48 kv over loop attn attnb1 lean48 moeblocks moencu moesync moelayout sync48_* tile48_* pers48_* block32_*"
# shellcheck disable=SC2086
cd "$O" && tar czf all.tgz $(ls -d $DIRS tests_gpu.txt copy_probe.txt graph_launch.json genprof_*.txt 2>/dev/null) \
  && rm -rf $DIRS
