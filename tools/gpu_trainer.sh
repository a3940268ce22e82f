#!/usr/bin/env bash
# The Megatron-Core trainer on one GPU (issue 28), at most ~7.7 minutes in all (TOTAL_S); every part runs in its
# own process under its own timeout and writes its JSON as it goes, so one failing part never loses the others':
#   1. env.txt              GPU, driver, torch / triton / megatron-core versions
#   2. gpu_checks.json      tests/dist/grouped_experts.py on CUDA bf16: grouped vs per-expert experts (log-probs,
#                           loss, gradients; QAT W4A4 / W4A16 / MXFP4 / off), grouped GEMM vs loop, one-launch codec
#                           bytes == the CPU codec's, device digests == CPU digests (flipped bits detected), the
#                           fused mismatch counter, device vs host TRACE guides, TRACE mismatch after guidance
#                           (<= 0.01%), the sync's reuse of the QAT bytes; "summary" holds pass/fail per check
#   3. smoke.json           tools/bench_trainer.py --smoke (tiny config, bf16, distributed optimizer, QAT on)
#   4. bench_trainer.json   tools/bench_trainer.py on configs/single_h200.yaml, modes side by side in one process:
#                           off / on (grouped experts, micro-batch 16), off-seq-mb4 (the previous trainer: per-expert
#                           experts, micro-batch 4 -- docs/PERF.md's 4,571 tokens/s), on-seq, off-seq; tokens/s, MFU,
#                           QAT on/off, grouped vs per-expert; in `on`: log-probs with TRACE vs without and the
#                           weight-sync pack + digest of the full payload vs the previous path
#   5. summary.json         the headline numbers and ratios of 2-4 against the issue's targets
#
# On the device machine (repo root; carry .whl: megatron-core 0.19.2 cp312 + pydantic 2.14.4, pydantic-core
# 2.50.5, annotated-types, typing-inspection, typing-extensions, which the GPU image lacks or has too old):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && OUT=$OUT bash tools/gpu_trainer.sh
# Prepare .whl here (once): see docs/PERF.md "Trainer (QAT on/off)".
# Env: OUT (results dir; default results/gpu_trainer), TOTAL_S (460: the bench gets what the checks and the
#   smoke leave of it), BENCH_CONFIG (configs/single_h200.yaml), BENCH_MODES (off,on,off-seq-mb4,on-seq,off-seq),
#   BENCH_ARGS (extra bench_trainer.py args, e.g. "--global-batch 32 trainer.micro_batch_size=32"), SKIP_SMOKE=1,
#   SKIP_CHECKS=1, QRL_BENCH_DEVICE (cuda; cpu only to try this script's logic on a machine without a GPU).
set -x
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-results/gpu_trainer}"
mkdir -p "$OUT"
TOTAL_S="${TOTAL_S:-460}"
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
'gpus', torch.cuda.device_count(), 'grouped_mm', hasattr(torch, '_grouped_mm'))"
  python3 -c "import transformer_engine" 2>&1 | tail -1 || true
  nproc
} 2>&1 | tee "$OUT/env.txt"

crc=0
if [ "${SKIP_CHECKS:-0}" != "1" ]; then
  timeout 170 python3 -m torch.distributed.run --nproc_per_node 1 --master_port 29533 tests/dist/grouped_experts.py \
    "$OUT/gpu_checks.json" "$DEVICE" 2>&1 | tee "$OUT/gpu_checks_log.txt" | grep -v "^\s*warnings.warn" | tail -60
  crc=${PIPESTATUS[0]}
  echo "gpu checks exit code: $crc"
fi

src=0
if [ "${SKIP_SMOKE:-0}" != "1" ]; then
  timeout 60 python3 tools/bench_trainer.py --smoke --device "$DEVICE" --out "$OUT/smoke.json" 2>&1 \
    | tee "$OUT/smoke_log.txt" | tail -25
  src=${PIPESTATUS[0]}
  echo "smoke exit code: $src"
fi

# the benchmark gets what is left; its --time-budget leaves ~30 s for imports, the extras and the table
left=$(( TOTAL_S - SECONDS - 5 ))
[ "$left" -lt 120 ] && left=120
budget=$(( left - 40 ))
# shellcheck disable=SC2086
timeout "$left" python3 tools/bench_trainer.py --config "${BENCH_CONFIG:-configs/single_h200.yaml}" \
  --device "$DEVICE" --modes "${BENCH_MODES:-off,on,off-seq-mb4,on-seq,off-seq}" --warmup 1 --steps 5 \
  --time-budget "$budget" --out "$OUT/bench_trainer.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_log.txt" | tail -60
brc=${PIPESTATUS[0]}
echo "bench exit code: $brc (checks $crc, smoke $src); total ${SECONDS}s"

python3 - "$OUT" <<'EOF'
"""summary.json: headline numbers and ratios of the parts that finished, against issue 28's targets."""
import json, os, sys
out = sys.argv[1]
def load(name):
    try:
        with open(os.path.join(out, name)) as f:
            return json.load(f)
    except Exception as e:  # noqa: BLE001 -- a part that did not finish
        return {"missing": f"{type(e).__name__}: {e}"}
checks, smoke, bench = load("gpu_checks.json"), load("smoke.json"), load("bench_trainer.json")
modes = bench.get("modes", {})
s = {"checks_ok": checks.get("summary", {}).get("ok"),
     "checks_failed": [k for k, v in checks.get("summary", {}).get("checks", {}).items() if not v["ok"]],
     "smoke_ok": smoke.get("ok"), "bench_failed_modes": list(bench.get("failed", {}))}
for name, m in modes.items():
    s[f"{name}/tokens_per_s"] = m.get("tokens_per_s")
    s[f"{name}/step_s"] = m.get("step_s_median")
    s[f"{name}/mfu"] = m.get("mfu")
    s[f"{name}/peak_mem_gib"] = m.get("peak_mem_gib")
r = bench.get("ratio", {})
off, base = modes.get("off", {}), modes.get("off-seq-mb4", {})
s["target/qat_off_tokens_per_s>=45000"] = off.get("tokens_per_s")
if off and base:
    s["qat_off_vs_previous_trainer(x, target >= 10)"] = off["tokens_per_s"] / base["tokens_per_s"]
s["qat_on_off(x, target <= 1.25)"] = r.get("step_time")
s["grouped_vs_seq_off(x)"] = r.get("grouped_vs_seq_off")
s["grouped_vs_seq_on(x)"] = r.get("grouped_vs_seq_on")
on = modes.get("on", {})
t, sc = on.get("trace", {}), on.get("sync", {})
s["logprobs_trace_vs_plain(x, target <= 1.3)"] = t.get("ratio", t.get("error"))
s["trace_code_mismatch_after(target <= 1e-4)"] = t.get("code_mismatch_after")
s["trace_code_mismatch_before"] = t.get("code_mismatch_before")
s["sync_pack_digest_s(target <= 0.15)"] = sc.get("pack_digest_s", sc.get("error"))
s["sync_payload_mb"] = sc.get("payload_mb")
s["sync_vs_previous_path(x)"] = sc.get("speedup")
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(s, f, indent=1, default=str)
print(json.dumps(s, indent=1, default=str))
EOF
[ "$crc" -eq 0 ] && [ "$src" -eq 0 ] && [ "$brc" -eq 0 ]
