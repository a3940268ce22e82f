#!/usr/bin/env bash
# One device call (nvidia-h200-x2, carry .whl) for the TRACE, weight-sync and placement numbers of docs/PERF.md:
# (1) the weights-written-outside-autograd checks in bf16 (tests/dist/weights_only_load.py),
# (2) tools/bench_trace.py: capture overhead of the fp32 toy (the earlier PERF rows) and of a bf16
#     single_h200 cut on the Triton kernel path, (3) tools/gpu_loop.sh: disaggregated 1+1 and colocated EP=2.
set -uo pipefail
OUT=${OUT:-/tmp/qrl_gpu_measure}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 QRL_NO_PROGRESS=1
(cd tests/dist && timeout 120 python3 -m torch.distributed.run --nproc_per_node 1 --master_port 29533 \
   weights_only_load.py /tmp/wol) 2>&1 | grep -E "ok|follows|Error|assert" | tee "$OUT/weights.log"
CUDA_VISIBLE_DEVICES=0 timeout ${TB:-80} python3 tools/bench_trace.py --repeats ${REPEATS:-7} --prompts 32 \
  --max-new-tokens 16 --json "$OUT/trace_fp32.json" > "$OUT/bench_trace.log" 2>&1
CUDA_VISIBLE_DEVICES=0 timeout ${TB:-80} python3 tools/bench_trace.py --config configs/single_h200.yaml \
  --repeats ${REPEATS:-7} --prompts 32 --max-new-tokens 16 --time-budget 60 --json "$OUT/trace_bf16.json" \
  model.num_layers=4 >> "$OUT/bench_trace.log" 2>&1
grep -A12 "^| mode" "$OUT/bench_trace.log" | grep "^|"
OUT=$OUT T=${T:-150} bash tools/gpu_loop.sh
