"""Small-M NVFP4 W4A16 on tensor cores from register fragments: y[M, N] = x[M, K] (bf16) @ dequant(W)[N, K]^T,
M = 1..16, with warp-level `mma.sync.m16n8k16` (fp16 in, fp32 accumulate) issued from inline PTX.

Why: the CUDA-core GEMV (w4a16_gemv.py) spends half an HFMA2 per weight *per token*, so at M = 2..16 its
cost grows with M; the wgmma kernel (w4a16_gemm.py) stages decoded tiles through shared memory and runs
2 CTAs per SM. Here every weight is decoded once, in registers, straight into the A fragment of an m16n8k16
MMA, and one MMA serves 8 tokens: M = 1..8 costs the same, M = 9..16 one more MMA per fragment. On an H200
it is the default at M = 2..8 (w4a16_gemm.heuristic_config): 1.72-1.97x bf16 cuBLAS at the bench shapes,
1.09-1.24x faster than the kernels it replaced there (docs/PERF.md, "Session of 2026-11-30 night").

No second weight copy: the fragments come from the existing kernel layout (`layouts.prepare_nvfp4_weight`).
The MMA sums over its 16 K positions, so the K order inside an MMA is free as long as A and B agree. Lane
(g, t) of a warp (g = lane / 4, t = lane % 4) loads the whole 16-byte group `4 s + t` (32 codes) of rows g
and g + 8 of its 16-row tile in step s (128 K per step and warp). Word q of that group holds the low
elements 4q..4q+3 (scale block 2(4s+t)) and the high elements 16+4q..19+4q (block 2(4s+t)+1); the decode
of `w4a16_gemv` turns it into four fp16x2 registers (code * 2^-14), which are exactly the A registers
{a0a1 | a4a5} of row g (and, from row g + 8, {a2a3 | a6a7}) of two MMAs: one over the low elements, one over
the high ones. The B fragment (token g, the same four K positions) is four contiguous bf16 activations,
converted to fp16 once per step and shared by all row tiles of the warp.

Scales: the four lanes of a quad hold different groups, so one MMA mixes four scale blocks; each A register
is multiplied by its block scale first (one HMUL2 per two weights: fp16 code * 2^-14 times the prepared
s * 2^5 is code * s * 2^-9, exact in fp16). Activations enter as fp16 (exact for bf16 values of magnitude
6.1e-5..65504; |x| must stay below 65504). Products and sums are fp32 inside the MMA; the result is scaled
by s_global and rounded to bf16 once.

Work split: grid (16 * row_tiles-row blocks, split_k); the warps of a CTA take interleaved K steps of the
CTA's split, their fp32 fragments are summed across warps in the CTA (shared memory, once per CTA), and
split-K partials are reduced by the last CTA of each row block in split order (deterministic), as in
w4a16_gemm.

The fragment layout is the thread layout: the kernel assumes the default 1-D blocked layout (element e of
a [32 * num_warps] tensor lives in thread e). Under USE_ASM it checks %tid.x against e and poisons the
output with NaN if that ever changes (the GPU tests would then fail).

Interpreter: under TRITON_INTERPRET=1 (CPU CI) USE_ASM=False computes each lane's fragment outputs (rows g,
g + 8; tokens 2t, 2t + 1) as plain dot products over the same K steps, with the same step assignment,
masking, cross-warp and split-K reductions and stores; the inline PTX (loads, decode, MMA) runs on the GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .layouts import NVFP4_GLOBAL_FOLD, PreparedFP4Weight
from .rounding import _cast_out
from .tiling import split_k_for
from .w4a16_gemv import _load_sw, _load_w, asm_ready_activations, check_dense_nvfp4, split_k_buffers

STEP_K = 128                    # K per warp step: 4 groups of 32, one per lane of a quad
_STEP_K = tl.constexpr(STEP_K)
MAX_M = 16                      # two 8-token MMA column tiles
# acc = sum (code * s * 2^-9) * x = y / s_global * 2^-9; prepared gs = s_global * 2^22
MMA_ACC_FACTOR = 2.0 ** 9 / NVFP4_GLOBAL_FOLD


# ----------------------------------------------------------------------------------------------------
# Inline PTX (GPU only)
# ----------------------------------------------------------------------------------------------------
_DECODE_TO = """
prmt.b32 t0, {w}, 0, 0x1404;
prmt.b32 t1, {w}, 0, 0x3424;
and.b32 {o}0, t0, 0x8E008E00;
and.b32 {o}1, t1, 0x8E008E00;
shr.b32 a, t0, 3;
shl.b32 c, t0, 7;
lop3.b32 {o}2, a, c, 0x8E008E00, 0xA8;
shr.b32 a, t1, 3;
shl.b32 c, t1, 7;
lop3.b32 {o}3, a, c, 0x8E008E00, 0xA8;"""
_MMA = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"


def _fragment_mma_asm(token_tiles: int) -> str:
    """Operands: outputs $0.. (4 fp32 per token tile); inputs: word of row g, word of row g + 8, scales
    (row g low, row g high, row g+8 low, row g+8 high; fp16x2), per token tile the B registers of the low
    MMA (2) and the high MMA (2), then the accumulators (4 per token tile)."""
    n_out = 4 * token_tiles
    w, v = f"${n_out}", f"${n_out + 1}"
    s0lo, s0hi, s1lo, s1hi = (f"${n_out + 2 + i}" for i in range(4))
    b = lambda tt, i: f"${n_out + 6 + 4 * tt + i}"                      # noqa: E731
    c = lambda tt, i: f"${n_out + 6 + 4 * token_tiles + 4 * tt + i}"    # noqa: E731
    o = lambda tt: "{" + ", ".join(f"${4 * tt + i}" for i in range(4)) + "}"   # noqa: E731
    body = ["{", ".reg .b32 t0, t1, a, c, d0, d1, d2, d3, e0, e1, e2, e3;",
            _DECODE_TO.format(w=w, o="d"), _DECODE_TO.format(w=v, o="e"),
            f"mul.rn.f16x2 d0, d0, {s0lo};", f"mul.rn.f16x2 d1, d1, {s0lo};",
            f"mul.rn.f16x2 d2, d2, {s0hi};", f"mul.rn.f16x2 d3, d3, {s0hi};",
            f"mul.rn.f16x2 e0, e0, {s1lo};", f"mul.rn.f16x2 e1, e1, {s1lo};",
            f"mul.rn.f16x2 e2, e2, {s1hi};", f"mul.rn.f16x2 e3, e3, {s1hi};"]
    for tt in range(token_tiles):
        cin = "{" + ", ".join(c(tt, i) for i in range(4)) + "}"
        body.append(f"{_MMA} {o(tt)}, {{d0, e0, d1, e1}}, {{{b(tt, 0)}, {b(tt, 1)}}}, {cin};")
        body.append(f"{_MMA} {o(tt)}, {{d2, e2, d3, e3}}, {{{b(tt, 2)}, {b(tt, 3)}}}, {o(tt)};")
    body.append("}")
    return "\n".join(body)


_FRAG1 = tl.constexpr(_fragment_mma_asm(1))
_FRAG2 = tl.constexpr(_fragment_mma_asm(2))
_FRAG1_CONS = tl.constexpr("=f," * 4 + "r," * 10 + "f,f,f,f")
_FRAG2_CONS = tl.constexpr("=f," * 8 + "r," * 14 + "f," * 7 + "f")
# prepared scale bytes of blocks (2G, 2G + 1) -> fp16x2 (s * 2^5, s * 2^5) of each
_SCALES = tl.constexpr("""{
.reg .b32 t;
shl.b32 t, $2, 7;
and.b32 t, t, 0x7F80;
prmt.b32 $0, t, 0, 0x1010;
shr.b32 t, $2, 1;
and.b32 t, t, 0x7F80;
prmt.b32 $1, t, 0, 0x1010;
}""")
# 32 bf16 activations (64 bytes) -> 16 f16x2 words (pair j = elements 2j, 2j + 1)
_LD_X16 = tl.constexpr(
    "{ .reg .b32 " + ", ".join(f"r{j}" for j in range(16)) + ", l, h;\n"
    + "\n".join(f"ld.global.nc.v4.u32 {{r{4 * i}, r{4 * i + 1}, r{4 * i + 2}, r{4 * i + 3}}}, [$16+{16 * i}];"
                for i in range(4))
    + "".join(f"\nshl.b32 l, r{j}, 16; and.b32 h, r{j}, 0xFFFF0000; cvt.rn.f16x2.f32 ${j}, h, l;"
              for j in range(16)) + "\n}")
_TID = tl.constexpr("mov.u32 $0, %tid.x;")


@triton.jit
def _x_frag(xp):
    """GPU: the 32 activations of a group at xp ([32W] bf16 pointers) as 16 f16x2 words."""
    return tl.inline_asm_elementwise(_LD_X16, "=r," * 16 + "l", [xp], dtype=(tl.int32,) * 16, is_pure=True,
                                     pack=1)


@triton.jit
def _load_tile(w_ptr, s_ptr, ra, rb, grp, stride_wn, stride_sn):
    """GPU: the lane's 16-byte group `grp` of rows ra (A rows g) and rb (g + 8) and their two scale bytes
    each, as 10 int32 (4 + 4 words, 2 scale pairs)."""
    w0, w1, w2, w3 = _load_w(w_ptr + ra * stride_wn + grp * 16, True)
    v0, v1, v2, v3 = _load_w(w_ptr + rb * stride_wn + grp * 16, True)
    return (w0, w1, w2, w3, v0, v1, v2, v3, _load_sw(s_ptr + ra * stride_sn + grp * 2, True),
            _load_sw(s_ptr + rb * stride_sn + grp * 2, True))


@triton.jit
def _mma_tile(tile, valid, x0, x1, a0, a1, a2, a3, a4, a5, a6, a7, TOKEN_TILES: tl.constexpr):
    """GPU: one step of one 16-row tile (`_load_tile`): decode, scale and MMA against the token tiles'
    B fragments x0 (tokens 0-7), x1 (8-15)."""
    sw0 = tl.where(valid, tile[8], 0)          # a masked step: zero scales, no contribution
    sw1 = tl.where(valid, tile[9], 0)
    s0lo, s0hi = tl.inline_asm_elementwise(_SCALES, "=r,=r,r", [sw0], dtype=(tl.int32, tl.int32), is_pure=True,
                                           pack=1)
    s1lo, s1hi = tl.inline_asm_elementwise(_SCALES, "=r,=r,r", [sw1], dtype=(tl.int32, tl.int32), is_pure=True,
                                           pack=1)
    for q in tl.static_range(4):
        if TOKEN_TILES == 1:
            a0, a1, a2, a3 = tl.inline_asm_elementwise(
                _FRAG1, _FRAG1_CONS,
                [tile[q], tile[4 + q], s0lo, s0hi, s1lo, s1hi, x0[2 * q], x0[2 * q + 1], x0[8 + 2 * q],
                 x0[9 + 2 * q], a0, a1, a2, a3], dtype=(tl.float32,) * 4, is_pure=True, pack=1)
        else:
            a0, a1, a2, a3, a4, a5, a6, a7 = tl.inline_asm_elementwise(
                _FRAG2, _FRAG2_CONS,
                [tile[q], tile[4 + q], s0lo, s0hi, s1lo, s1hi, x0[2 * q], x0[2 * q + 1], x0[8 + 2 * q],
                 x0[9 + 2 * q], x1[2 * q], x1[2 * q + 1], x1[8 + 2 * q], x1[9 + 2 * q],
                 a0, a1, a2, a3, a4, a5, a6, a7], dtype=(tl.float32,) * 8, is_pure=True, pack=1)
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _dequant_rows(w_ptr, s_ptr, rows, step, stride_wn, stride_sn):
    """Interpreter: rows [32W] x the step's 128 K positions -> fp32 code * s * 2^-9 ([32W, 128])."""
    kk = tl.arange(0, _STEP_K)[None, :]
    j = kk % 32
    byte = tl.load(w_ptr + rows[:, None] * stride_wn + step[:, None] * (_STEP_K // 2) + (kk // 32) * 16 + j % 16)
    b = byte.to(tl.int32)
    lo = ((b << 8) & 0x8E00).to(tl.int16).to(tl.float16, bitcast=True)
    hi = (((b << 5) & 0x0E00) | ((b << 15) & 0x8000)).to(tl.int16).to(tl.float16, bitcast=True)
    code = tl.where(j < 16, lo, hi).to(tl.float32)                          # code * 2^-14
    sb = tl.load(s_ptr + rows[:, None] * stride_sn + step[:, None] * (_STEP_K // 16) + kk // 16)
    s = (sb.to(tl.int16) << 7).to(tl.float16, bitcast=True).to(tl.float32)  # s * 2^5
    return code * s


@triton.jit
def _x_rows(x_ptr, tokens, step, stride_xm):
    """Interpreter: the step's 128 activations of each lane's token, through fp16 like the GPU path."""
    kk = tl.arange(0, _STEP_K)[None, :]
    x = tl.load(x_ptr + tokens[:, None] * stride_xm + step[:, None] * _STEP_K + kk)
    return x.to(tl.float32).to(tl.float16).to(tl.float32)


@triton.jit
def _row_tile_int(x_ptr, w_ptr, s_ptr, r0, r1, step, valid, g, t, M, stride_wn, stride_sn, stride_xm,
                  a0, a1, a2, a3, a4, a5, a6, a7, TOKEN_TILES: tl.constexpr):
    """Interpreter version of _row_tile_asm: each lane's eight (row, token) outputs as dot products."""
    wa = _dequant_rows(w_ptr, s_ptr, r0, step, stride_wn, stride_sn)
    wb = _dequant_rows(w_ptr, s_ptr, r1, step, stride_wn, stride_sn)
    for tt in tl.static_range(TOKEN_TILES):
        tok0 = tl.minimum(8 * tt + 2 * t, M - 1).to(tl.int64)
        tok1 = tl.minimum(8 * tt + 2 * t + 1, M - 1).to(tl.int64)
        xa = _x_rows(x_ptr, tok0, step, stride_xm)
        xb = _x_rows(x_ptr, tok1, step, stride_xm)
        c0 = tl.where(valid, tl.sum(wa * xa, axis=1), 0.0)
        c1 = tl.where(valid, tl.sum(wa * xb, axis=1), 0.0)
        c2 = tl.where(valid, tl.sum(wb * xa, axis=1), 0.0)
        c3 = tl.where(valid, tl.sum(wb * xb, axis=1), 0.0)
        if tt == 0:
            a0, a1, a2, a3 = a0 + c0, a1 + c1, a2 + c2, a3 + c3
        else:
            a4, a5, a6, a7 = a4 + c0, a5 + c1, a6 + c2, a7 + c3
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _warp_sum(a, WARPS: tl.constexpr):
    """[32W] per-thread values -> [32] sums over the warps (lane j)."""
    if WARPS == 1:
        return a
    return tl.sum(tl.reshape(a, (WARPS, 32)), axis=0)


@triton.jit
def _emit(a, c: tl.constexpr, rt: tl.constexpr, tt: tl.constexpr, row0, pid_k, M, N, scale, y_ptr, ws_ptr,
          stride_ym, WARPS: tl.constexpr, SPLIT_K: tl.constexpr, RNE: tl.constexpr):
    """Write fragment register c (rows g / g + 8, tokens 2t / 2t + 1) of row tile rt, token tile tt."""
    v = _warp_sum(a, WARPS) * scale
    j = tl.arange(0, 32)
    row = row0 + 16 * rt + j // 4 + 8 * (c // 2)
    tok = 8 * tt + 2 * (j % 4) + (c % 2)
    ok = (row < N) & (tok < M)
    if SPLIT_K == 1:
        tl.store(y_ptr + tok.to(tl.int64) * stride_ym + row, _cast_out(v, y_ptr, RNE), mask=ok)
    else:
        tl.store(ws_ptr + (pid_k * M + tok).to(tl.int64) * N + row, v, mask=ok)


@triton.jit
def _emit_tile(a0, a1, a2, a3, a4, a5, a6, a7, rt: tl.constexpr, row0, pid_k, M, N, scale, y_ptr, ws_ptr,
               stride_ym, TOKEN_TILES: tl.constexpr, WARPS: tl.constexpr, SPLIT_K: tl.constexpr,
               RNE: tl.constexpr):
    _emit(a0, 0, rt, 0, row0, pid_k, M, N, scale, y_ptr, ws_ptr, stride_ym, WARPS, SPLIT_K, RNE)
    _emit(a1, 1, rt, 0, row0, pid_k, M, N, scale, y_ptr, ws_ptr, stride_ym, WARPS, SPLIT_K, RNE)
    _emit(a2, 2, rt, 0, row0, pid_k, M, N, scale, y_ptr, ws_ptr, stride_ym, WARPS, SPLIT_K, RNE)
    _emit(a3, 3, rt, 0, row0, pid_k, M, N, scale, y_ptr, ws_ptr, stride_ym, WARPS, SPLIT_K, RNE)
    if TOKEN_TILES == 2:
        _emit(a4, 0, rt, 1, row0, pid_k, M, N, scale, y_ptr, ws_ptr, stride_ym, WARPS, SPLIT_K, RNE)
        _emit(a5, 1, rt, 1, row0, pid_k, M, N, scale, y_ptr, ws_ptr, stride_ym, WARPS, SPLIT_K, RNE)
        _emit(a6, 2, rt, 1, row0, pid_k, M, N, scale, y_ptr, ws_ptr, stride_ym, WARPS, SPLIT_K, RNE)
        _emit(a7, 3, rt, 1, row0, pid_k, M, N, scale, y_ptr, ws_ptr, stride_ym, WARPS, SPLIT_K, RNE)


@triton.jit(do_not_specialize=["M"])
def _w4a16_mma_gemv_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, y_ptr, ws_ptr, cnt_ptr,
                           M, N, K, stride_wn, stride_sn, stride_xm, stride_ym, acc_factor,
                           ROW_TILES: tl.constexpr, TOKEN_TILES: tl.constexpr, SPLIT_K: tl.constexpr,
                           WARPS: tl.constexpr, USE_ASM: tl.constexpr, RNE: tl.constexpr,
                           PREFETCH: tl.constexpr = False):
    """Grid (row blocks of 16 * ROW_TILES, SPLIT_K). Warp w of a CTA runs steps begin + w, begin + w + WARPS,
    ... of the CTA's split; a step is 128 K positions of every row tile for all tokens. PREFETCH (GPU): the
    next step's weight registers are requested before this step's math."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    e = tl.arange(0, 32 * WARPS)
    lane = e % 32
    warp = e // 32
    g = lane // 4
    t = lane % 4
    row0 = pid_n * (16 * ROW_TILES)
    steps = K // _STEP_K
    per_split = tl.cdiv(steps, SPLIT_K)
    s_begin = pid_k * per_split
    s_end = tl.minimum(s_begin + per_split, steps)

    ra = tl.minimum(row0 + g, N - 1).to(tl.int64)          # clamped: loads stay in bounds, stores masked
    rb = tl.minimum(row0 + 8 + g, N - 1).to(tl.int64)
    rc = tl.minimum(row0 + 16 + g, N - 1).to(tl.int64)
    rd = tl.minimum(row0 + 24 + g, N - 1).to(tl.int64)
    tok0 = tl.minimum(g, M - 1).to(tl.int64)                # B fragment columns: token g (and 8 + g)
    tok1 = tl.minimum(8 + g, M - 1).to(tl.int64)

    z = tl.zeros((32 * WARPS,), dtype=tl.float32)
    p0, p1, p2, p3, p4, p5, p6, p7 = z, z, z, z, z, z, z, z           # row tile 0
    q0, q1, q2, q3, q4, q5, q6, q7 = z, z, z, z, z, z, z, z           # row tile 1
    if PREFETCH:   # registers of the warp's first step; each iteration then requests the next one first
        grp_first = tl.minimum(s_begin + warp, steps - 1) * 4 + t
        f0, f1, f2, f3, f4, f5, f6, f7, f8, f9 = _load_tile(w_ptr, s_ptr, ra, rb, grp_first, stride_wn, stride_sn)
        h0, h1, h2, h3, h4, h5, h6, h7, h8, h9 = f0, f1, f2, f3, f4, f5, f6, f7, f8, f9
        if ROW_TILES == 2:
            h0, h1, h2, h3, h4, h5, h6, h7, h8, h9 = _load_tile(w_ptr, s_ptr, rc, rd, grp_first, stride_wn,
                                                                stride_sn)
    for i in range(0, tl.cdiv(per_split, WARPS)):
        step_raw = s_begin + i * WARPS + warp
        valid = step_raw < s_end
        step = tl.minimum(step_raw, steps - 1)               # an idle warp re-reads a valid step, scale 0
        grp = step * 4 + t                                   # the lane's 32-element group
        if USE_ASM:
            if PREFETCH:
                cur_p = (f0, f1, f2, f3, f4, f5, f6, f7, f8, f9)
                cur_q = (h0, h1, h2, h3, h4, h5, h6, h7, h8, h9)
                grp_next = tl.minimum(step_raw + WARPS, steps - 1) * 4 + t
                f0, f1, f2, f3, f4, f5, f6, f7, f8, f9 = _load_tile(w_ptr, s_ptr, ra, rb, grp_next, stride_wn,
                                                                    stride_sn)
                if ROW_TILES == 2:
                    h0, h1, h2, h3, h4, h5, h6, h7, h8, h9 = _load_tile(w_ptr, s_ptr, rc, rd, grp_next,
                                                                        stride_wn, stride_sn)
            else:
                cur_p = _load_tile(w_ptr, s_ptr, ra, rb, grp, stride_wn, stride_sn)
                cur_q = cur_p
                if ROW_TILES == 2:
                    cur_q = _load_tile(w_ptr, s_ptr, rc, rd, grp, stride_wn, stride_sn)
            x0 = _x_frag(x_ptr + tok0 * stride_xm + grp * 32)
            x1 = x0
            if TOKEN_TILES == 2:
                x1 = _x_frag(x_ptr + tok1 * stride_xm + grp * 32)
            p0, p1, p2, p3, p4, p5, p6, p7 = _mma_tile(cur_p, valid, x0, x1, p0, p1, p2, p3, p4, p5, p6, p7,
                                                       TOKEN_TILES)
            if ROW_TILES == 2:
                q0, q1, q2, q3, q4, q5, q6, q7 = _mma_tile(cur_q, valid, x0, x1, q0, q1, q2, q3, q4, q5, q6, q7,
                                                           TOKEN_TILES)
        else:
            p0, p1, p2, p3, p4, p5, p6, p7 = _row_tile_int(
                x_ptr, w_ptr, s_ptr, ra, rb, step.to(tl.int64), valid, g, t, M, stride_wn, stride_sn, stride_xm,
                p0, p1, p2, p3, p4, p5, p6, p7, TOKEN_TILES)
            if ROW_TILES == 2:
                q0, q1, q2, q3, q4, q5, q6, q7 = _row_tile_int(
                    x_ptr, w_ptr, s_ptr, rc, rd, step.to(tl.int64), valid, g, t, M, stride_wn, stride_sn,
                    stride_xm, q0, q1, q2, q3, q4, q5, q6, q7, TOKEN_TILES)

    scale = tl.load(gs_ptr) * acc_factor
    if USE_ASM:
        # the fragment mapping needs element e in thread e (module doc); poison the output otherwise
        tid = tl.inline_asm_elementwise(_TID, "=r,r", [e], dtype=tl.int32, is_pure=True, pack=1)
        moved = tl.max((tid != e).to(tl.int32), axis=0)
        scale = tl.where(moved > 0, float("nan"), scale)
    _emit_tile(p0, p1, p2, p3, p4, p5, p6, p7, 0, row0, pid_k, M, N, scale, y_ptr, ws_ptr, stride_ym,
               TOKEN_TILES, WARPS, SPLIT_K, RNE)
    if ROW_TILES == 2:
        _emit_tile(q0, q1, q2, q3, q4, q5, q6, q7, 1, row0, pid_k, M, N, scale, y_ptr, ws_ptr, stride_ym,
                   TOKEN_TILES, WARPS, SPLIT_K, RNE)

    if SPLIT_K > 1:
        # the last CTA of this row block sums the partials in split order and writes y
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            tok = tl.arange(0, 8 * TOKEN_TILES)[:, None]
            row = row0 + tl.arange(0, 16 * ROW_TILES)[None, :]
            ok = (tok < M) & (row < N)
            off = tok.to(tl.int64) * N + row
            tot = tl.load(ws_ptr + off, mask=ok, other=0.0, cache_modifier=".cg")
            for sk in tl.static_range(1, SPLIT_K):
                tot += tl.load(ws_ptr + sk * M.to(tl.int64) * N + off, mask=ok, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + tok.to(tl.int64) * stride_ym + row, _cast_out(tot, y_ptr, RNE), mask=ok)
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")


# ----------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MmaGemvConfig:
    """row_tiles 16-row MMA tiles per CTA (all its warps share them); num_warps warps take interleaved
    128-wide K steps of the CTA's split; split_k CTAs along K. Tokens: 8 per MMA column tile (M <= 8: one,
    M <= 16: two), derived from M at launch."""
    row_tiles: int = 1
    num_warps: int = 4
    split_k: int = 1
    prefetch: bool = False    # request the next step's weights before this step's math (GPU)
    asm: bool = True          # inline PTX (GPU); ignored under the interpreter

    @property
    def block_k(self) -> int:
        return STEP_K

    def short(self) -> str:
        return f"T{16 * self.row_tiles}/sk{self.split_k}/w{self.num_warps}{'/pf' if self.prefetch else ''}"


def mma_gemv_supported(fmt: str, m: int, k: int) -> bool:
    return fmt == "nvfp4" and 1 <= m <= MAX_M and k % STEP_K == 0


def make_mma_gemv_config(m: int, n: int, k: int, sms: int = 132, row_tiles: int = 1, num_warps: int = 4,
                         per_sm: int = 4, prefetch: bool = False) -> MmaGemvConfig:
    """Split-K: a divisor of the K steps per warp giving about per_sm CTAs per SM."""
    steps = k // STEP_K
    per_warp_steps = steps // num_warps if steps % num_warps == 0 else steps
    split = split_k_for(triton.cdiv(n, 16 * row_tiles), per_warp_steps, sms, cap=32, per_sm=per_sm)
    return MmaGemvConfig(row_tiles, num_warps, split, prefetch)


def default_mma_gemv_config(m: int, n: int, k: int, sms: int = 132) -> MmaGemvConfig:
    """sm_90 default (H200 sweep, docs/PERF.md): one 16-row tile per CTA; 4 warps when the row tiles alone give
    >= 4 CTAs per SM (then they keep ~27 warps per SM busy without split-K), else 8 warps with prefetch
    (K = 7168, N = 4096: 4-6% faster than without); split-K only when the row tiles cannot fill the SMs."""
    if triton.cdiv(n, 16) >= 4 * sms:
        return make_mma_gemv_config(m, n, k, sms, 1, 4, per_sm=6)
    return make_mma_gemv_config(m, n, k, sms, 1, 8, per_sm=2, prefetch=True)


# Variants the autotuner times: (row_tiles, num_warps, CTAs per SM, prefetch)
MMA_GEMV_VARIANTS = [(1, 4, 4, False), (1, 4, 4, True), (1, 8, 2, False), (1, 8, 2, True), (1, 4, 16, False),
                     (1, 4, 16, True), (2, 4, 2, True), (2, 4, 8, True), (1, 2, 8, False), (1, 2, 8, True),
                     (1, 2, 16, True), (1, 8, 4, True)]


def mma_gemv_candidates(m: int, n: int, k: int, sms: int = 132) -> list[MmaGemvConfig]:
    out = [default_mma_gemv_config(m, n, k, sms)]
    for rt, nw, per_sm, pf in MMA_GEMV_VARIANTS:
        c = make_mma_gemv_config(m, n, k, sms, rt, nw, per_sm, pf)
        if c not in out:
            out.append(c)
    return out


def launch_mma_gemv(x2: torch.Tensor, w: PreparedFP4Weight, cfg: MmaGemvConfig, out: torch.Tensor,
                    interpret: bool = False) -> torch.Tensor:
    """Run one config. x2 [M, K] bf16 with unit inner stride; out [M, N] bf16 with unit inner stride."""
    m, k = x2.shape
    n = w.n
    check_dense_nvfp4(w, "MMA GEMV")
    if not 1 <= m <= MAX_M:
        raise ValueError(f"the MMA GEMV kernel takes M = 1..{MAX_M} tokens, got {m}; use the tensor-core GEMM")
    if k % STEP_K:
        raise ValueError(f"K = {k} is not a multiple of {STEP_K}; use the tensor-core GEMM or the CUDA-core GEMV")
    if cfg.row_tiles not in (1, 2) or cfg.num_warps not in (1, 2, 4, 8):
        raise ValueError(f"MMA GEMV config {cfg}: row_tiles must be 1 or 2 and num_warps 1, 2, 4 or 8")
    use_asm = cfg.asm and not interpret
    if use_asm:
        x2 = asm_ready_activations(x2, w, "MMA GEMV", row_aligned_codes=True)
    grid = (triton.cdiv(n, 16 * cfg.row_tiles), cfg.split_k)
    ws, cnt = split_k_buffers(x2, cfg.split_k, n, grid[0], out)
    _w4a16_mma_gemv_kernel[grid](x2, w.qweight, w.scales, w.global_scale, out, ws, cnt,
                                 m, n, k, w.qweight.stride(-2), w.scales.stride(-2), x2.stride(0), out.stride(0),
                                 MMA_ACC_FACTOR, ROW_TILES=cfg.row_tiles, TOKEN_TILES=1 if m <= 8 else 2,
                                 SPLIT_K=cfg.split_k, WARPS=cfg.num_warps, USE_ASM=use_asm, RNE=interpret,
                                 PREFETCH=cfg.prefetch and use_asm, num_warps=cfg.num_warps, num_stages=1)
    return out
