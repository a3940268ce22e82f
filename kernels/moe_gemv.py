"""Grouped-MoE NVFP4 W4A16 on CUDA cores, for decode batches where each routed expert sees 1-2 tokens.

At 8-32 decode tokens with 128 experts top-8, the tensor-core grouped kernel (moe_grouped_gemm.py) pads
each expert's one or two tokens to a 16-token MMA tile and runs at the same issue-latency ceiling as the
dense tensor-core kernel (docs/PERF.md). This is the dense GEMV of w4a16_gemv.py (same decode, same fp16x2
FMAs, same numerics and |x| < 16384 limit) with an expert per program: grid (weight-row tiles, routing
blocks of BLOCK_M <= 2 sorted assignments, from `moe_align`). Programs of one expert's consecutive
blocks run back to back, so an expert's weights come from HBM once and from L2 for its later tokens.

GATED (gate/up): h[sorted row, n] = silu(x_t . Wg[e, n]) * (x_t . Wu[e, n]), t = assignment // TOP_K, the
gate and up rows sharing the decoded activations. Down: y[assignment, n] = topk_w[assignment] * (h[sorted
row] . W2[e, n]). Padding rows of a block (sorted id == n_assign) compute on a clamped in-bounds row and
are never stored.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rounding import _to_bf16
from .w4a16_gemv import (GEMV_ACC_FACTOR, _decode_words, _load_sw, _load_w, _scales_f32, _tile_dot,
                         _tile_int, _x_words)

MAX_BLOCK_M = 2      # tokens per program: at 3+ the per-token work outweighs the shared decode (dense GEMV)


@triton.jit
def _token_step(acc, d, w0, w1, w2, w3, xw, xp, s_lo, s_hi, USE_ASM: tl.constexpr):
    if USE_ASM:
        return _tile_dot(d, xw, s_lo, s_hi, acc)
    return _tile_int(w0, w1, w2, w3, xp, s_lo, s_hi, acc)


@triton.jit
def _rows_step(acc0, acc1, w_ptrs, s_ptrs, xw0, xw1, x0, x1, BLOCK_M: tl.constexpr, USE_ASM: tl.constexpr):
    """One K step of one weight-row tile for the program's (1 or 2) tokens; xw0/xw1: their activations,
    converted once per step (_x_words) and shared by the gate and up rows (GPU), x0/x1 their pointers
    (interpreter)."""
    w0, w1, w2, w3 = _load_w(w_ptrs, USE_ASM)
    s_lo, s_hi = _scales_f32(_load_sw(s_ptrs, USE_ASM))
    if USE_ASM:
        d = _decode_words(w0, w1, w2, w3)
    else:
        d = w0
    acc0 = _token_step(acc0, d, w0, w1, w2, w3, xw0, x0, s_lo, s_hi, USE_ASM)
    if BLOCK_M == 2:
        acc1 = _token_step(acc1, d, w0, w1, w2, w3, xw1, x1, s_lo, s_hi, USE_ASM)
    return acc0, acc1


@triton.jit
def _store_token(vg, vu, m: tl.constexpr, blk, assign, n_assign, offs_n, N, y_ptr, stride_ym, topk_w_ptr,
                 GATED: tl.constexpr, BLOCK_M: tl.constexpr, RNE: tl.constexpr):
    ok = offs_n < tl.where(assign < n_assign, N, 0)
    if GATED:
        out = vg / (1.0 + tl.exp(-vg)) * vu
        row = (blk * BLOCK_M + m).to(tl.int64)
    else:
        out = vg * tl.load(topk_w_ptr + tl.minimum(assign, n_assign - 1)).to(tl.float32)
        row = assign.to(tl.int64)
    tl.store(y_ptr + row * stride_ym + offs_n, _to_bf16(out, RNE), mask=ok)


@triton.jit(do_not_specialize=["n_assign"])
def _moe_gemv_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, y_ptr, sorted_ids_ptr, block_expert_ptr, topk_w_ptr,
                     N, K, n_assign, stride_we, stride_wn, stride_se, stride_sn, stride_xm, stride_ym,
                     acc_factor,
                     TOP_K: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     GROUPS: tl.constexpr, USE_ASM: tl.constexpr, RNE: tl.constexpr, TILE_N: tl.constexpr = 0,
                     TILE_GROUPS: tl.constexpr = 1):
    """Grid (N tiles, routing blocks). Each program: BLOCK_N output columns (weight rows; gate and up rows
    when GATED) of one expert over all of K, for the block's BLOCK_M sorted assignments. TILE_N > 0: tile-major
    stacks (layouts.tile_major_experts) of TILE_N-row tiles, TILE_GROUPS 32-element groups wide (GROUPS a multiple
    of it): a step's groups lie in GROUPS / TILE_GROUPS consecutive K tiles of the row's tile run."""
    pid_n = tl.program_id(0)
    blk = tl.program_id(1)
    expert = tl.load(block_expert_ptr + blk)
    if expert < 0:
        return
    e64 = expert.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)          # clamped: loads in bounds, stores masked
    g = tl.arange(0, GROUPS)
    if TILE_N > 0:
        # row n, group g of step t: K tile t * GROUPS / TILE_GROUPS + g // TILE_GROUPS of row tile n // TILE_N
        k_tiles = K // (32 * TILE_GROUPS)
        row_w = (rows // TILE_N) * (k_tiles * TILE_N * 16 * TILE_GROUPS) + (rows % TILE_N) * (16 * TILE_GROUPS)
        row_s = (rows // TILE_N) * (k_tiles * TILE_N * 2 * TILE_GROUPS) + (rows % TILE_N) * (2 * TILE_GROUPS)
        g_w = (g // TILE_GROUPS) * (TILE_N * 16 * TILE_GROUPS) + (g % TILE_GROUPS) * 16
        g_s = (g // TILE_GROUPS) * (TILE_N * 2 * TILE_GROUPS) + (g % TILE_GROUPS) * 2
        step_w: tl.constexpr = (GROUPS // TILE_GROUPS) * TILE_N * 16 * TILE_GROUPS
        step_s: tl.constexpr = (GROUPS // TILE_GROUPS) * TILE_N * 2 * TILE_GROUPS
        up_w = (N // TILE_N).to(tl.int64) * (k_tiles * TILE_N * 16 * TILE_GROUPS)   # gate row n -> up row N + n
        up_s = (N // TILE_N).to(tl.int64) * (k_tiles * TILE_N * 2 * TILE_GROUPS)
    else:
        row_w = rows * stride_wn
        row_s = rows * stride_sn
        g_w = g * 16
        g_s = g * 2
        step_w: tl.constexpr = 16 * GROUPS
        step_s: tl.constexpr = 2 * GROUPS
        up_w = N.to(tl.int64) * stride_wn                   # gate row n -> up row N + n
        up_s = N.to(tl.int64) * stride_sn
    w_grp = w_ptr + e64 * stride_we + row_w[:, None] + g_w[None, :]
    s_grp = s_ptr + e64 * stride_se + row_s[:, None] + g_s[None, :]

    a0 = tl.load(sorted_ids_ptr + blk * BLOCK_M)
    a1 = a0
    if BLOCK_M == 2:
        a1 = tl.load(sorted_ids_ptr + blk * BLOCK_M + 1)
    if GATED:                                               # x rows: the assignment's token
        r0 = tl.minimum(a0, n_assign - 1) // TOP_K
        r1 = tl.minimum(a1, n_assign - 1) // TOP_K
    else:                                                   # x rows: the block's own sorted rows
        r0 = blk * BLOCK_M                                  # (a padding row reads row r0: h's pads are unset)
        r1 = tl.where(a1 < n_assign, blk * BLOCK_M + (BLOCK_M - 1), r0)
    x0 = x_ptr + r0.to(tl.int64) * stride_xm + (g * 32)[None, :]
    x1 = x_ptr + r1.to(tl.int64) * stride_xm + (g * 32)[None, :]

    acc_g0 = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    acc_g1 = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    acc_u0 = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    acc_u1 = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    for t in range(0, K // (32 * GROUPS)):
        wt = w_grp + t * step_w
        st = s_grp + t * step_s
        xt0 = x0 + t * (32 * GROUPS)
        xt1 = x1 + t * (32 * GROUPS)
        xw0 = xt0
        xw1 = xt1
        if USE_ASM:
            xw0 = _x_words(xt0)
            if BLOCK_M == 2:
                xw1 = _x_words(xt1)
        acc_g0, acc_g1 = _rows_step(acc_g0, acc_g1, wt, st, xw0, xw1, xt0, xt1, BLOCK_M, USE_ASM)
        if GATED:
            acc_u0, acc_u1 = _rows_step(acc_u0, acc_u1, wt + up_w, st + up_s, xw0, xw1, xt0, xt1, BLOCK_M,
                                        USE_ASM)

    scale = tl.load(gs_ptr + expert) * acc_factor
    _store_token(tl.sum(acc_g0, axis=1) * scale, tl.sum(acc_u0, axis=1) * scale, 0, blk, a0, n_assign, offs_n,
                 N, y_ptr, stride_ym, topk_w_ptr, GATED, BLOCK_M, RNE)
    if BLOCK_M == 2:
        _store_token(tl.sum(acc_g1, axis=1) * scale, tl.sum(acc_u1, axis=1) * scale, 1, blk, a1, n_assign,
                     offs_n, N, y_ptr, stride_ym, topk_w_ptr, GATED, BLOCK_M, RNE)


def launch_moe_gemv(x, w, y, routing, topk_w, gated: bool, block_n: int, groups: int, num_warps: int,
                    interpret: bool, asm: bool = True):
    """x: bf16 activations [T, K] (gated) or the sorted intermediate rows; y: bf16. Checks the layout the
    16-byte loads need (the caller picked this path for an NVFP4 expert stack)."""
    n = w.n // 2 if gated else w.n
    k = w.k
    if w.fmt != "nvfp4" or w.num_experts is None:
        raise ValueError("the MoE GEMV takes an NVFP4 expert stack (use the tensor-core kernel for MXFP4)")
    if not 1 <= routing.block_m <= MAX_BLOCK_M:
        raise ValueError(f"MoE GEMV block_m {routing.block_m} not in 1..{MAX_BLOCK_M}")
    if (k // 32) % groups or k % 32:
        raise ValueError(f"K = {k}: K/32 is not a multiple of groups={groups}")
    tile_n, tile_groups = (w.tile[0], w.tile[1] // 32) if w.tile is not None else (0, 1)
    if tile_n and (groups % tile_groups or n % tile_n):
        raise ValueError(f"MoE GEMV over tile-major stacks of {w.tile} tiles: groups={groups} must be a multiple of "
                         f"the tile's {tile_groups} groups and the {n} rows whole tiles")
    use_asm = asm and not interpret
    if use_asm:
        if w.qweight.data_ptr() % 16 or w.qweight.stride(1) % 16 or w.scales.stride(1) % 2:
            raise ValueError("MoE GEMV: expert rows must be 16-byte aligned, scale rows 2-byte aligned")
        if x.data_ptr() % 16 or x.stride(0) % 8:
            x = x.clone(memory_format=torch.contiguous_format)   # 16-byte activation loads
    grid = (triton.cdiv(n, block_n), routing.num_blocks)
    _moe_gemv_kernel[grid](
        x, w.qweight, w.scales, w.global_scale, y, routing.sorted_ids, routing.block_expert,
        topk_w if topk_w is not None else w.global_scale,
        n, k, routing.n_assign, w.qweight.stride(0), w.qweight.stride(1), w.scales.stride(0), w.scales.stride(1),
        x.stride(0), y.stride(0), GEMV_ACC_FACTOR,
        TOP_K=routing.top_k, GATED=gated, BLOCK_M=routing.block_m, BLOCK_N=block_n, GROUPS=groups,
        USE_ASM=use_asm, RNE=interpret, TILE_N=tile_n, TILE_GROUPS=tile_groups, num_warps=num_warps, num_stages=1)
    return y
