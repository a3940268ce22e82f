#!/usr/bin/env bash
# One device call (nvidia-h200, carry .whl) for the decode work of issue 27: the GPU tests of the routing and
# fused-norm kernels, the rollout bench (4 and 48 layers, FP4 vs BF16 vs HF, per-kernel step profiles, TRACE and
# sampling overheads, graph-vs-eager checks), the packed-KV attention tests and bench, and the evidence engine's
# decode path. Each part has its own timeout; everything lands in $OUT/all.tgz (the device tool returns <= 8 files).
set -uo pipefail
cd "$(dirname "$0")/.."
O="${OUT:-results/gpu_session_decode}"
mkdir -p "$O"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset TRITON_INTERPRET
QRL_KERNEL_TESTS_DEVICE=cuda timeout "${T_TESTS:-80}" python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_kernels_decode_routing.py tests/test_kernels_decode_fused.py > "$O/tests_decode.txt" 2>&1
echo "decode kernel tests rc=$? $(tail -1 "$O/tests_decode.txt")"
OUT=$O/roll BENCH_TIMEOUT="${T_ROLL:-280}" bash tools/gpu_rollout.sh ${ROLL_ARGS:---layers 4,48 --batches 1,16,64,256 \
  --engines fp4,bf16,hf --overheads 64 --check 16 --profile 16,64,256 --reps 2} | grep -v "^\[bench\] profile" | tail -60
OUT=$O/attn TEST_TIMEOUT="${T_ATTN_TESTS:-70}" BENCH_TIMEOUT="${T_ATTN:-100}" bash tools/gpu_kv_attention.sh \
  ${ATTN_ARGS:---configs all --rep-ms 30 --time-budget 60} | tail -40
timeout "${T_CHECK:-60}" python3 - <<'PY' 2>&1 | grep -v "DEPRECATED\|warn" | tail -5
from megatron_qrl.config import load_config
from megatron_qrl.platform import init_distributed
cfg = load_config("configs/evidence/gpu_base.yaml", ["rollout.decode=graphs", "rollout.max_batch_size=16"])
init_distributed(cfg)
from megatron_qrl.rollout import EmbeddedEngine, SamplingParams
eng = EmbeddedEngine(cfg)
eng.sync_from_model(eng.model, 0)
out = eng.generate([[1, 2, 3, 4, 5]] * 16, SamplingParams(temperature=0.0, max_new_tokens=12))
h = eng.health()
print("evidence engine:", h["decode"], "graphs", h["graphs_captured"], "failure", h["graph_failure"],
      "kernels", h["fp4_kernels"], "kv", {k: v for k, v in h.items() if k.startswith("kv")},
      "replays", eng._static_loop.stats["replays"], "trace roles", sorted(out[0].trace[3]))
PY
cd "$O" && tar czf all.tgz $(ls -d roll attn tests_decode.txt 2>/dev/null) && rm -rf roll attn tests_decode.txt
