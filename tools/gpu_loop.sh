#!/usr/bin/env bash
# The RL loop on H200s: colocated on one GPU, then disaggregated (1 trainer GPU + 1 engine GPU, NCCL).
# Device run (2 GPUs; carry .whl): see docs/PERF.md "RL loop on the H200". Writes $OUT/{colocated,disagg}/.
set -uo pipefail
OUT=${OUT:-/tmp/qrl_gpu_loop}
COMMON=(--config configs/single_h200.yaml run.wandb_mode=disabled run.checkpoint_every=0 run.eval_every=6
        run.total_steps=${STEPS:-6} run.sft_steps=${SFT:-40} run.sft_lr=1e-4 rollout.prompts_per_step=16
        rollout.group_size=8 rollout.max_new_tokens=32 trace.enabled=true trace.num_cached_layers=6
        data.eval_size=64 "$@")
export QRL_NO_PROGRESS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv
CUDA_VISIBLE_DEVICES=0 timeout ${T1:-200} python3 -m megatron_qrl.launch.train "${COMMON[@]}" \
  run.output_dir=$OUT/colocated > $OUT/colocated.log 2>&1; echo "colocated rc=$?"
timeout ${T2:-260} python3 -m torch.distributed.run --nproc_per_node 2 -m megatron_qrl.launch.train "${COMMON[@]}" \
  rollout.placement=disaggregated run.output_dir=$OUT/disagg > $OUT/disagg.log 2>&1; echo "disagg rc=$?"
for d in colocated disagg; do
  echo "== $d"; grep -v Warn $OUT/$d.log | grep -B2 -A12 Traceback | head -40
  python3 - $OUT/$d/metrics.jsonl <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])] if __import__("os").path.exists(sys.argv[1]) else []
keys = ["reward/mean", "rollout/s", "rollout/tokens_per_s", "trace/transfer_s", "trace/cache_bytes", "sync/s",
        "sync/bytes", "train/step_s", "mismatch/logp_abs_diff", "trace/code_mismatch_before",
        "trace/code_mismatch_after", "sync/hash_ok", "eval/accuracy"]
for r in rows:
    print(r["step"], " ".join(f"{k.split('/')[-1]}={r[k]:.4g}" for k in keys if isinstance(r.get(k), (int, float))))
PY
done
