"""Small-M NVFP4 W4A16 GEMV on CUDA cores: y[M, N] = x[M, K] (bf16) @ dequant(W)[N, K]^T, M = 1..16.

The tensor-core kernel (w4a16_gemm.py) is issue-latency bound at decode sizes (docs/PERF.md): 249
registers, 2 CTAs per SM, wgmma fences. This kernel uses no tl.dot: many small CTAs (128 threads, 66
registers at M = 1 in a Triton 3.9 sm_90 build, 7 CTAs per SM), 16-byte weight loads straight into
registers, and per weight ~1.25 integer instructions of decode plus half an fp16x2 FMA per token (2.9 SASS
instructions per weight in the M = 1 loop in all, ~6.7 at M = 4). On an H200 it is the default at M = 1
(w4a16_gemm._GEMV_TABLE): 1.3-1.45x faster than the wgmma kernel and 1.07-1.14x faster than the
register-fragment MMA GEMV (w4a16_mma_gemv.py), which takes M = 2..8 because this kernel's per-token work
grows with M.

Layout: the one `layouts.prepare_nvfp4_weight` builds (no second copy). A 16-byte group holds 32 codes;
its 32-bit word q (bytes 4q..4q+3) holds the low elements 4q..4q+3 (scale block 2g) and the high elements
16+4q..16+4q+3 (block 2g+1). One PRMT puts two bytes in the upper bytes of the two halves of a register,
so the fp16 bits of code * 2^-14 for the pair (4q, 4q+1) are one AND and for (16+4q, 17+4q) SHR, SHL,
LOP3 (the nibble s|e1|e0|m becomes (s << 15) | (e1e0m << 9)): 10 instructions per 8 weights. The pairs
are adjacent in K, so the matching activations are plain bf16x2 words of x, converted once per CTA tile
to f16x2 (x * 2^X_EXP) and reused by all the weight rows a thread holds.

Arithmetic: per weight row, 16-element scale block and token, 8 HFMA2 (fp16 multiply-accumulate of
code * 2^-14 * x * 2^X_EXP, two K positions per instruction), the two lanes added in fp16, then converted
to fp32, multiplied by the block scale (s * 2^5, exact) and accumulated in fp32. fp16 ranges: |x| must stay
below 65504 / 2^X_EXP (16384); the fp16 partial sums hold at most 16 * 6 * |x|max * 2^(X_EXP-14) (<= 384),
so they cannot overflow; small activations lose relative precision only when the 16-element partial
sums fall into fp16 subnormals (|x| below ~2^-X_EXP / 10). The output is scaled by s_global in fp32 and
rounded to bf16 once. Measured rel. error vs the fp32 dequantize-then-matmul reference on randn inputs:
1.7e-3 (the bf16 output rounding dominates), as for the tensor-core kernel.

Split-K over CTAs (grid: N tiles x K splits x M chunks of <= 8 tokens); the fp32 partials are reduced
by the last CTA of each output tile in split order (deterministic), as in w4a16_gemm.

Interpreter: under TRITON_INTERPRET=1 (CPU CI) USE_ASM=False runs the same algorithm with plain Triton
integer and fp16 ops (loads through tl.load, the decode as shifts and masks, products in fp16); the inline
PTX runs only on the GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .layouts import NVFP4_GLOBAL_FOLD, PreparedFP4Weight
from .rounding import _cast_out
from .tiling import split_k_for

X_EXP = 2                      # activations enter the fp16 FMA as x * 2^X_EXP
# acc = sum_b (s_b * 2^5) * sum (code * 2^-14)(x * 2^X_EXP) = y / s_global * 2^(X_EXP - 9); gs = s_global * 2^22
GEMV_ACC_FACTOR = 2.0 ** (9 - X_EXP) / NVFP4_GLOBAL_FOLD
MAX_BLOCK_M = 8                # tokens per CTA (one named fp32 accumulator each)


# ----------------------------------------------------------------------------------------------------
# Inline PTX (GPU only)
# ----------------------------------------------------------------------------------------------------
# 16 weight bytes (one 32-code group) -> 4 words; streamed once, so no L1 allocation.
_LD_W = tl.constexpr("ld.global.nc.L1::no_allocate.v4.u32 {$0, $1, $2, $3}, [$4];")
# the group's two prepared scale bytes (blocks 2g, 2g+1) as one 16-bit load
_LD_S = tl.constexpr("{ .reg .b16 h; ld.global.nc.u16 h, [$1]; cvt.u32.u16 $0, h; }")
# 32 bf16 activations (64 bytes) -> 16 f16x2 words of x * 2^X_EXP (pair j = elements 2j, 2j+1)
_X_CVT = "".join(f"""
shl.b32 l, r{j}, 16; and.b32 h, r{j}, 0xFFFF0000;
cvt.rn.f16x2.f32 h, h, l; mul.rn.f16x2 ${j}, h, s;""" for j in range(16))

_LD_X = tl.constexpr(
    "{ .reg .b32 " + ", ".join(f"r{j}" for j in range(16)) + ", l, h, s;\n"
    f"mov.b32 s, {(15 + X_EXP) * 0x04000400};\n"
    + "\n".join(f"ld.global.nc.v4.u32 {{r{4 * i}, r{4 * i + 1}, r{4 * i + 2}, r{4 * i + 3}}}, [$16+{16 * i}];"
                for i in range(4))
    + _X_CVT + "\n}")
# one weight word -> fp16x2 of code * 2^-14 for the pairs (4q, 4q+1), (4q+2, 4q+3) [low elements] and
# (16+4q, 17+4q), (18+4q, 19+4q) [high elements]
_DECODE = tl.constexpr("""{
.reg .b32 t0, t1, a, c;
prmt.b32 t0, $4, 0, 0x1404;
prmt.b32 t1, $4, 0, 0x3424;
and.b32 $0, t0, 0x8E008E00;
and.b32 $1, t1, 0x8E008E00;
shr.b32 a, t0, 3;
shl.b32 c, t0, 7;
lop3.b32 $2, a, c, 0x8E008E00, 0xA8;
shr.b32 a, t1, 3;
shl.b32 c, t1, 7;
lop3.b32 $3, a, c, 0x8E008E00, 0xA8;
}""")
# 8 fp16x2 weights . 8 fp16x2 activations -> one fp16x2 partial sum (8 HFMA2, one 16-element block)
_HDOT8 = tl.constexpr("""{
mul.rn.f16x2 $0, $1, $9;
fma.rn.f16x2 $0, $2, $10, $0;
fma.rn.f16x2 $0, $3, $11, $0;
fma.rn.f16x2 $0, $4, $12, $0;
fma.rn.f16x2 $0, $5, $13, $0;
fma.rn.f16x2 $0, $6, $14, $0;
fma.rn.f16x2 $0, $7, $15, $0;
fma.rn.f16x2 $0, $8, $16, $0;
}""")
# acc += s_lo * (lo.x + lo.y) + s_hi * (hi.x + hi.y): the two lanes added in fp16, then fp32
_ACC = tl.constexpr("""{
.reg .f16 a, b, c, d;
.reg .f32 fa, fc;
mov.b32 {a, b}, $1;
mov.b32 {c, d}, $2;
add.rn.f16 a, a, b;
add.rn.f16 c, c, d;
cvt.f32.f16 fa, a;
cvt.f32.f16 fc, c;
fma.rn.f32 fa, fa, $3, $5;
fma.rn.f32 $0, fc, $4, fa;
}""")


@triton.jit
def _load_w(wp, USE_ASM: tl.constexpr):
    """wp: byte pointers [BN, G] to 16-byte groups -> the group's 4 little-endian 32-bit words."""
    if USE_ASM:
        w0, w1, w2, w3 = tl.inline_asm_elementwise(_LD_W, "=r,=r,=r,=r,l", [wp],
                                                   dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                                                   is_pure=True, pack=1)
    else:
        b = wp.to(tl.pointer_type(tl.int32))
        w0 = tl.load(b)
        w1 = tl.load(b + 1)
        w2 = tl.load(b + 2)
        w3 = tl.load(b + 3)
    return w0, w1, w2, w3


@triton.jit
def _load_sw(sp, USE_ASM: tl.constexpr):
    """sp: byte pointers [BN, G] to the group's two prepared NVFP4 scale bytes -> int32 (byte 2g | 2g+1 << 8)."""
    if USE_ASM:
        sw = tl.inline_asm_elementwise(_LD_S, "=r,l", [sp], dtype=tl.int32, is_pure=True, pack=1)
    else:
        sw = tl.load(sp).to(tl.int32) | (tl.load(sp + 1).to(tl.int32) << 8)
    return sw


@triton.jit
def _scales_f32(sw):
    """Two prepared scale bytes -> fp32 s * 2^5 of blocks 2g (low elements) and 2g+1 (high), exactly."""
    s_lo = ((sw & 0xFF) << 7).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    s_hi = ((sw >> 8) << 7).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return s_lo, s_hi


@triton.jit
def _dec_int(w, byte: tl.constexpr):
    """Plain-integer decode (interpreter): byte `byte` of w -> (low, high) float16 code * 2^-14."""
    b = (w >> (8 * byte)) & 0xFF
    lo = ((b << 8) & 0x8E00).to(tl.int16).to(tl.float16, bitcast=True)
    hi = (((b << 5) & 0x0E00) | ((b << 15) & 0x8000)).to(tl.int16).to(tl.float16, bitcast=True)
    return lo, hi


@triton.jit
def _x_int(xp, j: tl.constexpr):
    """Interpreter: activations 2j, 2j+1 of the group at xp (bf16 pointers [1, G]) as float16 * 2^X_EXP."""
    a = (tl.load(xp + 2 * j).to(tl.float32) * 4.0).to(tl.float16)
    b = (tl.load(xp + 2 * j + 1).to(tl.float32) * 4.0).to(tl.float16)
    return a, b


@triton.jit
def _tile_int(w0, w1, w2, w3, xp, s_lo, s_hi, acc):
    """Interpreter version of one (group, token) step: same pairing and block structure as the PTX, with
    separate fp16 lanes (products rounded to fp16, then added in fp16)."""
    lo_a = tl.zeros(w0.shape, tl.float16)
    lo_b = tl.zeros(w0.shape, tl.float16)
    hi_a = tl.zeros(w0.shape, tl.float16)
    hi_b = tl.zeros(w0.shape, tl.float16)
    for q in tl.static_range(4):
        if q == 0:
            w = w0
        elif q == 1:
            w = w1
        elif q == 2:
            w = w2
        else:
            w = w3
        for p in tl.static_range(2):                       # pair (4q+2p, 4q+2p+1) and its high twin
            la, ha = _dec_int(w, 2 * p)
            lb, hb = _dec_int(w, 2 * p + 1)
            xa, xb = _x_int(xp, 2 * q + p)                   # x pair 2q+p: elements 4q+2p, 4q+2p+1
            ya, yb = _x_int(xp, 8 + 2 * q + p)               # elements 16+4q+2p, 17+4q+2p
            lo_a = (la * xa + lo_a).to(tl.float16)
            lo_b = (lb * xb + lo_b).to(tl.float16)
            hi_a = (ha * ya + hi_a).to(tl.float16)
            hi_b = (hb * yb + hi_b).to(tl.float16)
    lo = (lo_a + lo_b).to(tl.float16).to(tl.float32)
    hi = (hi_a + hi_b).to(tl.float16).to(tl.float32)
    return acc + lo * s_lo + hi * s_hi


@triton.jit
def _tile_asm(d, xp, s_lo, s_hi, acc):
    """GPU: one (group, token) step. d: the 16 decoded fp16x2 words of the rows' groups (4 per weight
    word: low pair, low pair, high pair, high pair); xp: byte pointers [1, G] to the token's 32 activations."""
    return _tile_dot(d, _x_words(xp), s_lo, s_hi, acc)


@triton.jit
def _x_words(xp):
    """GPU: the token's 32 activations at xp ([1, G] pointers) as 16 f16x2 words of x * 2^X_EXP."""
    return tl.inline_asm_elementwise(_LD_X, "=r," * 16 + "l", [xp], dtype=(tl.int32,) * 16, is_pure=True, pack=1)


@triton.jit
def _tile_dot(d, x, s_lo, s_hi, acc):
    """GPU: acc += the block-scaled dot of decoded weights d with converted activations x (_x_words)."""
    # low elements of word q: pairs 2q, 2q+1; high elements: pairs 8+2q, 9+2q
    lo = tl.inline_asm_elementwise(
        _HDOT8, "=r" + ",r" * 16,
        [d[0], d[1], d[4], d[5], d[8], d[9], d[12], d[13], x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7]],
        dtype=tl.int32, is_pure=True, pack=1)
    hi = tl.inline_asm_elementwise(
        _HDOT8, "=r" + ",r" * 16,
        [d[2], d[3], d[6], d[7], d[10], d[11], d[14], d[15], x[8], x[9], x[10], x[11], x[12], x[13], x[14],
         x[15]],
        dtype=tl.int32, is_pure=True, pack=1)
    return tl.inline_asm_elementwise(_ACC, "=f,r,r,f,f,f", [lo, hi, s_lo, s_hi, acc], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def _decode_words(w0, w1, w2, w3):
    d0 = tl.inline_asm_elementwise(_DECODE, "=r,=r,=r,=r,r", [w0], dtype=(tl.int32,) * 4, is_pure=True, pack=1)
    d1 = tl.inline_asm_elementwise(_DECODE, "=r,=r,=r,=r,r", [w1], dtype=(tl.int32,) * 4, is_pure=True, pack=1)
    d2 = tl.inline_asm_elementwise(_DECODE, "=r,=r,=r,=r,r", [w2], dtype=(tl.int32,) * 4, is_pure=True, pack=1)
    d3 = tl.inline_asm_elementwise(_DECODE, "=r,=r,=r,=r,r", [w3], dtype=(tl.int32,) * 4, is_pure=True, pack=1)
    return (d0[0], d0[1], d0[2], d0[3], d1[0], d1[1], d1[2], d1[3],
            d2[0], d2[1], d2[2], d2[3], d3[0], d3[1], d3[2], d3[3])


@triton.jit
def _step(acc, m: tl.constexpr, d, w0, w1, w2, w3, x_grp, stride_xm, m0, M, s_lo, s_hi,
          BLOCK_M: tl.constexpr, USE_ASM: tl.constexpr):
    """acc (token m of this CTA's chunk) += this tile's contribution; rows past M read row M-1."""
    if m < BLOCK_M:
        row = tl.minimum(m0 + m, M - 1).to(tl.int64)
        xp = x_grp + row * stride_xm
        if USE_ASM:
            acc = _tile_asm(d, xp, s_lo, s_hi, acc)
        else:
            acc = _tile_int(w0, w1, w2, w3, xp, s_lo, s_hi, acc)
    return acc


@triton.jit
def _finish(acc, m: tl.constexpr, offs_n, m0, M, N, scale, y_ptr, stride_ym, ws_ptr, pid_k,
            BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr, RNE: tl.constexpr):
    if m < BLOCK_M:
        v = tl.sum(acc, axis=1) * scale
        row = m0 + m
        ok = offs_n < tl.where(row < M, N, 0)
        if SPLIT_K == 1:
            tl.store(y_ptr + row.to(tl.int64) * stride_ym + offs_n, _cast_out(v, y_ptr, RNE), mask=ok)
        else:
            tl.store(ws_ptr + (pid_k * M + row).to(tl.int64) * N + offs_n, v, mask=ok)


@triton.jit(do_not_specialize=["M"])
def _w4a16_gemv_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, y_ptr, ws_ptr, cnt_ptr,
                       M, N, K, stride_wn, stride_sn, stride_xm, stride_ym, acc_factor,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
                       SPLIT_K: tl.constexpr, USE_ASM: tl.constexpr, RNE: tl.constexpr,
                       PREFETCH: tl.constexpr = False):
    """Grid (N tiles, SPLIT_K, M chunks). Each program: BLOCK_N weight rows x GROUPS 32-element groups per
    K step, for BLOCK_M (<= 8) tokens, over its split's K steps."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)           # clamped: loads stay in bounds, stores masked
    g = tl.arange(0, GROUPS)
    k_steps = K // (32 * GROUPS)                              # the host guarantees divisibility
    per_split = tl.cdiv(k_steps, SPLIT_K)
    t_begin = pid_k * per_split
    t_end = tl.minimum(t_begin + per_split, k_steps)

    w_grp = w_ptr + rows[:, None] * stride_wn + (g * 16)[None, :]      # [BN, G] byte pointers
    s_grp = s_ptr + rows[:, None] * stride_sn + (g * 2)[None, :]
    x_grp = x_ptr + (g * 32)[None, :]                                   # [1, G] bf16 pointers

    acc0 = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    acc4 = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    acc5 = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    acc6 = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    acc7 = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    # PREFETCH: the next K step's weights and scales are requested (into registers) before this step's math
    # (a split with an empty range still loads one in-bounds step, unused, and writes zero partials)
    t_last = tl.minimum(tl.maximum(t_end - 1, t_begin), k_steps - 1)
    t_first = tl.minimum(t_begin, k_steps - 1)
    nw0, nw1, nw2, nw3 = _load_w(w_grp + t_first * (16 * GROUPS), USE_ASM)
    nsw = _load_sw(s_grp + t_first * (2 * GROUPS), USE_ASM)
    for t in range(t_begin, t_end):
        if PREFETCH:
            w0, w1, w2, w3 = nw0, nw1, nw2, nw3
            sw = nsw
            t_next = tl.minimum(t + 1, t_last)
            nw0, nw1, nw2, nw3 = _load_w(w_grp + t_next * (16 * GROUPS), USE_ASM)
            nsw = _load_sw(s_grp + t_next * (2 * GROUPS), USE_ASM)
        else:
            w0, w1, w2, w3 = _load_w(w_grp + t * (16 * GROUPS), USE_ASM)
            sw = _load_sw(s_grp + t * (2 * GROUPS), USE_ASM)
        s_lo, s_hi = _scales_f32(sw)
        if USE_ASM:
            d = _decode_words(w0, w1, w2, w3)
        else:
            d = w0
        xg = x_grp + t * (32 * GROUPS)
        acc0 = _step(acc0, 0, d, w0, w1, w2, w3, xg, stride_xm, m0, M, s_lo, s_hi, BLOCK_M, USE_ASM)
        acc1 = _step(acc1, 1, d, w0, w1, w2, w3, xg, stride_xm, m0, M, s_lo, s_hi, BLOCK_M, USE_ASM)
        acc2 = _step(acc2, 2, d, w0, w1, w2, w3, xg, stride_xm, m0, M, s_lo, s_hi, BLOCK_M, USE_ASM)
        acc3 = _step(acc3, 3, d, w0, w1, w2, w3, xg, stride_xm, m0, M, s_lo, s_hi, BLOCK_M, USE_ASM)
        acc4 = _step(acc4, 4, d, w0, w1, w2, w3, xg, stride_xm, m0, M, s_lo, s_hi, BLOCK_M, USE_ASM)
        acc5 = _step(acc5, 5, d, w0, w1, w2, w3, xg, stride_xm, m0, M, s_lo, s_hi, BLOCK_M, USE_ASM)
        acc6 = _step(acc6, 6, d, w0, w1, w2, w3, xg, stride_xm, m0, M, s_lo, s_hi, BLOCK_M, USE_ASM)
        acc7 = _step(acc7, 7, d, w0, w1, w2, w3, xg, stride_xm, m0, M, s_lo, s_hi, BLOCK_M, USE_ASM)

    scale = tl.load(gs_ptr) * acc_factor
    _finish(acc0, 0, offs_n, m0, M, N, scale, y_ptr, stride_ym, ws_ptr, pid_k, BLOCK_M, SPLIT_K, RNE)
    _finish(acc1, 1, offs_n, m0, M, N, scale, y_ptr, stride_ym, ws_ptr, pid_k, BLOCK_M, SPLIT_K, RNE)
    _finish(acc2, 2, offs_n, m0, M, N, scale, y_ptr, stride_ym, ws_ptr, pid_k, BLOCK_M, SPLIT_K, RNE)
    _finish(acc3, 3, offs_n, m0, M, N, scale, y_ptr, stride_ym, ws_ptr, pid_k, BLOCK_M, SPLIT_K, RNE)
    _finish(acc4, 4, offs_n, m0, M, N, scale, y_ptr, stride_ym, ws_ptr, pid_k, BLOCK_M, SPLIT_K, RNE)
    _finish(acc5, 5, offs_n, m0, M, N, scale, y_ptr, stride_ym, ws_ptr, pid_k, BLOCK_M, SPLIT_K, RNE)
    _finish(acc6, 6, offs_n, m0, M, N, scale, y_ptr, stride_ym, ws_ptr, pid_k, BLOCK_M, SPLIT_K, RNE)
    _finish(acc7, 7, offs_n, m0, M, N, scale, y_ptr, stride_ym, ws_ptr, pid_k, BLOCK_M, SPLIT_K, RNE)

    if SPLIT_K > 1:
        # last CTA of this (N tile, M chunk) sums the partials in split order and writes y
        tl.debug_barrier()
        tile = tl.program_id(2) * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            for m in tl.static_range(BLOCK_M):
                row = m0 + m
                ok = offs_n < tl.where(row < M, N, 0)
                off = row.to(tl.int64) * N + offs_n
                tot = tl.load(ws_ptr + off, mask=ok, other=0.0, cache_modifier=".cg")
                for sk in tl.static_range(1, SPLIT_K):
                    tot += tl.load(ws_ptr + sk * M.to(tl.int64) * N + off, mask=ok, other=0.0,
                                   cache_modifier=".cg")
                tl.store(y_ptr + row.to(tl.int64) * stride_ym + offs_n, _cast_out(tot, y_ptr, RNE), mask=ok)
            tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")


# ----------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GemvConfig:
    """block_n weight rows x groups 32-element groups per K step (block_n / (4 * num_warps) rows per thread
    at groups=8); split_k CTAs along K; block_m (<= 8) tokens per CTA, M chunks of block_m on grid axis 2;
    prefetch: the next step's weights are loaded into registers before this step's math."""
    block_n: int = 64
    groups: int = 8
    split_k: int = 1
    num_warps: int = 4
    block_m: int = 1
    prefetch: bool = False
    asm: bool = True          # inline PTX (GPU); ignored under the interpreter

    @property
    def block_k(self) -> int:
        """K per step (callers check K % block_k == 0, as for GemmConfig)."""
        return 32 * self.groups

    def short(self) -> str:
        return (f"V{self.block_m}x{self.block_n}x{32 * self.groups}/sk{self.split_k}/w{self.num_warps}"
                f"{'/pf' if self.prefetch else ''}")


def gemv_supported(fmt: str, m: int, k: int) -> bool:
    return fmt == "nvfp4" and 1 <= m <= 2 * MAX_BLOCK_M and k % 32 == 0


def gemv_bucket(m: int) -> int:
    """Small-M buckets: 1, 2, 4, 8, 16."""
    for b in (1, 2, 4, 8):
        if m <= b:
            return b
    return 16


def _largest_groups(k: int, cap: int) -> int:
    g = cap
    while g > 1 and (k // 32) % g:
        g //= 2
    return g


def gemv_split(n: int, k: int, block_n: int, groups: int, m_chunks: int, sms: int, per_sm: int,
               cap: int = 32) -> int:
    """Split-K: a divisor of the K steps giving about per_sm CTAs per SM (never fewer CTAs than SMs)."""
    return split_k_for(triton.cdiv(n, block_n) * m_chunks, k // (32 * groups), sms, cap=cap, per_sm=per_sm)


def make_gemv_config(m: int, n: int, k: int, sms: int = 132, block_n: int = 64, groups: int = 8,
                     per_sm: int = 8, num_warps: int = 4, prefetch: bool = False) -> GemvConfig:
    bm = min(m, MAX_BLOCK_M)
    groups = _largest_groups(k, groups)
    split = gemv_split(n, k, block_n, groups, triton.cdiv(m, bm), sms, per_sm)
    return GemvConfig(block_n, groups, split, num_warps, bm, prefetch)


# GEMV variants the autotuner times per small-M bucket: (block_n, groups, CTAs per SM, prefetch). The first
# of bucket 1 is the default (w4a16_gemm._GEMV_TABLE); at M >= 2 other kernels were faster in every
# measurement (docs/PERF.md), so buckets 2-8 keep a few variants and bucket 16 none.
GEMV_VARIANTS = {
    1: [(64, 8, 8, False), (128, 8, 8, False), (32, 8, 16, False), (64, 8, 8, True)],
    2: [(64, 8, 8, True), (64, 8, 8, False), (128, 8, 8, False)],
    4: [(64, 8, 8, False)],
    8: [(64, 8, 4, False)],
    16: [],
}


def gemv_candidates(m: int, n: int, k: int, sms: int = 132) -> list[GemvConfig]:
    return [make_gemv_config(m, n, k, sms, bn, g, per_sm, prefetch=pf)
            for bn, g, per_sm, pf in GEMV_VARIANTS[gemv_bucket(m)]]


_COUNTERS: dict = {}


def _counters(device, tiles: int) -> torch.Tensor:
    """Zeroed int32 arrival counters for the split-K reduction (each last CTA resets its own)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < tiles:
        buf = torch.zeros(max(tiles, 1 << 14), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def check_dense_nvfp4(w: PreparedFP4Weight, kernel: str) -> None:
    """The GEMV kernels (this one, w4a16_mma_gemv) multiply by one dense NVFP4 weight."""
    if w.fmt != "nvfp4" or w.num_experts is not None:
        raise ValueError(f"the {kernel} kernel takes one dense NVFP4 weight")


def asm_ready_activations(x2: torch.Tensor, w: PreparedFP4Weight, kernel: str, row_aligned_codes: bool = False):
    """The inline-PTX path's 16-byte loads: refuse misaligned weight codes / scale rows (row_aligned_codes: each
    code row too); a misaligned activation is copied instead."""
    codes_misaligned = w.qweight.data_ptr() % 16 or (row_aligned_codes and w.qweight.stride(-2) % 16)
    if codes_misaligned or w.scales.data_ptr() % 2 or w.scales.stride(-2) % 2:
        rows = " rows" if row_aligned_codes else ""
        raise ValueError(f"{kernel}: qweight{rows} must be 16-byte aligned and scale rows 2-byte aligned")
    if x2.data_ptr() % 16 or x2.stride(0) % 8:
        x2 = x2.clone(memory_format=torch.contiguous_format)   # 16-byte activation loads
    return x2


def split_k_buffers(x2: torch.Tensor, split_k: int, n: int, tiles: int, out: torch.Tensor):
    """(fp32 partial sums [split_k, M, N], arrival counters) of a split-K launch; without split-K the kernel
    takes `out` for both (unused)."""
    if split_k == 1:
        return out, out
    return (torch.empty((split_k, x2.shape[0], n), device=x2.device, dtype=torch.float32),
            _counters(x2.device, tiles))


def launch_gemv(x2: torch.Tensor, w: PreparedFP4Weight, cfg: GemvConfig, out: torch.Tensor,
                interpret: bool = False) -> torch.Tensor:
    """Run one config (few checks). x2 [M, K] bf16 with unit inner stride; out [M, N] bf16, unit inner stride."""
    m, k = x2.shape
    n = w.n
    check_dense_nvfp4(w, "GEMV")
    if not 1 <= cfg.block_m <= MAX_BLOCK_M:
        raise ValueError(f"GEMV block_m {cfg.block_m} not in 1..{MAX_BLOCK_M}")
    if (k // 32) % cfg.groups or k % 32:
        raise ValueError(f"K = {k}: K/32 is not a multiple of groups={cfg.groups}")
    use_asm = cfg.asm and not interpret
    if use_asm:
        x2 = asm_ready_activations(x2, w, "GEMV")
    m_chunks = triton.cdiv(m, cfg.block_m)
    grid = (triton.cdiv(n, cfg.block_n), cfg.split_k, m_chunks)
    ws, cnt = split_k_buffers(x2, cfg.split_k, n, grid[0] * grid[2], out)
    _w4a16_gemv_kernel[grid](x2, w.qweight, w.scales, w.global_scale, out, ws, cnt,
                             m, n, k, w.qweight.stride(-2), w.scales.stride(-2), x2.stride(0), out.stride(0),
                             GEMV_ACC_FACTOR, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUPS=cfg.groups,
                             SPLIT_K=cfg.split_k, USE_ASM=use_asm, RNE=interpret, PREFETCH=cfg.prefetch,
                             num_warps=cfg.num_warps, num_stages=1)
    return out
