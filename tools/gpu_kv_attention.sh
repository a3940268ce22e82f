#!/usr/bin/env bash
# Packed KV-cache kernels on a GPU machine: their tests on the device (tests/test_kernels_kv_cache.py with
# QRL_KERNEL_TESTS_DEVICE=cuda), then the decode-attention benchmark (tools/bench_attention.py), through
# tools/gpu_kernels.sh (same scratch-dir import of the package, SKIP_TESTS / SKIP_BENCH / TEST_TIMEOUT /
# BENCH_TIMEOUT).
# Usage (repository root): OUT=results/attn bash tools/gpu_kv_attention.sh [bench_attention.py args, e.g. --configs all]
cd "$(dirname "$0")/.."
OUT="${OUT:-results/gpu_kv_attention}" TESTS=tests/test_kernels_kv_cache.py BENCH=tools/bench_attention.py \
  TEST_TIMEOUT="${TEST_TIMEOUT:-120}" BENCH_TIMEOUT="${BENCH_TIMEOUT:-200}" exec bash tools/gpu_kernels.sh "$@"
