#!/usr/bin/env bash
# The RL loop on H200s, one run per name in RUNS (default "disagg ep2"):
#   colocated  1 GPU: trainer and engine on the same rank
#   disagg     2 GPUs: trainer rank 0 + engine rank 1 (NCCL weight buckets and TRACE caches)
#   ep2        2 GPUs, colocated: an EP=2 trainer whose two ranks also serve rollouts (engine_world)
# Device run (carry .whl): see docs/PERF.md "RL loop on the H200". Writes $OUT/<run>.log and
# $OUT/<run>.metrics.jsonl; the run directories go under RUN_ROOT (default /tmp/qrl_gpu_loop).
set -uo pipefail
OUT=${OUT:-/tmp/qrl_gpu_loop}
RUN_ROOT=${RUN_ROOT:-/tmp/qrl_gpu_loop}
mkdir -p "$OUT" "$RUN_ROOT"
COMMON=(--config configs/single_h200.yaml run.wandb_mode=disabled run.checkpoint_every=0 run.eval_every=0
        model.num_layers=${LAYERS:-4} run.total_steps=${STEPS:-3} run.sft_steps=${SFT:-10} run.sft_lr=1e-4
        rollout.prompts_per_step=16 rollout.group_size=8 rollout.max_new_tokens=32 trace.enabled=true
        trace.num_cached_layers=${CACHED:-2} data.eval_size=64 "$@")
export QRL_NO_PROGRESS=1 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total --format=csv
for run in ${RUNS:-disagg ep2}; do
  case $run in
    colocated) CUDA_VISIBLE_DEVICES=0 timeout ${T:-200} python3 -m megatron_qrl.launch.train "${COMMON[@]}" \
                 run.output_dir=$RUN_ROOT/$run > $OUT/$run.log 2>&1 ;;
    disagg) timeout ${T:-200} python3 -m torch.distributed.run --nproc_per_node 2 -m megatron_qrl.launch.train \
              "${COMMON[@]}" rollout.placement=disaggregated run.output_dir=$RUN_ROOT/$run > $OUT/$run.log 2>&1 ;;
    ep2) timeout ${T:-200} python3 -m torch.distributed.run --nproc_per_node 2 -m megatron_qrl.launch.train \
           "${COMMON[@]}" trainer.expert_parallel=2 run.output_dir=$RUN_ROOT/$run > $OUT/$run.log 2>&1 ;;
  esac
  echo "== $run rc=$?"
  grep -v Warn $OUT/$run.log | grep -B2 -A12 Traceback | head -40
  cp "$RUN_ROOT/$run/metrics.jsonl" "$OUT/$run.metrics.jsonl" 2>/dev/null
  python3 - $RUN_ROOT/$run/metrics.jsonl <<'PY'
import json, os, sys
rows = [json.loads(l) for l in open(sys.argv[1])] if os.path.exists(sys.argv[1]) else []
keys = ["reward/mean", "rollout/s", "rollout/tokens_per_s", "trace/build_s", "trace/transfer_s", "trace/cache_bytes",
        "trace/bits_per_element", "sync/s", "sync/pack_s", "sync/send_s", "sync/install_s", "sync/bytes",
        "sync/wire_bytes", "train/step_s", "time/logprobs_s", "time/train_s", "mismatch/logp_abs_diff",
        "trace/code_mismatch_before", "trace/code_mismatch_after", "trace/guided_fallback", "sync/hash_ok",
        "memory/peak_gib", "eval/accuracy"]
for r in rows:
    print(r["step"], " ".join(f"{k.split('/', 1)[-1]}={r[k]:.4g}" for k in keys if isinstance(r.get(k), (int, float))))
PY
done
