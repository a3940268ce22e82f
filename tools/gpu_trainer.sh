#!/usr/bin/env bash
# The Megatron-Core trainer on one GPU: a 1-process smoke (tiny config, bf16, distributed optimizer), then the
# QAT on/off train-step benchmark (tools/bench_trainer.py) on configs/single_h200.yaml. About 240 s in all.
#
# On the device machine (repo root; .whl carried: megatron-core 0.19.2 cp312 + pydantic 2.14.4, pydantic-core
# 2.50.5, annotated-types, typing-inspection, typing-extensions, which the GPU image lacks or has too old):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && bash tools/gpu_trainer.sh
# Prepare .whl here (once): see docs/PERF.md "Trainer (QAT on/off)".
# Env: OUT (results dir; default results/gpu_trainer), TOTAL_S (230), BENCH_CONFIG (configs/single_h200.yaml),
#   BENCH_MODES (off,on,on-nosync; on-nosync, a diagnostic, is skipped when the budget cannot fit it),
#   BENCH_ARGS (extra bench_trainer.py args, e.g. "--global-batch 32 trainer.micro_batch_size=8"), SKIP_SMOKE=1,
#   QRL_BENCH_DEVICE (cuda; cpu only to try this script's logic on a machine without a GPU).
# Writes env.txt, smoke.json, smoke_log.txt, bench_trainer.json, bench_log.txt under $OUT (5 files).
set -x
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-results/gpu_trainer}"
mkdir -p "$OUT"
TOTAL_S="${TOTAL_S:-230}"  # the pip install before this script takes the rest of 240 s
DEVICE="${QRL_BENCH_DEVICE:-cuda}"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1
# megatron-core + pydantic from the carried wheels, unless the command line already installed them
if ! python3 -c "import megatron.core, pydantic" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed (carry .whl)"; exit 2; }
fi
case ":${PYTHONPATH:-}:" in *":/tmp/site:"*) ;; *) export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}" ;; esac
case ":${PYTHONPATH}:" in *":$PWD:"*) ;; *) export PYTHONPATH="$PYTHONPATH:$PWD" ;; esac
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import sys, torch, triton, megatron.core, pydantic; from importlib.metadata import version; \
print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', \
triton.__version__, 'megatron-core', version('megatron-core'), 'pydantic', pydantic.VERSION, \
'gpus', torch.cuda.device_count())"
  python3 -c "import transformer_engine" 2>&1 | tail -1 || true
  nproc
} 2>&1 | tee "$OUT/env.txt"

src=0
if [ "${SKIP_SMOKE:-0}" != "1" ]; then
  timeout 75 python3 tools/bench_trainer.py --smoke --device "$DEVICE" --out "$OUT/smoke.json" 2>&1 \
    | tee "$OUT/smoke_log.txt" | tail -40
  src=${PIPESTATUS[0]}
  echo "smoke exit code: $src"
fi

# the benchmark gets what is left; its --time-budget leaves ~30 s for imports and the table
left=$(( TOTAL_S - SECONDS - 5 ))
[ "$left" -lt 60 ] && left=60
budget=$(( left - 30 ))
# shellcheck disable=SC2086
timeout "$left" python3 tools/bench_trainer.py --config "${BENCH_CONFIG:-configs/single_h200.yaml}" \
  --device "$DEVICE" --modes "${BENCH_MODES:-off,on,on-nosync}" --warmup 1 --steps 5 --time-budget "$budget" \
  --out "$OUT/bench_trainer.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_log.txt" | tail -45
brc=${PIPESTATUS[0]}
echo "bench exit code: $brc (smoke $src); total ${SECONDS}s"
[ "$src" -eq 0 ] && [ "$brc" -eq 0 ]
