#!/usr/bin/env python3
"""W4A16 kernel benchmark on one GPU (H200): FP4 dense and grouped-MoE GEMMs against bf16 in one run.

For every shape it first checks correctness on the GPU (fresh random weights quantized with the codec,
fresh activations, rel. error vs the dequantize-then-matmul reference), then times:
  dense:  torch.matmul(x, W_bf16.T) (cuBLAS)  vs  w4a16_gemm(x, prepared FP4 W)
  MoE:    bf16 grouped baseline (torch._grouped_mm if present, else a per-expert loop)  vs  moe_w4a16
Each timed sample is a CUDA graph that runs `--copies` layers with distinct weights (more bytes than the
L2 holds, so weights stream from HBM as in a real decode step), replayed under triton.testing.do_bench;
the median over replays divided by the layer count is the per-layer time. Achieved weight bandwidth is
compared with a measured device-to-device copy (bytes read + written).

`--configs all` times every candidate kernel config per shape (what QRL_W4A16_AUTOTUNE picks from) and
reports the best and the sm_90 heuristic one; kernels are compiled in parallel worker processes first
(Triton's on-disk cache then serves the timed process).

  python tools/bench_kernels.py --out results/            # table (markdown) + JSON
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

DENSE_SHAPES = [(4096, 14336), (7168, 4096)]       # (K, N)
MOE = dict(hidden=2048, ffn=768, experts=128, top_k=8)
MS = [1, 8, 32, 128, 512]
TARGETS = {"dense_small_m": 3.0, "dense_m128": 1.0, "moe_small_t": 2.5}
L2_BYTES = 60e6  # H200 L2 is 60 MB (read from the device at start)
DEV = "cuda"   # --cpu-smoke: "cpu" + the Triton interpreter + tiny shapes, to test this script without a GPU


def _imports():
    from megatron_qrl.kernels import layouts, moe_grouped_gemm as moe, w4a16_gemm as dense
    from megatron_qrl.quant import mxfp4_quantize, nvfp4_quantize
    return layouts, dense, moe, nvfp4_quantize, mxfp4_quantize


# ----------------------------------------------------------------------------------------------------
# timing helpers
# ----------------------------------------------------------------------------------------------------
def graph_time_us(fns, reps_ms=200):
    """Median time of one call, from a CUDA graph that runs all fns (one per layer copy) back to back."""
    import triton.testing as tt

    if DEV == "cpu":
        t0 = time.perf_counter()
        for f in fns:
            f()
        return (time.perf_counter() - t0) * 1e6 / len(fns)
    for f in fns:
        f()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    torch.cuda.synchronize()
    ms = tt.do_bench(g.replay, warmup=25, rep=reps_ms, return_mode="median")
    return ms * 1e3 / len(fns)


def copy_bandwidth_gbs():
    import triton.testing as tt

    if DEV == "cpu":
        return 1.0
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=DEV).random_(0, 255)
    b = torch.empty_like(a)
    ms = tt.do_bench(lambda: b.copy_(a), warmup=25, rep=200, return_mode="median")
    return 2 * n / (ms * 1e-3) / 1e9


def _read_kernel():
    """A Triton streaming read (16-byte vector loads, one partial sum per program): the cost of reading a
    byte count with no math at all, the floor under any kernel that must read those bytes."""
    import triton
    import triton.language as tl

    @triton.jit
    def read_all(p, out, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(p + offs, mask=offs < n, other=0, cache_modifier=".cg")
        tl.store(out + tl.program_id(0), tl.sum(v, axis=0))

    def run(buf, out, block):
        read_all[(triton.cdiv(buf.numel(), block),)](buf, out, buf.numel(), BLOCK=block, num_warps=8)
    return run


def read_roofline_us(nbytes, k, copies, rep_ms):
    """(fastest Triton streaming read of nbytes, cuBLAS bf16 GEMV at M = 1 over a bf16 weight of the same
    byte count [nbytes / 2K, K]), per layer, timed like the kernels (CUDA graph over `copies` buffers)."""
    if DEV == "cpu":
        return float("nan"), float("nan")
    read = _read_kernel()
    bufs = [torch.randint(0, 1 << 30, (nbytes // 4,), device=DEV, dtype=torch.int32) for _ in range(copies)]
    outs = [torch.empty(nbytes // 4 // 2048 + 1, device=DEV, dtype=torch.int32) for _ in range(copies)]
    read_us = min(graph_time_us([lambda b=b, o=o: read(b, o, block) for b, o in zip(bufs, outs)], rep_ms)
                  for block in (2048, 4096, 8192))
    bufs = outs = None
    w_eq = [torch.randn(nbytes // (2 * k), k, device=DEV, dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
    return read_us, graph_time_us([lambda w=w: torch.matmul(x, w.t()) for w in w_eq], rep_ms)


def safe(log, what, fn, default=None):
    """Run fn(); on an exception log it and return default (one failing case must not end the run)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        log(f"  ERROR {what}: {type(e).__name__}: {str(e)[:300]}")
        return default


def rel_err(y, ref):
    y, ref = y.float(), ref.float()
    if not torch.isfinite(y).all():
        return float("inf")
    return ((y - ref).norm() / ref.norm()).item()


# ----------------------------------------------------------------------------------------------------
# cases
# ----------------------------------------------------------------------------------------------------
def dense_configs(dense, fmt, m, n, k, mode, only=""):
    """The default config, plus (mode "all") the autotuner's candidates, optionally only those whose names
    start with one of the comma-separated prefixes in `only` (e.g. "T,V": the two GEMV kernels)."""
    if mode in ("heuristic", "gluon", "blocks", "sync", "layout"):
        return [dense.heuristic_config(fmt, m, n, k)]
    cands = dense.candidate_configs(fmt, m, n, k)
    if only:
        keep = tuple(p for p in only.split(",") if p)
        cands = [c for i, c in enumerate(cands) if i == 0 or c.short().startswith(keep)]
    return cands


def moe_configs(moe, t, mode):
    n_assign = t * MOE["top_k"]
    gu = moe.heuristic_moe_config(n_assign, MOE["experts"], MOE["ffn"], MOE["hidden"], True)
    dn = moe.heuristic_moe_config(n_assign, MOE["experts"], MOE["hidden"], MOE["ffn"], False)
    out = [(gu, dn)]
    if mode == "all" and n_assign <= 4 * MOE["experts"]:
        # the CUDA-core GEMV (block_m tokens per program, gate/up and down weight-row tiles)
        for bm, bn_gu, bn_dn, w in ((1, 32, 64, 4), (1, 64, 64, 4), (1, 64, 128, 8), (2, 32, 64, 4),
                                    (2, 64, 64, 4), (2, 32, 32, 4), (2, 64, 64, 8)):
            out.append((moe.MoEConfig(bm, bn_gu, moe._bk(MOE["hidden"]), w, 1, gemv=True),
                        moe.MoEConfig(bm, bn_dn, moe._bk(MOE["ffn"]), w, 1, gemv=True)))
    if gu.gemv:          # the tensor-core kernel's default and its variants below
        gu = moe.heuristic_moe_config(n_assign, MOE["experts"], MOE["ffn"], MOE["hidden"], True, gemv=False)
        dn = moe.heuristic_moe_config(n_assign, MOE["experts"], MOE["hidden"], MOE["ffn"], False, gemv=False)
        out.append((gu, dn))
    if mode == "all":     # the tensor-core defaults of the neighbouring block_m buckets (16 / 32 / 64 rows)
        for per_expert in (8, 32, 64):
            n_alt = per_expert * MOE["experts"]
            alt = (moe.heuristic_moe_config(n_alt, MOE["experts"], MOE["ffn"], MOE["hidden"], True, gemv=False),
                   moe.heuristic_moe_config(n_alt, MOE["experts"], MOE["hidden"], MOE["ffn"], False, gemv=False))
            if alt[0].block_m != gu.block_m:
                out.append((replace(alt[0], x_pre=alt[0].x_pre and n_assign >= 64), alt[1]))
    if mode == "all":     # the tensor-core kernel: one step in each direction from its default
        gk = gu.block_k
        out += [(replace(gu, block_k=max(32, gk // 2), num_stages=4), dn), (replace(gu, num_stages=4), dn),
                (replace(gu, block_k=min(256, 2 * gk)), dn), (replace(gu, block_n=32), dn),
                (replace(gu, block_n=128, num_warps=8), dn), (replace(gu, x_pre=not gu.x_pre), dn),
                (gu, replace(dn, block_k=max(32, dn.block_k // 2))), (gu, replace(dn, num_stages=3)),
                (gu, replace(dn, block_k=min(256, 2 * dn.block_k), num_stages=3)),
                (gu, replace(dn, block_n=32)), (gu, replace(dn, block_n=128, num_warps=8)),
                (replace(gu, tma=not gu.tma), replace(dn, tma=not dn.tma)), (replace(gu, tma=not gu.tma), dn),
                (gu, replace(dn, tma=not dn.tma))]
    if mode in ("gluon", "all"):
        out += gluon_moe_variants(moe, n_assign)
    if mode in ("blocks", "all") and gu.block_m in (16, 32):
        out += block_variants(moe, n_assign)
    if mode in ("sync", "all") and not gu.gemv and not gu.gluon:
        # the kernel before 2026-12-07 (scales byte by byte, no sync_dots); sync_dots (dots that wait for the MMAs
        # in flight: no wgmma serialization by ptxas) switched on gate/up, on down, on both
        out += [(replace(gu, packed_scales=False, sync_dots=False), replace(dn, packed_scales=False, sync_dots=False)),
                (replace(gu, sync_dots=not gu.sync_dots), dn), (gu, replace(dn, sync_dots=not dn.sync_dots)),
                (replace(gu, sync_dots=not gu.sync_dots), replace(dn, sync_dots=not dn.sync_dots))]
        if gu.block_m == 32 and gu.sync_dots:
            # fewer loop instructions per weight byte for fewer programs per SM (tools/inspect_moe_sm90.py
            # --triton-tiles): 128 gate + 128 up rows per program, two stages: 3.70 -> 3.04 per 16-byte code vector,
            # 197 registers (2 programs per SM); 256-wide K steps, two stages: 3.27, 181 registers
            out += [(replace(gu, block_n=128, num_stages=2), dn), (replace(gu, block_k=256, num_stages=2), dn)]
        if gu.block_m in (16, 32):
            # two K steps per loop trip (MoEConfig.unroll), two stages (the three-stage rings doubled would halve the
            # programs per SM): the loop's bookkeeping paid once per two steps. tools/inspect_moe_sm90.py --unroll 2,
            # 32-row blocks, per 16-byte code vector: gate/up 3.70 -> 3.49 (123 registers), down with sync_dots
            # 3.67 -> 3.19 (164 registers: 3 programs per SM)
            gu2 = replace(gu, unroll=2, num_stages=2)
            dn2 = replace(dn, unroll=2, num_stages=2, sync_dots=True)
            out += [(gu2, dn), (gu, dn2), (gu2, dn2), (gu2, replace(dn2, sync_dots=False))]
            # persistent programs (MoEConfig.persistent: tile and K loops pipelined as one, no pipeline fill per
            # tile), as many per SM as their registers allow (inspect_moe_sm90 on the persistent kernel: gate/up
            # 122 registers at 32-row blocks, 95 at 16; down 196 with 128-row tiles, 96 with 64)
            gup = replace(gu, persistent=4 if gu.block_m == 32 else 5)
            dnp = replace(dn, persistent=2 if dn.block_n == 128 else 5)
            out += [(gup, dn), (gu, dnp), (gup, dnp)]
            if gu.block_m == 32:
                # more programs per SM: registers capped at 96 (gate/up 101 -> 96, down 125 -> 96: 5 programs per SM by
                # registers), with two stages also by shared memory (gate/up 43 -> 26 KB; inspect_moe_sm90: 2 / 22
                # spill instructions, none in the loop)
                gu96, dn96 = replace(gu, max_regs=96), replace(dn, max_regs=96)
                gu96s2, dn96s2 = replace(gu96, num_stages=2), replace(dn96, num_stages=2)
                out += [(gu96, dn), (gu96s2, dn), (gu, dn96), (gu, dn96s2), (gu96s2, dn96s2)]
    if mode == "layout" and not gu.gemv and not gu.gluon:
        # tile-major stacks (MoEConfig.tile_major, layouts.tile_major_experts): each trip's weight tile one contiguous
        # run of codes and one of scales, instead of block_n rows' pieces of block_k / 2 bytes 1 KB apart (and
        # 8-byte scale pieces): on gate/up, down, both; both with the register cap of the sync rows
        gut, dnt = replace(gu, tile_major=True), replace(dn, tile_major=True)
        out += [(gut, dn), (gu, dnt), (gut, dnt)]
        if gu.block_m == 32:
            out.append((replace(gut, max_regs=96), replace(dnt, max_regs=96)))
    return list(dict.fromkeys(out))


STACK_TILE_ROWS = 64     # the tile rows of tile-major stacks here: the engine's 64 x 128 tile where block_k = 128


def stacks_for(layouts, cfg, w, cache: dict):
    """w as cfg reads it: tile-major stacks of STACK_TILE_ROWS-row tiles (whole tiles per weight tile: down's
    128-row tiles load two) and cfg's K steps, made once per weight and tile (kept in cache), or w."""
    if not cfg.tile_major:
        return w
    key = (id(w), min(STACK_TILE_ROWS, cfg.block_n), cfg.block_k)
    if key not in cache:
        cache[key] = layouts.tile_major_experts(w, *key[1:])
    return cache[key]


def block_variants(moe, n_assign):
    """Fewer dequant instructions per weight byte where the heuristic takes 16-row blocks (tools/inspect_moe_sm90.py
    --triton-tiles, sm_90a, warp instructions per 16-byte code vector of the K loop): 32-row blocks with the
    16-row blocks' 128-wide K steps (gate/up 64 rows 4.09, 128 rows 3.50; down 128 rows 3.86), and 16-row blocks
    with 128-row tiles (gate/up 3.47, down 3.74, against the heuristic's 3.98 / 4.59). Why: the kernel is bound by
    instructions, not bytes, and at 16 assignments per expert (T = 256, E = 128, top-8) about half the experts
    spill into a second 16-row block whose program dequantizes the same weight tiles again. (The heuristic's own
    32-row gate/up config took 256-wide K steps on bf16 x: 139 registers, 84 KB of shared memory, 2 programs per SM;
    kept as a variant, beside the heuristic's 32-row blocks too.)"""
    x_pre = n_assign >= 64
    C = moe.MoEConfig

    def gu(bm, bn, stages=3, tma=True):
        return C(bm, bn, min(128, moe._bk(MOE["hidden"])), 4, stages, x_pre=x_pre, tma=tma)

    def dn(bm, bn, tma=True):
        return C(bm, bn, min(128, moe._bk(MOE["ffn"])), 4, 3, tma=tma)
    wide32 = C(32, 64, moe._bk(MOE["hidden"]), 4, 3, tma=True)      # the 32-row gate/up tiles above BLOCK32_NARROW_K_MAX_PER_EXPERT
    return [(gu(32, 64), dn(32, 128)), (wide32, dn(32, 128)), (gu(32, 128), dn(32, 128)), (gu(32, 64), dn(32, 64)),
            (gu(32, 64, 4), dn(32, 128)), (gu(32, 64, tma=False), dn(32, 128, tma=False)),
            (gu(16, 64), dn(16, 128)), (gu(16, 128), dn(16, 128))]


def gluon_moe_variants(moe, n_assign):
    """The Gluon kernel (kernels/moe_gluon.py) at block_m 16, scale pairs through the cp.async ring (gate/up rows,
    down rows, warps): 16 rows per warp (~110 / ~75 registers: 16-28 warps per SM) at 2 and 4 warps; 32 / 64
    rows per warp at 2 and 4 warps (the best of the 2026-12-06 run before the scale ring: 260 / 247 us at
    T=256); one warp with the default rows and with 64 gate rows (fewest programs, 6 warps per SM); at T <= 64
    two of them at block_m 8 too. Short on purpose: one device call compares them with the Triton heuristic (docs/PERF.md, compile reports)."""
    x_pre = n_assign >= 64

    def pair(gu_rows, dn_rows, warps, stages=3, bm=16):
        return (moe.gluon_moe_config(bm, True, x_pre, rows=gu_rows, warps=warps, stages=stages),
                moe.gluon_moe_config(bm, False, rows=dn_rows, warps=warps, stages=stages))
    out = [pair(32, 32, 2), pair(64, 64, 4), pair(64, 128, 2), pair(128, 256, 4), pair(32, 64, 1),
           pair(64, 64, 1)]
    if n_assign <= 4 * MOE["experts"]:
        # <= 4 rows per expert on average (T <= 64): blocks of 8 rows, half the MMA columns and x bytes of 16,
        # few experts past 8 rows (their weights read twice)
        out += [pair(64, 64, 4, bm=8), pair(32, 64, 1, bm=8)]
    return out


def moe_config_name(gu, dn) -> str:
    """A bench row's name: kernel, gate/up tiles (block_m x rows x block_k), down tiles."""
    kind = "gemv " if gu.gemv else "gluon " if gu.gluon else ""
    return (f"{kind}gu {gu.block_m}x{gu.block_n}x{gu.block_k}/w{gu.num_warps}"
            f"s{gu.num_stages}{'/xpre' if gu.x_pre else ''}{'/tma' if gu.tma else ''}"
            f"{'/sync' if gu.sync_dots else ''}"
            f"{'' if gu.packed_scales else '/bytescales'}{f'/u{gu.unroll}' if gu.unroll > 1 else ''}"
            f"{f'/p{gu.persistent}' if gu.persistent else ''}{f'/r{gu.max_regs}' if gu.max_regs else ''}"
            f"{'/tiled' if gu.tile_major else ''} dn "
            f"{'G' if dn.gluon else ''}{dn.block_n}x{dn.block_k}/w{dn.num_warps}s{dn.num_stages}"
            f"{'/tma' if dn.tma else ''}{'/sync' if dn.sync_dots else ''}"
            f"{'' if dn.packed_scales else '/bytescales'}{f'/u{dn.unroll}' if dn.unroll > 1 else ''}"
            f"{f'/p{dn.persistent}' if dn.persistent else ''}{f'/r{dn.max_regs}' if dn.max_regs else ''}"
            f"{'/tiled' if dn.tile_major else ''}")


def plan(args):
    """All (kind, key, config) cases, for parallel precompilation."""
    _, dense, moe, *_ = _imports()
    cases = []
    for fmt in args.formats:
        for k, n in DENSE_SHAPES:
            for m in (args.ms if fmt == "nvfp4" else [mm for mm in args.ms if mm in (1, 128)]):
                for cfg in dense_configs(dense, fmt, m, n, k, args.configs, args.only):
                    cases.append(("dense", fmt, m, n, k, cfg))
    if not args.skip_moe:
        for t in args.moe_tokens:
            for gu, dn in moe_configs(moe, t, args.configs):
                cases.append(("moe", "nvfp4", t, gu, dn))
    return cases


def _compile_case(case):
    """Worker: run one case once on small random data so Triton compiles (and caches) its kernels."""
    try:
        layouts, dense, moe, *_ = _imports()
        if DEV == "cuda":
            torch.cuda.init()
        if case[0] == "dense":
            _, fmt, m, n, k, cfg = case
            w = _random_prepared(layouts, fmt, None, n, k)
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            dense.w4a16_gemm(x, w, config=cfg)
        else:
            _, fmt, t, gu, dn = case
            w13 = _random_prepared(layouts, fmt, MOE["experts"], 2 * MOE["ffn"], MOE["hidden"])
            w2 = _random_prepared(layouts, fmt, MOE["experts"], MOE["hidden"], MOE["ffn"])
            x = torch.randn(t, MOE["hidden"], device=DEV, dtype=torch.bfloat16)
            ids, tw = _routing(t)
            tiles = {}
            moe.moe_w4a16(x, stacks_for(layouts, gu, w13, tiles), stacks_for(layouts, dn, w2, tiles), ids, tw,
                          gate_up_config=gu, down_config=dn)
        if DEV == "cuda":
            torch.cuda.synchronize()
        return None
    except Exception as e:  # reported, the timed run skips nothing: it recompiles and fails loudly there
        return f"{case[:3]}: {type(e).__name__}: {e}"


def precompile(cases, workers):
    if workers <= 1 or not cases:
        return []
    t0 = time.time()
    with mp.get_context("spawn").Pool(min(workers, len(cases))) as pool:
        errs = [e for e in pool.map(_compile_case, cases, chunksize=1) if e]
    print(f"precompiled {len(cases)} cases with {workers} workers in {time.time() - t0:.1f}s "
          f"({len(errs)} errors)", flush=True)
    for e in errs:
        print("  precompile error:", e, flush=True)
    return errs


def _random_prepared(layouts, fmt, experts, n, k):
    """A prepared weight of random codes and realistic scales (timing copies; values irrelevant)."""
    lead = (experts,) if experts else ()
    packed = torch.randint(0, 256, (*lead, n, k // 2), dtype=torch.uint8, device=DEV)
    if fmt == "nvfp4":
        s = (torch.rand(*lead, n, k // 16, device=DEV) * 300 + 8).to(torch.float8_e4m3fn)
        g = torch.full(lead or (), 1e-4, device=DEV)
        return layouts.prepare_nvfp4_weight(packed, s, g)
    s = torch.randint(110, 125, (*lead, n, k // 32), dtype=torch.uint8, device=DEV)
    return layouts.prepare_mxfp4_weight(packed, s)


def _routing(t, gen=None):
    logits = torch.randn(t, MOE["experts"], device=DEV, generator=gen)
    tw, ids = torch.topk(torch.softmax(logits, -1), MOE["top_k"], dim=-1)
    return ids, tw


def _quantized(fmt, nvfp4_quantize, mxfp4_quantize, layouts, shape, gen):
    w = torch.randn(*shape, device=DEV, generator=gen) * 0.02
    if len(shape) == 2:
        return (layouts.prepare_nvfp4_weight(*nvfp4_quantize(w)) if fmt == "nvfp4"
                else layouts.prepare_mxfp4_weight(*mxfp4_quantize(w)))
    q = [nvfp4_quantize(w[e]) if fmt == "nvfp4" else mxfp4_quantize(w[e]) for e in range(shape[0])]
    if fmt == "nvfp4":
        return layouts.prepare_nvfp4_weight(torch.stack([a[0] for a in q]), torch.stack([a[1] for a in q]),
                                            torch.stack([a[2] for a in q]))
    return layouts.prepare_mxfp4_weight(torch.stack([a[0] for a in q]), torch.stack([a[1] for a in q]))


# ----------------------------------------------------------------------------------------------------
# dense
# ----------------------------------------------------------------------------------------------------
def _fastest(results, name_pred):
    """The fastest timed result whose config name satisfies name_pred, or None."""
    hits = [r for r in results if name_pred(r["config"])]
    return min(hits, key=lambda r: r["us"]) if hits else None


def bench_dense(args, copy_bw, log):
    layouts, dense, moe, nvfp4_quantize, mxfp4_quantize = _imports()
    rows = []
    for fmt in args.formats:
        for k, n in DENSE_SHAPES:
            gen = torch.Generator(device=DEV).manual_seed(int.from_bytes(os.urandom(4), "little"))
            wq = _quantized(fmt, nvfp4_quantize, mxfp4_quantize, layouts, (n, k), gen)
            fp4_bytes = wq.nbytes()
            copies = min(64, max(args.copies, math.ceil(3 * L2_BYTES / fp4_bytes)))
            w_fp4 = [_random_prepared(layouts, fmt, None, n, k) for _ in range(copies - 1)] + [wq]
            w_bf16 = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) for _ in range(copies)]
            wd = layouts.dequantize_prepared(wq, torch.float32)
            read_us, bf16_eq_us = safe(log, "read roofline", lambda: read_roofline_us(
                fp4_bytes, k, copies, args.rep_ms), (float("nan"), float("nan")))
            log(f"dense {fmt} K={k} N={n}: reading the {fp4_bytes / 1e6:.1f} MB of FP4 weight bytes: "
                f"{read_us:.1f} us (Triton streaming read, no math), {bf16_eq_us:.1f} us (cuBLAS bf16 GEMV over "
                f"the same byte count)")
            ms = args.ms if fmt == "nvfp4" else [m for m in args.ms if m in (1, 128)]
            for m in ms:
                x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
                ref = (x.float() @ wd.t())
                t_bf16 = safe(log, f"bf16 matmul M={m}", lambda: graph_time_us(
                    [lambda w=w: torch.matmul(x, w.t()) for w in w_bf16], args.rep_ms), float("nan"))
                results = []
                for cfg in dense_configs(dense, fmt, m, n, k, args.configs, args.only):
                    if os.environ.get("BENCH_TRACE"):   # which config a hang or crash happened in
                        print(f"  trace: K={k} N={n} M={m} {cfg.short()}", flush=True)
                    xx = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)  # fresh inputs
                    err = safe(log, cfg.short(), lambda: max(
                        rel_err(dense.w4a16_gemm(xx, wq, config=cfg), xx.float() @ wd.t()),
                        rel_err(dense.w4a16_gemm(x, wq, config=cfg), ref)), float("inf"))
                    err0 = err
                    if max(err, err0) > 1e-2:
                        results.append(dict(config=cfg.short(), err=max(err, err0), us=None))
                        log(f"  FAIL {fmt} K={k} N={n} M={m} {cfg.short()} rel_err={max(err, err0):.3e}")
                        continue
                    us = safe(log, f"time {cfg.short()}", lambda: graph_time_us(
                        [lambda w=w: dense.w4a16_gemm(x, w, config=cfg) for w in w_fp4], args.rep_ms))
                    if us is None:
                        results.append(dict(config=cfg.short(), err=err, us=None))
                        continue
                    results.append(dict(config=cfg.short(), cfg=asdict(cfg), err=max(err, err0), us=us))
                ok = [r for r in results if r["us"] is not None]
                best = _fastest(ok, lambda c: True)
                heur = dense.heuristic_config(fmt, m, n, k).short()
                heur_r = next((r for r in ok if r["config"] == heur), None)
                # wgmma kernel (GemmConfig) vs CUDA-core GEMV (GemvConfig, names "V...") vs register-fragment
                # MMA GEMV (MmaGemvConfig, names "T...") vs Gluon register-A wgmma (GluonGemmConfig, "G...")
                best_dot = _fastest(ok, lambda c: c[0] not in "VTG")
                best_gemv = _fastest(ok, lambda c: c.startswith("V"))
                best_mma = _fastest(ok, lambda c: c.startswith("T"))
                best_gluon = _fastest(ok, lambda c: c.startswith("G"))
                row = dict(kind="dense", fmt=fmt, K=k, N=n, M=m, copies=copies, bf16_us=t_bf16,
                           fp4_us=best["us"] if best else None, best=best, heuristic=heur_r, all=results,
                           best_dot=best_dot, best_gemv=best_gemv, best_mma=best_mma, best_gluon=best_gluon,
                           fp4_weight_bytes=fp4_bytes, bf16_weight_bytes=2 * n * k, copy_gbs=copy_bw,
                           read_us=read_us, bf16_equal_bytes_us=bf16_eq_us)
                if best:
                    row["speedup"] = t_bf16 / best["us"]
                    row["fp4_gbs"] = fp4_bytes / (best["us"] * 1e-6) / 1e9
                    row["bf16_gbs"] = 2 * n * k / (t_bf16 * 1e-6) / 1e9
                rows.append(row)
                log(f"dense {fmt} K={k} N={n} M={m}: bf16 {t_bf16:.1f}us  fp4 "
                    f"{best['us'] if best else float('nan'):.1f}us ({best['config'] if best else '-'}) "
                    f"x{row.get('speedup', float('nan')):.2f}  fp4 {row.get('fp4_gbs', 0):.0f} GB/s  "
                    f"err {best['err'] if best else float('nan'):.1e}  | tensor-core "
                    f"{best_dot['us'] if best_dot else float('nan'):.1f}us ({best_dot['config'] if best_dot else '-'})"
                    f"  gemv {best_gemv['us'] if best_gemv else float('nan'):.1f}us "
                    f"({best_gemv['config'] if best_gemv else '-'})  mma "
                    f"{best_mma['us'] if best_mma else float('nan'):.1f}us "
                    f"({best_mma['config'] if best_mma else '-'})  gluon "
                    f"{best_gluon['us'] if best_gluon else float('nan'):.1f}us "
                    f"({best_gluon['config'] if best_gluon else '-'})  default "
                    f"{heur_r['us'] if heur_r else float('nan'):.1f}us ({heur})", row)
            w_fp4 = w_bf16 = None  # free before the next shape
            if DEV == "cuda":
                torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------------------------------
# MoE
# ----------------------------------------------------------------------------------------------------
def _grouped_baseline(x, w13, w2, ids, tw, use_grouped_mm):
    """bf16 routed-expert SwiGLU MLP: sort by expert, grouped GEMMs (torch._grouped_mm) or a loop."""
    e, f2, h = w13.shape
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    tok = order // k
    counts = torch.zeros(e, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    wsort = tw.reshape(-1)[order].float()
    return dict(order=order, tok=tok, offs=offs, wsort=wsort, counts=counts, grouped=use_grouped_mm)


def _grouped_forward(x, w13, w2, r):
    f = w13.shape[1] // 2
    xs = x.index_select(0, r["tok"])
    if r["grouped"]:
        g = torch._grouped_mm(xs, w13.transpose(1, 2), offs=r["offs"])
        hmid = torch.nn.functional.silu(g[:, :f]) * g[:, f:]
        y = torch._grouped_mm(hmid, w2.transpose(1, 2), offs=r["offs"])
    else:
        ys, start = [], 0
        for e, c in enumerate(r["counts"].tolist()):
            if c:
                g = xs[start:start + c] @ w13[e].t()
                ys.append((torch.nn.functional.silu(g[:, :f]) * g[:, f:]) @ w2[e].t())
            start += c
        y = torch.cat(ys)
    y = (y.float() * r["wsort"][:, None]).to(x.dtype)
    out = torch.zeros(x.shape[0], w2.shape[1], device=x.device, dtype=torch.float32)
    out.index_add_(0, r["tok"], y.float())
    return out.to(x.dtype)


def bench_moe(args, copy_bw, log):
    layouts, dense, moe, nvfp4_quantize, mxfp4_quantize = _imports()
    e, h, f, k = MOE["experts"], MOE["hidden"], MOE["ffn"], MOE["top_k"]
    gen = torch.Generator(device=DEV).manual_seed(int.from_bytes(os.urandom(4), "little"))
    w13q = _quantized("nvfp4", nvfp4_quantize, mxfp4_quantize, layouts, (e, 2 * f, h), gen)
    w2q = _quantized("nvfp4", nvfp4_quantize, mxfp4_quantize, layouts, (e, h, f), gen)
    copies = args.copies
    fp4 = [(_random_prepared(layouts, "nvfp4", e, 2 * f, h), _random_prepared(layouts, "nvfp4", e, h, f))
           for _ in range(copies - 1)] + [(w13q, w2q)]
    bf = [(torch.randn(e, 2 * f, h, device=DEV, dtype=torch.bfloat16),
           torch.randn(e, h, f, device=DEV, dtype=torch.bfloat16)) for _ in range(copies)]
    deq = (layouts.dequantize_prepared(w13q, torch.float32), layouts.dequantize_prepared(w2q, torch.float32))
    w13d, w2d = deq[0].to(torch.bfloat16), deq[1].to(torch.bfloat16)
    per_expert_fp4 = (w13q.nbytes() + w2q.nbytes()) / e
    per_expert_bf16 = 2 * (2 * f * h + h * f)
    use_gmm = hasattr(torch, "_grouped_mm")
    rows = []
    tiles = {}          # tile-major stacks of the weights above, per tile (configs with tile_major)
    for t in args.moe_tokens:
        x = torch.randn(t, h, device=DEV, dtype=torch.bfloat16, generator=gen)
        routs = [_routing(t, gen) for _ in range(copies)]
        ids, tw = routs[-1]
        ref = moe.moe_w4a16_reference(x, w13q, w2q, ids, tw, deq)
        base = None
        if use_gmm:
            try:
                rb = _grouped_baseline(x, w13d, w2d, ids, tw, True)
                base_err = rel_err(_grouped_forward(x, w13d, w2d, rb), ref)
                if base_err > 3e-2:
                    raise RuntimeError(f"grouped_mm baseline rel_err {base_err:.2e}")
                base = "torch._grouped_mm"
            except Exception as ex:  # noqa: BLE001
                log(f"  torch._grouped_mm unusable ({type(ex).__name__}: {ex}); per-expert loop baseline")
                use_gmm = False
        if base is None:
            base = "per-expert loop (not graph-capturable; timed eagerly)"
        rbs = [_grouped_baseline(x, w[0], w[1], i, ww, use_gmm) for w, (i, ww) in zip(bf, routs)]
        fns_b = [lambda w=w, r=r: _grouped_forward(x, w[0], w[1], r) for w, r in zip(bf, rbs)]
        if use_gmm:
            t_bf16 = safe(log, "bf16 grouped baseline", lambda: graph_time_us(fns_b, args.rep_ms), float("nan"))
        else:
            import triton.testing as tt
            t_bf16 = tt.do_bench(lambda: [fn() for fn in fns_b], return_mode="median") * 1e3 / copies
        touched = [int(torch.unique(i).numel()) for i, _ in routs]
        results = []
        for gu, dn in moe_configs(moe, t, args.configs):
            xx = torch.randn(t, h, device=DEV, dtype=torch.bfloat16, generator=gen)
            i2, w2r = _routing(t, gen)
            w13c, w2c = stacks_for(layouts, gu, w13q, tiles), stacks_for(layouts, dn, w2q, tiles)
            err = safe(log, f"moe T={t} check", lambda: max(
                rel_err(moe.moe_w4a16(xx, w13c, w2c, i2, w2r, gate_up_config=gu, down_config=dn),
                        moe.moe_w4a16_reference(xx, w13q, w2q, i2, w2r, deq)),
                rel_err(moe.moe_w4a16(x, w13c, w2c, ids, tw, gate_up_config=gu, down_config=dn), ref)),
                float("inf"))
            name = moe_config_name(gu, dn)
            if err > 2e-2:
                results.append(dict(config=name, err=err, us=None))
                log(f"  FAIL moe T={t} {name} rel_err={err:.3e}")
                continue
            ralign = [moe.moe_align(i, e, gu.block_m) for i, _ in routs]
            us = safe(log, f"time moe T={t} {name}", lambda: graph_time_us(
                [lambda w=w, r=r, ww=ww: moe.moe_w4a16(x, stacks_for(layouts, gu, w[0], tiles),
                                                       stacks_for(layouts, dn, w[1], tiles), None, ww[1], routing=r,
                                                       gate_up_config=gu, down_config=dn)
                 for w, r, ww in zip(fp4, ralign, routs)], args.rep_ms))
            results.append(dict(config=name, err=err, us=us))
            log(f"  moe T={t} {name}: {us if us is not None else float('nan'):.1f} us, rel_err {err:.1e}")
        align_us = safe(log, "moe_align timing", lambda: graph_time_us(
            [lambda i=i: moe.moe_align(i, e, 16) for i, _ in routs], args.rep_ms), float("nan"))
        ok = [r for r in results if r["us"] is not None]
        best = min(ok, key=lambda r: r["us"]) if ok else None
        mean_touched = sum(touched) / len(touched)
        row = dict(kind="moe", fmt="nvfp4", T=t, experts=e, hidden=h, ffn=f, top_k=k, copies=copies,
                   baseline=base, bf16_us=t_bf16, fp4_us=best["us"] if best else None, best=best, all=results,
                   align_us=align_us, experts_touched=mean_touched, copy_gbs=copy_bw)
        if best:
            row["speedup"] = t_bf16 / best["us"]
            row["fp4_gbs"] = mean_touched * per_expert_fp4 / (best["us"] * 1e-6) / 1e9
            row["bf16_gbs"] = mean_touched * per_expert_bf16 / (t_bf16 * 1e-6) / 1e9
        rows.append(row)
        log(f"moe T={t}: bf16 {t_bf16:.1f}us  fp4 {best['us'] if best else float('nan'):.1f}us "
            f"({best['config'] if best else '-'}) x{row.get('speedup', float('nan')):.2f} "
            f"align {align_us:.1f}us  experts {mean_touched:.0f}", row)
    return rows


# ----------------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------------
def markdown(env, rows):
    lines = [f"Machine: {env['gpu']} ({env['sms']} SMs, L2 {env['l2_mb']:.0f} MB); torch {env['torch']}, "
             f"triton {env['triton']}, CUDA {env['cuda']}, python {env['python']}. Copy bandwidth (read+write): "
             f"{env['copy_gbs']:.0f} GB/s.", ""]
    lines += ["| kernel | shape | M / tokens | bf16 (us) | FP4 W4A16 (us) | speedup | FP4 weight GB/s "
              "(% of copy) | bf16 weight GB/s | rel. err | config |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] == "dense":
            shape = f"{r['fmt']} K={r['K']} N={r['N']}"
            mt = r["M"]
        else:
            shape = f"MoE nvfp4 E={r['experts']} H={r['hidden']} F={r['ffn']} top{r['top_k']}"
            mt = r["T"]
        b = r.get("best")
        if not b:
            lines.append(f"| {r['kind']} | {shape} | {mt} | {r['bf16_us']:.1f} | FAILED | | | | | |")
            continue
        lines.append(f"| {r['kind']} | {shape} | {mt} | {r['bf16_us']:.1f} | {r['fp4_us']:.1f} | "
                     f"{r['speedup']:.2f}x | {r['fp4_gbs']:.0f} ({100 * r['fp4_gbs'] / r['copy_gbs']:.0f}%) | "
                     f"{r['bf16_gbs']:.0f} | {b['err']:.1e} | {b['config']} |")
    dense = [r for r in rows if r["kind"] == "dense" and r.get("best")]
    if dense:
        lines += ["", "Dense detail: wgmma kernel (best of its configs) vs CUDA-core GEMV, register-fragment "
                  "MMA GEMV and Gluon register-A wgmma (best of their variants) vs the default "
                  "(`heuristic_config`).", "",
                  "| shape | M | bf16 (us) | wgmma (us, config) | GEMV (us, config) | MMA GEMV (us, config) | "
                  "Gluon (us, config) | default (us, config) | default speedup | default GB/s | "
                  "read-only floor (us) | rel. err |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in dense:
            def cell(b):
                return f"{b['us']:.1f} ({b['config']})" if b else "-"
            h = r.get("heuristic")
            sp = f"{r['bf16_us'] / h['us']:.2f}x" if h else "-"
            gbs = f"{r['fp4_weight_bytes'] / (h['us'] * 1e-6) / 1e9:.0f}" if h else "-"
            lines.append(f"| {r['fmt']} K={r['K']} N={r['N']} | {r['M']} | {r['bf16_us']:.1f} | "
                         f"{cell(r.get('best_dot'))} | {cell(r.get('best_gemv'))} | {cell(r.get('best_mma'))} | "
                         f"{cell(r.get('best_gluon'))} | {cell(h)} | {sp} | {gbs} | {r.get('read_us', float('nan')):.1f} | "
                         f"{(h or r['best'])['err']:.1e} |")
    lines += ["", "Read-only floor: a Triton streaming read of the same FP4 byte count (no math), timed the same "
              "way; no kernel that reads those bytes can be faster."]
    return "\n".join(lines)


def profile(args):
    """Run a few kernels between cudaProfilerStart/Stop (for `ncu --profile-from-start off`)."""
    layouts, dense, moe, *_ = _imports()
    cases = []
    for k, n in (DENSE_SHAPES if args.only else DENSE_SHAPES[:1]):   # --only: every dense shape
        w = _random_prepared(layouts, "nvfp4", None, n, k)
        wb = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
        for m in ((128,) if args.only else (1, 128)):
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            cases.append((f"bf16 ({k}, {n}) M={m}", lambda x=x, wb=wb: torch.matmul(x, wb.t())))
            if args.only:   # the configs named by --only, at M = 128
                cfgs = dense_configs(dense, "nvfp4", m, n, k, "all", args.only)
            else:
                cfgs = dense_configs(dense, "nvfp4", m, n, k, "all")
                cfgs = cfgs[:3] + [c for c in cfgs[3:] if c.short() in ("G64x128/s2/sk1/w4", "G256x128/s2/sk2/w16")]
            for cfg in cfgs:
                cases.append((f"fp4 ({k}, {n}) M={m} {cfg.short()}",
                              lambda x=x, w=w, cfg=cfg: dense.w4a16_gemm(x, w, config=cfg)))
    if not args.only:
        e, h, f = MOE["experts"], MOE["hidden"], MOE["ffn"]
        w13 = _random_prepared(layouts, "nvfp4", e, 2 * f, h)
        w2 = _random_prepared(layouts, "nvfp4", e, h, f)
        x = torch.randn(32, h, device=DEV, dtype=torch.bfloat16)
        ids, tw = _routing(32)
        cases.append(("moe T=32", lambda: moe.moe_w4a16(x, w13, w2, ids, tw)))
        # batch 256 (16 rows per expert): the Triton heuristic and the Gluon kernel's default (kernels/moe_gluon.py)
        x256 = torch.randn(256, h, device=DEV, dtype=torch.bfloat16)
        ids256, tw256 = _routing(256)
        cases.append(("moe T=256 triton", lambda: moe.moe_w4a16(x256, w13, w2, ids256, tw256)))
        gu, dn = moe.gluon_moe_config(16, True, True), moe.gluon_moe_config(16, False)
        cases.append(("moe T=256 gluon", lambda: moe.moe_w4a16(x256, w13, w2, ids256, tw256, gate_up_config=gu,
                                                              down_config=dn)))
        gu4, dn4 = moe.gluon_moe_config(16, True, True, warps=4), moe.gluon_moe_config(16, False, warps=4)
        cases.append(("moe T=256 gluon 4 warps", lambda: moe.moe_w4a16(x256, w13, w2, ids256, tw256,
                                                                      gate_up_config=gu4, down_config=dn4)))
    for _, fn in cases:  # compile + warm up outside the profiled range
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for name, fn in cases:
        fn()
        torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    for i, (name, _) in enumerate(cases):
        print(f"profiled case {i}: {name}")


def machine_env(gpu: str, sms: int, l2_mb: float, argv) -> dict:
    """The machine and library facts a benchmark's table and JSON start with."""
    import triton

    return dict(gpu=gpu, sms=sms, l2_mb=l2_mb, torch=torch.__version__, triton=triton.__version__,
                cuda=torch.version.cuda, python=platform.python_version(), date=time.strftime("%Y-%m-%d"),
                argv=list(argv))


def jsonl_logger(path):
    """log(msg, row=None): print msg; append row (if any) to the JSONL file at path, flushed at once."""
    jsonl = open(path, "w")

    def log(msg, row=None):
        print(msg, flush=True)
        if row is not None:
            jsonl.write(json.dumps(row, default=str) + "\n")
            jsonl.flush()
    return log


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--copies", type=int, default=8, help="distinct weight copies per timed graph (>= 8)")
    ap.add_argument("--ms", type=lambda s: [int(v) for v in s.split(",")], default=MS)
    ap.add_argument("--moe-tokens", type=lambda s: [int(v) for v in s.split(",")], default=MS)
    ap.add_argument("--formats", type=lambda s: s.split(","), default=["nvfp4", "mxfp4"])
    ap.add_argument("--configs", choices=["heuristic", "all", "gluon", "blocks", "sync", "layout"], default="heuristic",
                    help="gluon: the MoE heuristic (Triton) config and the Gluon kernel's variants side by side "
                    "(dense shapes: the heuristic config); blocks: the heuristic against 32-row blocks with "
                    "narrow K steps and 128-row weight tiles where the heuristic takes 16-row blocks; sync: the "
                    "heuristic against the kernel before 2026-12-07, against sync_dots (dots that wait for the "
                    "MMAs in flight) switched on gate/up, down, both, against two K steps per loop trip "
                    "(unroll), persistent programs and register caps (more programs per SM); layout: the heuristic "
                    "against tile-major expert stacks (each trip's weight tile one contiguous run) on gate/up, down, "
                    "both")
    ap.add_argument("--only", default="", help="with --configs all: only configs whose names start with these "
                    "comma-separated prefixes (plus the default), e.g. T,V for the two GEMV kernels")
    ap.add_argument("--skip-moe", action="store_true")
    ap.add_argument("--skip-dense", action="store_true")
    ap.add_argument("--workers", type=int, default=12, help="parallel precompile processes (0: none)")
    ap.add_argument("--rep-ms", type=int, default=150)
    ap.add_argument("--cpu-smoke", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true", help="run a few kernels for ncu, no timing")
    args = ap.parse_args()
    if args.profile:
        return profile(args)
    global DENSE_SHAPES, MOE, DEV, L2_BYTES
    if args.cpu_smoke:  # exercise this script's logic on CPU: interpreter, tiny shapes, wall-clock timing
        os.environ["TRITON_INTERPRET"] = "1"
        DEV = "cpu"
        DENSE_SHAPES = [(256, 192)]
        MOE = dict(hidden=128, ffn=64, experts=8, top_k=2)
        args.copies, args.workers, L2_BYTES = 2, 0, 0
    elif not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    if DEV == "cuda":
        props = torch.cuda.get_device_properties(0)
        gpu, sms, l2 = props.name, props.multi_processor_count, getattr(props, "L2_cache_size", 0) / 1e6
        L2_BYTES = max(L2_BYTES, l2 * 1e6)
    else:
        gpu, sms, l2 = "cpu (interpreter smoke test)", 0, 0.0
    env = machine_env(gpu, sms, l2, sys.argv[1:])
    log = jsonl_logger(args.out / "bench_kernels.jsonl")

    t0 = time.time()
    precompile(plan(args), args.workers)
    env["copy_gbs"] = copy_bandwidth_gbs()
    log(f"{env['gpu']}: copy {env['copy_gbs']:.0f} GB/s; torch {env['torch']} triton {env['triton']}")
    rows = []
    if not args.skip_dense:
        rows += bench_dense(args, env["copy_gbs"], log)
    if not args.skip_moe:
        rows += bench_moe(args, env["copy_gbs"], log)
    env["seconds"] = time.time() - t0
    md = markdown(env, rows)
    (args.out / "bench_kernels.md").write_text(md + "\n")
    (args.out / "bench_kernels.json").write_text(json.dumps(dict(env=env, targets=TARGETS, rows=rows),
                                                            indent=1, default=str))
    print(md, flush=True)


if __name__ == "__main__":
    main()
