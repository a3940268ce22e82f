#!/usr/bin/env bash
# `qrl train` on one GPU as a user starts it (device tool, carry .whl): the SFT warm start and RL steps of
# configs/single_h200.yaml, timed end to end; the log and metrics.jsonl go to $OUT with a per-step time split.
# Usage (repository root): OUT=results/ [STEPS=10 SFT=20 NEW=256 TRAIN_TIMEOUT=420] bash tools/gpu_train_single.sh [overrides]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-results/gpu_train_single}"
mkdir -p "$OUT"
if [ -d .whl ] && ! python3 -c "import megatron.core, pydantic" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 WANDB_MODE=offline
unset TRITON_INTERPRET
RUN=/tmp/qrl_single_run
rm -rf "$RUN"
t0=$(date +%s.%N)
timeout "${TRAIN_TIMEOUT:-420}" python3 -m megatron_qrl.cli train --config "${CONFIG:-configs/single_h200.yaml}" \
  run.output_dir="$RUN" run.total_steps="${STEPS:-10}" run.sft_steps="${SFT:-20}" \
  rollout.max_new_tokens="${NEW:-256}" run.eval_every=0 "$@" > "$OUT/train.log" 2>&1
rc=$?
t1=$(date +%s.%N)
grep -v "IS DEPRECATED" "$OUT/train.log" | tail -40
echo "qrl train exit code: $rc; wall $(python3 -c "print(round($t1 - $t0, 1))") s"
cp "$RUN/metrics.jsonl" "$OUT/" 2>/dev/null
python3 - "$OUT/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])] if __import__("os").path.exists(sys.argv[1]) else []
keys = ["time/step_s", "rollout/s", "trace/build_s", "time/logprobs_s", "train/step_s", "sync/s", "rollout/tokens_per_s",
        "reward/mean", "mismatch/logp_abs_diff", "trace/code_mismatch_before", "trace/code_mismatch_after"]
for r in rows:
    print("step", r.get("step"), {k: round(r[k], 4) for k in keys if isinstance(r.get(k), (int, float))})
PY
