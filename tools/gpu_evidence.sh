#!/usr/bin/env bash
# The H200 arms of the evidence campaign (docs/RESULTS.md "FP4 RL arms", H200 subsection), one device call:
# a 2-step smoke of two arms next to every seed's SFT warm start (a smoke failure stops everything, with its
# traceback), then the 6 arms x SEEDS RL runs all at once, spread over the GPUs, every process killed at the
# deadline; the table over whatever finished, then one archive of the run records (no checkpoints) in $OUT.
# Device run (nvidia-h200-x2; carry .whl; the command starts with the wheel install of docs/PERF.md):
#   OUT=$OUT bash tools/gpu_evidence.sh
set -uo pipefail
OUT=${OUT:-/tmp/qrl_gpu_evidence}
ROOT=${ROOT:-runs/evidence_h200}
DEADLINE=${DEADLINE:-400}
export QRL_NO_PROGRESS=1 PYTHONUNBUFFERED=1 QRL_EVIDENCE_CUDA=${QRL_EVIDENCE_CUDA:-1} OMP_NUM_THREADS=1
mkdir -p "$OUT" "$ROOT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
            "gpus", torch.cuda.device_count())'
echo "cores $(nproc)"; date -u
GPUS=$(nvidia-smi --query-gpu=index --format=csv,noheader | tr '\n' ' ')
( while sleep 20; do echo "$(date -u +%T) $(cut -d' ' -f1-3 /proc/loadavg) $(free -g | awk '/Mem/{print $3 "G used"}')" \
    "$(nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader | tr '\n' ' ')"; done ) \
    > "$OUT/monitor.log" 2>&1 &
MON=$!
timeout $((DEADLINE + 60)) python3 tools/evidence.py run --base configs/evidence/h200_base.yaml --root "$ROOT" \
    --out "$ROOT/figures" --seeds ${SEEDS:-0 1 2} --parallel ${PARALLEL:-24} --gpus $GPUS \
    --deadline-s "$DEADLINE" --smoke-steps 2 --sft-target ${SFT_TARGET:-0.6} --sft-chunk 20 \
    --sft-time ${SFT_TIME:-80} --partial --min-steps 5 "$@" 2>&1 | tee "$OUT/campaign.log"
rc=${PIPESTATUS[0]}
kill $MON 2>/dev/null
echo "evidence rc=$rc"; date -u
tar czf "$OUT/evidence_h200.tgz" --exclude=checkpoints --exclude='*.tmp*' "$ROOT" && ls -la "$OUT"
exit $rc
