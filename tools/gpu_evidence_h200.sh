#!/usr/bin/env bash
# The GPU-scale evidence campaign on ONE H200 (docs/RESULTS.md "FP4 RL arms at GPU scale (plan)"): per call
# the seeds in SEEDS, each a self-contained unit (its SFT warm start, then its 7 arms at once, one process
# each on the one GPU), every process killed DEADLINE s after the start and marked UNFINISHED with what it
# wrote; then the report over every seed whose records are under ROOT, and the small records back in $OUT.
#   call 1: SEEDS="0 1" bash tools/gpu_evidence_h200.sh        call 2: SEEDS="2 3" bash tools/gpu_evidence_h200.sh
# Resume: a run cut after a committed checkpoint (every 10 steps) continues from it when the same root is
# still there (a warm machine); on a fresh machine ROOT holds only the committed records (runs/evidence_gpu,
# no checkpoints), so a seed whose runs are not all DONE is redone whole from a new SFT (tools/evidence.py:
# a seed's arms share one SFT process's weights). Device run: kind nvidia-h200, carry .whl (docs/RESULTS.md).
set -uo pipefail
OUT=${OUT:-/tmp/qrl_gpu_evidence}
ROOT=${ROOT:-runs/evidence_gpu}
SEEDS=${SEEDS:-0 1}
DEADLINE=${DEADLINE:-430}        # campaign seconds; a 9-minute call also holds the install, report and archive
PARALLEL=${PARALLEL:-16}         # 2 seeds x 7 arms at once after the SFTs; one core each
SMOKE=${SMOKE:-2}                # a 2-step run of the smoke arms beside the SFTs (0: none); a failure stops all
export QRL_NO_PROGRESS=1 PYTHONUNBUFFERED=1 QRL_EVIDENCE_CUDA=${QRL_EVIDENCE_CUDA:-1} OMP_NUM_THREADS=1
EV="python3 tools/evidence.py --base configs/evidence/gpu_base.yaml --arms-file configs/evidence/gpu_arms.yaml"
mkdir -p "$OUT" "$ROOT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
echo "cores $(nproc) seeds $SEEDS deadline $DEADLINE"; date -u
( while sleep 15; do echo "$(date -u +%T) $(cut -d' ' -f1-3 /proc/loadavg) $(free -g | awk '/Mem/{print $3 "G"}')" \
    "$(nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader)"; done ) > "$OUT/monitor.log" 2>&1 &
MON=$!
timeout $((DEADLINE + 45)) $EV run --root "$ROOT" --out "$ROOT/figures_call" --seeds $SEEDS --parallel "$PARALLEL" \
    --gpus 0 --deadline-s "$DEADLINE" --smoke-steps "$SMOKE" --smoke-arms qerl nvfp4_trace_ais_aqn \
    --partial --min-steps 5 2>&1 | grep -v "Warning\|warn(" | tee "$OUT/campaign.log"
rc=${PIPESTATUS[0]}
kill $MON 2>/dev/null
echo "campaign rc=$rc"; date -u
ALL=$(ls -d "$ROOT"/seed* 2>/dev/null | sed 's/.*seed//' | sort -n | tr '\n' ' ')
$EV report --root "$ROOT" --out "$OUT/figures" --seeds $ALL --partial --min-steps 5 > "$OUT/report.log" 2>&1
$EV archive --root "$ROOT" --dest "$OUT/records" --seeds $ALL >> "$OUT/report.log" 2>&1
( cd "$OUT" && tar czf records.tgz $(ls -d records figures 2>/dev/null) ); rm -rf "$OUT/records" "$OUT/figures"
find "$ROOT" -name train.log -o -name 'sft_seed*.log' -o -name 'smoke_*.log' | tar czf "$OUT/logs.tgz" -T -
cat "$OUT/report.log"; ls -la "$OUT"
exit $rc
