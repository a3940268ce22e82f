#!/usr/bin/env python3
"""Hang and determinism stress for the Gluon W4A16 kernels on one GPU (sm_90).

A pipeline-protocol race shows up as a rare hang or a rare wrong tile, not in a handful of test calls. For
each config (default: every shared-A candidate at the bench shapes), this replays a CUDA graph of
`--calls-per-graph` calls many times (outputs zeroed before each replay). Every replay must finish (a
hang names its config: each config prints before it starts; run it under `timeout`); every 50th replay's
outputs, all calls of the graph, must be bit-identical to the first call's; and that first output must be
within REL_TOL of the fp32 dequantize-then-matmul reference.

  timeout 300 python tools/stress_gluon.py --calls 20000 --ms 64,128
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import DENSE_SHAPES, _imports, _random_prepared, rel_err  # noqa: E402

REL_TOL = 1e-2   # bf16 output against an fp32 reference: the kernels measure 2.4e-3 here


def stress(dense, layouts, k, n, m, cfg, calls, per_graph):
    w = _random_prepared(layouts, "nvfp4", None, n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ layouts.dequantize_prepared(w).float().t()
    outs = torch.empty(per_graph, m, n, device="cuda", dtype=torch.bfloat16)
    dense.w4a16_gemm(x, w, config=cfg, out=outs[0])                     # compile + warm up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for j in range(per_graph):
            dense.w4a16_gemm(x, w, config=cfg, out=outs[j])
    first = None
    replays = max(1, calls // per_graph)
    for r in range(replays):
        outs.zero_()
        graph.replay()
        if first is None:
            torch.cuda.synchronize()
            first = outs[0].clone()
        if r % 50 == 49 or r == replays - 1:
            bad = (outs != first).flatten(1).any(1).nonzero().flatten().tolist()
            if bad:
                return f"MISMATCH in calls {bad[:4]} of replay {r}"
    torch.cuda.synchronize()
    err = rel_err(first.float(), ref)
    if err > REL_TOL:
        return f"WRONG: rel. err {err:.1e} > {REL_TOL:g} against the reference"
    return f"ok, {replays * per_graph} calls, rel. err {err:.1e}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=20000, help="calls per config")
    ap.add_argument("--calls-per-graph", type=int, default=50)
    ap.add_argument("--ms", type=lambda s: [int(v) for v in s.split(",")], default=[64, 128])
    ap.add_argument("--only", default="GS", help="configs whose names start with these comma-separated prefixes")
    args = ap.parse_args()
    layouts, dense, *_ = _imports()
    from megatron_qrl.kernels.w4a16_gluon_gemm import gluon_candidates
    prefixes = tuple(p for p in args.only.split(",") if p)
    failures = 0
    for k, n in DENSE_SHAPES:
        for m in args.ms:
            for cfg in gluon_candidates(m, n, k):
                if not cfg.short().startswith(prefixes):
                    continue
                print(f"({k}, {n}) M={m} {cfg.short()}: ", end="", flush=True)
                t0 = time.perf_counter()
                res = stress(dense, layouts, k, n, m, cfg, args.calls, args.calls_per_graph)
                failures += not res.startswith("ok")
                print(f"{res} ({time.perf_counter() - t0:.1f} s)", flush=True)
    print("stress:", "FAILED" if failures else "all configs ok")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
