"""Dense W4A16 GEMM: y[M, N] = x[M, K] (bf16) @ dequant(W)[N, K]^T, FP4 weights dequantized in registers.

Weights come from `layouts.prepare_nvfp4_weight` / `prepare_mxfp4_weight` (once per weight sync). Each
16-byte group of a weight row holds 32 codes: byte j carries element j ("low") and element 16 + j
("high") of the group, so a K tile becomes two half-tiles and two tensor-core dots against two contiguous
activation slices; no interleave and no strided activation loads.

In-register dequant (no lookup table, no float subnormal-flush hazard):
  * codes: the prepared byte puts each code's bits where a float16 wants them, so the fp16 bit pattern of
    code * 2^-14 is one AND (low element) or shift, shift, LOP3 (high element); on the GPU an inline-PTX
    routine does 2 bytes per register: 5 integer instructions per 4 weights. +-0.5 become fp16
    subnormals, which the fp16 multiply and the tensor cores keep exactly.
  * scales: re-encoded once so that their decode is one shift (NVFP4: fp16 bits of s * 2^5; MXFP4: fp32
    bits of 2^(e-127) * 2^14).
Two arithmetic paths (`GemmConfig.fp16_dot`):
  * fp16_dot=True (NVFP4, the default): w16 = code * (s_block * 2^5) in float16 is EXACT for every code
    and every E4M3 scale (at most 6 significant bits, inside [2^-19, 5.25]); x is fed as
    float16(x * 2^-8) (exact for |x| >= 2^-9; overflow only past 1.6e7); the fp32 accumulator is scaled
    by s_global * 2^17 at the end. One HMUL2 per 2 weights.
  * fp16_dot=False (MXFP4, or NVFP4 on request): w = bf16(code * s_block * s_global) computed in fp32,
    bit-identical to `nvfp4_dequantize` / `mxfp4_dequantize`, and a bf16 dot.
Both accumulate in fp32 and write bf16.

Small M (decode, M <= 64) runs "swapped": the weight tile is the wgmma's M side (64/128 rows, A operand
from registers) and the few tokens its N side (16..64), so M = 1 wastes no tensor-core rows on padding
the weights. Split-K spreads K over more CTAs when N alone cannot fill 132 SMs; by default the last CTA
of each output tile sums the fp32 partials in split order (one launch, deterministic, no atomics on the
data). Large M runs the classic orientation with x converted once per call (x_pre).

NVFP4 at small M goes to one of two GEMVs instead (docs/PERF.md): M = 1 to the CUDA-core split-K GEMV of
w4a16_gemv.py (no tensor cores), M = 2..8 to the register-fragment MMA GEMV of w4a16_mma_gemv.py (mma.sync
on weights decoded straight into A fragments, one MMA for up to 8 tokens).

Config choice: `heuristic_config` (sm_90 table measured on an H200, docs/PERF.md; a GemvConfig, an
MmaGemvConfig or a GemmConfig), or a one-time timing of `candidate_configs` (all kinds) per (format, M bucket,
N, K) under CUDA graphs (`QRL_W4A16_AUTOTUNE=1` or `autotune=True`), cached per process.

Interpreter: under TRITON_INTERPRET=1 (set it before the kernels are imported) the dots run in fp32 and
bf16 casts round with integer arithmetic (the CPU interpreter's bf16 tl.dot is wrong and its float->bf16
cast truncates); everything else is the GPU code except the inline PTX, replaced by the same bit
formula in Triton ops.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Optional, Union

import torch
import triton
import triton.language as tl

from .layouts import NVFP4_GLOBAL_FOLD, PreparedFP4Weight
from .rounding import _cast_out, _to_bf16
from .tiling import split_k_for
from .w4a16_gemv import GemvConfig, gemv_bucket, gemv_candidates, gemv_supported, launch_gemv, make_gemv_config
from .w4a16_gluon_gemm import (SS_K_MULTIPLE, GluonGemmConfig, default_gluon_config, gluon_candidates,
                               launch_gluon_gemm)
from .w4a16_gluon_gemm import supported as gluon_supported
from .w4a16_mma_gemv import (MmaGemvConfig, default_mma_gemv_config, launch_mma_gemv, mma_gemv_candidates,
                             mma_gemv_supported)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# NVFP4 above this M goes to the Gluon kernels (w4a16_gluon_gemm.default_gluon_config: shared-A up to 128
# tokens or while its tiles fit one wave, register-A beyond): on the H200 they were faster at every
# measured M from 48 to 512 (1.25-1.6x the Triton wgmma kernel), slower at M = 32. Where the shared-A
# kernel runs (K % 256 == 0) the threshold is lower: at M = 40 it took 30.7 / 19.7 us against the wgmma
# kernel's 46.3 / 29.4 us ((4096, 14336) / (7168, 4096); docs/PERF.md). M = 33..47 with other K: unmeasured.
GLUON_MIN_M = 47
GLUON_MIN_M_SHARED_A = 32
_GLUON_BROKEN = False   # set once if the Gluon kernel fails to build here (another Triton): fall back

X_SHIFT = 8          # fp16 path: x is fed as x * 2^-8
W_SHIFT = 5          # fp16 path: the E4M3 scale is applied as s * 2^5 (exact in fp16)
# fp16 path: acc = sum(x*2^-8 * code*2^-14 * s*2^5) = y / s_global * 2^-17; gs_prepared = s_global * 2^22
FP16_ACC_FACTOR = 2.0 ** (X_SHIFT + 14 - W_SHIFT) / NVFP4_GLOBAL_FOLD


# ----------------------------------------------------------------------------------------------------
# In-register decode helpers (shared with the grouped MoE kernels)
# ----------------------------------------------------------------------------------------------------
# Two kernel-layout bytes (one 16-bit register, as the wgmma A fragment loads them) -> fp16x2 of the two
# low elements ($0) and fp16x2 of the two high elements ($1): 5 integer instructions per 4 weights.
_DECODE_ASM = tl.constexpr("""{
.reg .b32 t, a, c;
cvt.u32.u16 t, $2;
prmt.b32 t, t, 0, 0x1404;
and.b32 $0, t, 0x8E008E00;
shr.b32 a, t, 3;
shl.b32 c, t, 7;
lop3.b32 $1, a, c, 0x8E008E00, 0xA8;
}""")


# Four prepared NVFP4 scale bytes (one 32-bit register) -> two fp16x2 holding s * 2^5 (as _nvfp4_scale_f16):
# 4 instructions per 4 scales where the byte-wise form takes 8 (a byte extract and a shift each)
_SCALE_ASM = tl.constexpr("""{
prmt.b32 $0, $2, 0, 0x4140;
shl.b32 $0, $0, 7;
prmt.b32 $1, $2, 0, 0x4342;
shl.b32 $1, $1, 7;
}""")


@triton.jit
def _codes_f16(b, USE_ASM: tl.constexpr):
    """Kernel-layout bytes (uint8 tile) -> (low, high) float16 tiles holding code value * 2^-14, exactly.

    The byte layout (layouts.py) puts each code's bits where float16 wants them: low = (b << 8) & 0x8E00,
    high = ((b << 5) & 0x0E00) | ((b << 15) & 0x8000). USE_ASM does the same on 2 bytes per register
    (one fp16x2 result per output, 5 integer instructions per 4 weights); GPU only.
    """
    if USE_ASM:
        lo, hi = tl.inline_asm_elementwise(_DECODE_ASM, "=r,=r,h", [b], dtype=(tl.float16, tl.float16),
                                           is_pure=True, pack=2)
    else:
        b = b.to(tl.int32)
        lo = ((b << 8) & 0x8E00).to(tl.int16).to(tl.float16, bitcast=True)
        hi = (((b << 5) & 0x0E00) | ((b << 15) & 0x8000)).to(tl.int16).to(tl.float16, bitcast=True)
    return lo, hi


@triton.jit
def _nvfp4_scale_f16(s):
    """Prepared NVFP4 scale bytes (layouts.encode_nvfp4_scales) -> float16 s * 2^5, exactly: one shift."""
    return (s.to(tl.int16) << 7).to(tl.float16, bitcast=True)


@triton.jit
def _mxfp4_scale_f32(e):
    """Prepared MXFP4 scale bytes (e + 14) -> fp32 2^(e - 127) * 2^14, exactly: one shift."""
    return (e.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _dequant_tile(b, sb, gs, BLOCK_N: tl.constexpr, HALF: tl.constexpr, IS_MX: tl.constexpr,
                  FP16: tl.constexpr, USE_ASM: tl.constexpr, RNE: tl.constexpr = False,
                  PACKED_SCALES: tl.constexpr = False):
    """b: uint8 [BLOCK_N, HALF] (kernel layout), sb: prepared scale bytes of the tile ([BLOCK_N, HALF/8] for
    NVFP4, [BLOCK_N, HALF/16] for MXFP4), gs: folded global scale. Returns (w_lo, w_hi) [BLOCK_N, HALF] in
    the dot dtype (fp16 when FP16 else bf16); w_lo multiplies the activation columns of the low elements,
    w_hi those of the high ones. PACKED_SCALES (with USE_ASM): NVFP4 scales decoded four bytes per register."""
    G: tl.constexpr = HALF // 16
    c_lo, c_hi = _codes_f16(b, USE_ASM)
    c_lo = tl.reshape(c_lo, (BLOCK_N, G, 16))
    c_hi = tl.reshape(c_hi, (BLOCK_N, G, 16))
    if IS_MX:
        s = _mxfp4_scale_f32(sb)                                # [BN, G]
        w_lo = _to_bf16(c_lo.to(tl.float32) * s[:, :, None], RNE)
        w_hi = _to_bf16(c_hi.to(tl.float32) * s[:, :, None], RNE)
    else:
        if PACKED_SCALES and USE_ASM:
            s16 = tl.inline_asm_elementwise(_SCALE_ASM, "=r,=r,r", [sb], dtype=tl.float16, is_pure=True, pack=4)
            s_lo, s_hi = tl.split(tl.reshape(s16, (BLOCK_N, G, 2)))
        else:
            s_lo, s_hi = tl.split(tl.reshape(sb, (BLOCK_N, G, 2)))  # blocks 2g (low elements), 2g+1 (high)
            s_lo = _nvfp4_scale_f16(s_lo)                           # s * 2^5
            s_hi = _nvfp4_scale_f16(s_hi)
        if FP16:
            w_lo = c_lo * s_lo[:, :, None]                      # code * s * 2^-9: exact in fp16
            w_hi = c_hi * s_hi[:, :, None]
        else:
            g = gs * (1.0 / 8192.0)                             # s_global * 2^9
            s_lo = s_lo.to(tl.float32) * g
            s_hi = s_hi.to(tl.float32) * g
            w_lo = _to_bf16(c_lo.to(tl.float32) * s_lo[:, :, None], RNE)
            w_hi = _to_bf16(c_hi.to(tl.float32) * s_hi[:, :, None], RNE)
    return tl.reshape(w_lo, (BLOCK_N, HALF)), tl.reshape(w_hi, (BLOCK_N, HALF))


@triton.jit
def _prep_x(x, FP16: tl.constexpr, DOT_F32: tl.constexpr, X_PRE: tl.constexpr = False):
    """Activation tile -> dot operand: fp16 x * 2^-8 (FP16 path; X_PRE: already converted) or bf16."""
    if X_PRE:
        x = x
    elif FP16:
        x = (x.to(tl.float32) * (1.0 / 256.0)).to(tl.float16)
    else:
        x = _to_bf16(x.to(tl.float32), DOT_F32)
    if DOT_F32:
        x = x.to(tl.float32)
    return x


@triton.jit
def _mma(w, x, acc, SWAP: tl.constexpr, DOT_F32: tl.constexpr):
    """SWAP: acc[BN, BM] += w[BN, H] @ x[BM, H]^T, else acc[BM, BN] += x[BM, H] @ w[BN, H]^T."""
    if DOT_F32:
        w = w.to(tl.float32)
    if SWAP:
        acc = tl.dot(w, tl.trans(x), acc)
    else:
        acc = tl.dot(x, tl.trans(w), acc)
    return acc


# ----------------------------------------------------------------------------------------------------
# Dense kernel
# ----------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["M"])
def _w4a16_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, y_ptr, ws_ptr, cnt_ptr,
                  M, N, K, stride_wn, stride_sn, stride_xm, stride_ym,
                  acc_factor,
                  IS_MX: tl.constexpr, FP16: tl.constexpr, SWAP: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  SPLIT_K: tl.constexpr, REDUCE: tl.constexpr, DOT_F32: tl.constexpr, USE_ASM: tl.constexpr,
                  X_PRE: tl.constexpr, M_FAST: tl.constexpr = False, W_TMA: tl.constexpr = False):
    """REDUCE (SPLIT_K > 1 only): 1 = write fp32 partials to ws [SPLIT_K, M, N] for _splitk_reduce_kernel;
    2 = the last CTA of each output tile (counted in cnt_ptr, which it resets to 0) sums the partials in
    split order and writes y itself: one launch, still deterministic.
    M_FAST: program axis 0 walks M tiles, so the CTAs that share a weight tile run together and the
    second and later reads of it hit L2 (large M).
    W_TMA: w_ptr is a TensorDescriptor over the [N, K/2] codes with block [BLOCK_N, BLOCK_K/2]: the weight
    tiles arrive by the bulk tensor copy engine (no per-thread pointer tile held in registers; rows past N
    read as zeros)."""
    if M_FAST:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
    else:
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    HALF: tl.constexpr = BLOCK_K // 2
    SB: tl.constexpr = BLOCK_K // 32 if IS_MX else BLOCK_K // 16

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    kk = tl.arange(0, HALF)
    k_lo = (kk // 16) * 32 + (kk % 16)            # activation column of each low nibble of a tile
    ks = tl.arange(0, SB)

    k_tiles = K // BLOCK_K                         # the host guarantees K % BLOCK_K == 0
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    t_begin = pid_k * per_split
    t_end = tl.minimum(t_begin + per_split, k_tiles)

    if W_TMA:
        w_rows = w_ptr
    else:
        w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + kk[None, :]
    s_rows = s_ptr + offs_n.to(tl.int64)[:, None] * stride_sn + ks[None, :]
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + k_lo[None, :]
    gs = tl.load(gs_ptr)

    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(t_begin, t_end):
        k0 = t * BLOCK_K
        if W_TMA:
            b = w_rows.load([pid_n * BLOCK_N, t * HALF])
        else:
            b = tl.load(w_rows + t * HALF, mask=n_mask[:, None], other=0)
        sb = tl.load(s_rows + t * SB, mask=n_mask[:, None], other=0)
        x_lo = tl.load(x_rows + k0, mask=m_mask[:, None], other=0.0)
        x_hi = tl.load(x_rows + (k0 + 16), mask=m_mask[:, None], other=0.0)
        w_lo, w_hi = _dequant_tile(b, sb, gs, BLOCK_N, HALF, IS_MX, FP16, USE_ASM, DOT_F32)
        acc = _mma(w_lo, _prep_x(x_lo, FP16, DOT_F32, X_PRE), acc, SWAP, DOT_F32)
        acc = _mma(w_hi, _prep_x(x_hi, FP16, DOT_F32, X_PRE), acc, SWAP, DOT_F32)

    if FP16:
        acc = acc * (gs * acc_factor)
    if SWAP:
        y_off = offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
        ws_off = offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]
        y_mask = n_mask[:, None] & m_mask[None, :]
    else:
        y_off = offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        ws_off = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        y_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptr + y_off, _cast_out(acc, y_ptr, DOT_F32), mask=y_mask)
    else:
        split_stride = M.to(tl.int64) * N
        tl.store(ws_ptr + pid_k * split_stride + ws_off, acc, mask=y_mask)
        if REDUCE == 2:
            tl.debug_barrier()
            tile = pid_m * tl.cdiv(N, BLOCK_N) + pid_n
            arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                tot = tl.load(ws_ptr + ws_off, mask=y_mask, other=0.0, cache_modifier=".cg")
                for sk in tl.static_range(1, SPLIT_K):
                    tot += tl.load(ws_ptr + sk * split_stride + ws_off, mask=y_mask, other=0.0,
                                   cache_modifier=".cg")
                tl.store(y_ptr + y_off, _cast_out(tot, y_ptr, DOT_F32), mask=y_mask)
                tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["numel"])
def _x_to_f16_kernel(x_ptr, y_ptr, numel, BLOCK: tl.constexpr):
    """y = float16(x * 2^-8): the FP16 path's activation operand, converted once per call (large M)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, (x.to(tl.float32) * (1.0 / 256.0)).to(tl.float16), mask=mask)


@triton.jit(do_not_specialize=["numel"])
def _splitk_reduce_kernel(ws_ptr, y_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, RNE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(ws_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, _cast_out(acc, y_ptr, RNE), mask=mask)


# ----------------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    swap: bool = True
    fp16_dot: bool = True
    asm: bool = True          # inline-PTX nibble decode (GPU); ignored under the interpreter
    x_pre: bool = False       # fp16 path: convert x once per call (pays off for large M) instead of per tile
    fused_reduce: bool = True  # split-K: last CTA per tile reduces (one launch) instead of a second kernel
    tma: bool = False         # weight tiles through a TMA tensor descriptor instead of per-thread pointers

    def short(self) -> str:
        return (f"{'S' if self.swap else 'N'}{self.block_m}x{self.block_n}x{self.block_k}"
                f"/sk{self.split_k}/w{self.num_warps}s{self.num_stages}/{'f16' if self.fp16_dot else 'bf16'}"
                f"{'/asm' if self.asm else ''}{'/xpre' if self.x_pre else ''}"
                f"{'/r2' if self.split_k > 1 and not self.fused_reduce else ''}{'/tma' if self.tma else ''}")


NUM_SMS_DEFAULT = 132


def m_bucket(m: int) -> int:
    """Autotune key bucket for M: 16, 32, 64, 128, 256, 512+ (the kernel's BLOCK_M steps)."""
    for b in (16, 32, 64, 128, 256):
        if m <= b:
            return b
    return 512


def _largest_block_k(k: int, cap: int) -> int:
    bk = cap
    while bk > 32 and k % bk:
        bk //= 2
    if k % bk:
        raise ValueError(f"K = {k} must be a multiple of 32 for the W4A16 kernels")
    return bk


def _num_sms(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return NUM_SMS_DEFAULT


# Small-M (swapped) kernels by M bucket: (BLOCK_M, BLOCK_N, BLOCK_K cap, warps, stages, x_pre, CTAs/SM).
# Chosen on an H200 (docs/PERF.md "W4A16 GEMM kernels"); candidate_configs lists the alternatives timed.
_SWAP_TABLE = {16: (16, 128, 128, 4, 4, False, 2), 32: (32, 128, 128, 4, 3, False, 2),
               64: (64, 128, 128, 4, 3, False, 2)}
# NVFP4 buckets whose tiles take TMA weight loads -> their BLOCK_K cap with TMA (docs/PERF.md "Session of
# 2026-11-30 evening")
_SWAP_TMA_BLOCK_K_NVFP4 = {16: 256, 32: 128}
# Large-M (M > 64) kernel: (BLOCK_M, BLOCK_N, BLOCK_K cap, warps, stages, x_pre); NVFP4 at M <= 128 takes TMA
# tiles.
_LARGE = (64, 128, 128, 4, 3, True)


# Small-M dispatch (NVFP4), by GEMV bucket (docs/PERF.md "W4A16 GEMM kernels", H200):
# - M = 1: the CUDA-core GEMV (_GEMV_TABLE: block_n, groups, CTAs per SM, prefetch); 1.07-1.14x faster than
#   the register-fragment MMA GEMV there.
# - M = 2..8: the register-fragment MMA GEMV (w4a16_mma_gemv.py): 1.09-1.24x faster than the CUDA-core GEMV at
#   M = 2 and than the wgmma kernel at M = 3..8.
# - M = 9..16 and up: the wgmma kernel (the MMA GEMV was 1-12% slower at M = 16).
_GEMV_TABLE = {1: (64, 8, 8, False)}
_MMA_GEMV_BUCKETS = (2, 4, 8)


def heuristic_config(fmt: str, m: int, n: int, k: int, sms: int = NUM_SMS_DEFAULT):
    """The default kernel for (fmt, M, N, K): for NVFP4 at small M one of the two GEMVs (a GemvConfig or an
    MmaGemvConfig, see above), else the wgmma kernel (GemmConfig, `dot_heuristic_config`)."""
    if gemv_supported(fmt, m, k) and gemv_bucket(m) in _GEMV_TABLE:
        bn, g, per_sm, pf = _GEMV_TABLE[gemv_bucket(m)]
        return make_gemv_config(m, n, k, sms, bn, g, per_sm, prefetch=pf)
    if mma_gemv_supported(fmt, m, k) and gemv_bucket(m) in _MMA_GEMV_BUCKETS:
        return default_mma_gemv_config(m, n, k, sms)
    gluon_min_m = GLUON_MIN_M_SHARED_A if k % SS_K_MULTIPLE == 0 else GLUON_MIN_M
    if m > gluon_min_m and gluon_supported(fmt, m, k) and not _GLUON_BROKEN:
        return default_gluon_config(m, n, k, sms)
    return dot_heuristic_config(fmt, m, n, k, sms)


def dot_heuristic_config(fmt: str, m: int, n: int, k: int, sms: int = NUM_SMS_DEFAULT) -> GemmConfig:
    """sm_90 defaults of the tensor-core kernel (H200: 132 SMs)."""
    fp16 = fmt == "nvfp4"
    mb = m_bucket(m)
    if mb <= 64:
        bucket = max(16, mb)
        bm, bn, bk_cap, w, st, xpre, per_sm = _SWAP_TABLE[bucket]
        tma = fp16 and bucket in _SWAP_TMA_BLOCK_K_NVFP4
        bk = _largest_block_k(k, _SWAP_TMA_BLOCK_K_NVFP4[bucket] if tma else bk_cap)
        split = split_k_for(triton.cdiv(n, bn), k // bk, sms, per_sm=per_sm)
        return GemmConfig(bm, bn, bk, split, w, st, True, fp16, x_pre=xpre and fp16, tma=tma)
    bm, bn, bk_cap, w, st, xpre = _LARGE
    bk = _largest_block_k(k, bk_cap)
    tiles = triton.cdiv(n, bn) * triton.cdiv(m, bm)
    split = split_k_for(tiles, k // bk, sms, cap=4) if tiles < sms else 1
    # TMA weight tiles paid at M = 128 (1.04x) but not at 512 (1.2x slower there): docs/PERF.md
    return GemmConfig(bm, bn, bk, split, w, st, False, fp16, x_pre=xpre and fp16, tma=fp16 and mb <= 128)


def candidate_configs(fmt: str, m: int, n: int, k: int, sms: int = NUM_SMS_DEFAULT) -> list:
    """A few configs per M bucket that the on-device autotuner times (the heuristic one first): tensor-core
    configs, plus the variants of both GEMVs for NVFP4 at M <= 16."""
    fp16 = fmt == "nvfp4"
    mb = m_bucket(m)
    out = [heuristic_config(fmt, m, n, k, sms), dot_heuristic_config(fmt, m, n, k, sms)]
    if gemv_supported(fmt, m, k):
        out += gemv_candidates(m, n, k, sms)
    if mma_gemv_supported(fmt, m, k):
        out += mma_gemv_candidates(m, n, k, sms)
    if mb <= 64:
        bm = max(16, mb)
        # (BLOCK_N, BLOCK_K cap, warps, stages, x_pre, CTAs per SM)
        opts = [(128, 256, 4, 4, False, 2), (64, 256, 4, 3, True, 4), (64, 512, 4, 2, True, 4),
                (128, 128, 8, 4, True, 5), (128, 256, 8, 3, True, 3), (128, 128, 4, 4, False, 2)]
        if bm >= 32:
            opts = [(128, 128, 4, 3, True, 2), (128, 128, 8, 4, False, 4), (128, 128, 8, 4, True, 4),
                    (64, 256, 4, 2, False, 4)]
        for bn, bk, w, st, xpre, per_sm in opts:
            bk = _largest_block_k(k, bk)
            split = split_k_for(triton.cdiv(n, bn), k // bk, sms, per_sm=per_sm)
            out.append(GemmConfig(bm, bn, bk, split, w, st, True, fp16, x_pre=xpre and fp16))
    else:
        for bm, bn, bk, w, st in ((128, 256, 64, 8, 3), (64, 128, 256, 4, 2), (64, 128, 128, 4, 4)):
            bk = _largest_block_k(k, bk)
            tiles = triton.cdiv(n, bn) * triton.cdiv(m, bm)
            split = split_k_for(tiles, k // bk, sms, cap=4) if tiles < sms else 1
            out.append(GemmConfig(bm, bn, bk, split, w, st, False, fp16, x_pre=fp16))
        # swapped, 64 tokens per tile (fastest at K=7168 N=4096 M=128 by 3%; 128-token swapped tiles were
        # slower everywhere: docs/PERF.md)
        for bm, bn, bk, w, st in ((64, 128, 128, 4, 3),):
            bk = _largest_block_k(k, bk)
            tiles = triton.cdiv(n, bn) * triton.cdiv(m, bm)
            split = split_k_for(tiles, k // bk, sms, cap=4) if tiles < sms else 1
            out.append(GemmConfig(bm, bn, bk, split, w, st, True, fp16, x_pre=fp16))
    # the same tiles fed by TMA (weight codes only; scales and activations stay pointer loads)
    out += [replace(c, tma=True) for c in out if isinstance(c, GemmConfig) and (c.block_k // 2) % 16 == 0]
    if m > 16 and gluon_supported(fmt, m, k):
        out += gluon_candidates(m, n, k, sms)
    seen, uniq = set(), []
    for c in out:
        if c not in seen:
            seen.add(c)
            uniq.append(c)
    return uniq


_TUNED: dict = {}


def _autotune_enabled(flag: Optional[bool]) -> bool:
    if INTERPRET:
        return False
    if flag is not None:
        return flag
    return os.environ.get("QRL_W4A16_AUTOTUNE", "0") == "1"


def _time_ms(run, reps: int = 10) -> float:
    """Median time of one call: a CUDA graph of `reps` calls (launch overhead as in a captured decode step)
    replayed under do_bench; plain do_bench if capture fails."""
    from triton.testing import do_bench

    run()
    torch.cuda.synchronize()
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                run()
        return do_bench(g.replay, warmup=5, rep=20, return_mode="median") / reps
    except Exception:  # noqa: BLE001
        return do_bench(run, warmup=5, rep=20, return_mode="median")


def _tune(key, cands, run):
    best, best_t = None, float("inf")
    for c in cands:
        try:
            t = _time_ms(lambda: run(c))
        except Exception:  # a config that does not compile/fit is skipped
            continue
        if t < best_t:
            best, best_t = c, t
    _TUNED[key] = best
    return best


# ----------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------
def launch_w4a16(x2: torch.Tensor, w: PreparedFP4Weight, cfg: GemmConfig, out: torch.Tensor,
                 qweight: Optional[torch.Tensor] = None, scales: Optional[torch.Tensor] = None,
                 global_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Run one config (no checks). x2 [M, K] contiguous rows, out [M, N]."""
    m, k = x2.shape
    n = w.n
    is_mx = w.fmt == "mxfp4"
    fp16 = cfg.fp16_dot and not is_mx
    qweight = w.qweight if qweight is None else qweight
    scales = w.scales if scales is None else scales
    gs = w.global_scale if global_scale is None else global_scale
    m_tiles, n_tiles = triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n)
    m_fast = m_tiles > 1
    grid_mn = (m_tiles, n_tiles) if m_fast else (n_tiles, m_tiles)
    x_pre = fp16 and cfg.x_pre
    if x_pre:
        xh = torch.empty(x2.shape, device=x2.device, dtype=torch.float16)
        _x_to_f16_kernel[(triton.cdiv(x2.numel(), 2048),)](x2, xh, x2.numel(), BLOCK=2048, num_warps=4)
        x2 = xh
    use_tma = cfg.tma and qweight.dim() == 2 and tma_compatible(qweight)   # else (a view TMA cannot address):
    w_arg = weight_descriptor(qweight, [cfg.block_n, cfg.block_k // 2]) if use_tma else qweight   # pointers
    common = dict(IS_MX=is_mx, FP16=fp16, SWAP=cfg.swap, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                  BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k, DOT_F32=INTERPRET, USE_ASM=cfg.asm and not INTERPRET,
                  X_PRE=x_pre, M_FAST=m_fast, W_TMA=use_tma, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.split_k == 1:
        _w4a16_kernel[grid_mn + (1,)](x2, w_arg, scales, gs, out, out, out, m, n, k, qweight.stride(-2),
                                     scales.stride(-2), x2.stride(0), out.stride(0), FP16_ACC_FACTOR,
                                     REDUCE=0, **common)
        return out
    ws = torch.empty((cfg.split_k, m, n), device=x2.device, dtype=torch.float32)
    reduce = 2 if cfg.fused_reduce else 1
    cnt = _tile_counters(x2.device, grid_mn[0] * grid_mn[1]) if reduce == 2 else ws
    _w4a16_kernel[grid_mn + (cfg.split_k,)](x2, w_arg, scales, gs, out, ws, cnt, m, n, k, qweight.stride(-2),
                                           scales.stride(-2), x2.stride(0), out.stride(0), FP16_ACC_FACTOR,
                                           REDUCE=reduce, **common)
    if reduce == 1:
        if not out.is_contiguous():
            raise ValueError("the two-kernel split-K reduction needs a contiguous output")
        numel = m * n
        _splitk_reduce_kernel[(triton.cdiv(numel, 1024),)](ws, out, numel, SPLIT_K=cfg.split_k, BLOCK=1024,
                                                           RNE=INTERPRET, num_warps=4)
    return out


def tma_compatible(codes: torch.Tensor) -> bool:
    """Packed codes ([N, K/2] or an expert stack [E, N, K/2]) a TMA descriptor can address: unit inner
    stride, 16-byte aligned base and outer strides."""
    return (codes.stride(-1) == 1 and all(st % 16 == 0 for st in codes.stride()[:-1])
            and codes.data_ptr() % 16 == 0)


def weight_descriptor(codes: torch.Tensor, block: list):
    """TMA descriptor over packed codes with the given block shape (last entry in bytes, a multiple of 16:
    the bulk copy engine moves at least 16 bytes per block row)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if not tma_compatible(codes) or block[-1] % 16:
        raise ValueError(f"TMA weight tiles need codes with unit inner stride, 16-byte aligned base and rows "
                         f"and a block width that is a multiple of 16 bytes (got shape {tuple(codes.shape)}, "
                         f"strides {codes.stride()}, block {block}); use a config with tma=False")
    return TensorDescriptor.from_tensor(codes, list(block))


_COUNTERS: dict = {}


def _tile_counters(device, tiles: int) -> torch.Tensor:
    """Zeroed int32 arrival counters for the fused split-K reduction, one buffer per device, reused by
    every call (each last-arriving CTA resets its counter). Calls that use them must not run concurrently
    on several streams of one device."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < tiles:
        buf = torch.zeros(max(tiles, 1 << 14), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def select_config(w: PreparedFP4Weight, m: int, device, autotune: Optional[bool] = None,
                  x2: Optional[torch.Tensor] = None):
    sms = _num_sms(device)
    if not _autotune_enabled(autotune) or x2 is None:
        return heuristic_config(w.fmt, m, w.n, w.k, sms)
    key = ("dense", w.fmt, gemv_bucket(m) if m <= 16 else m_bucket(m), w.n, w.k, str(device))
    cfg = _TUNED.get(key)
    if cfg is None:
        tmp = torch.empty((m, w.n), device=device, dtype=torch.bfloat16)
        cfg = _tune(key, candidate_configs(w.fmt, m, w.n, w.k, sms),
                    lambda c: _launch(x2, w, c, tmp))
        if cfg is None:
            raise RuntimeError(f"no W4A16 config ran for M={m} N={w.n} K={w.k}")
    return cfg


# The dense W4A16 kernels by config type: a config names its kernel (one registry, no isinstance chain).
# Each entry looks its launcher up when called, so a replaced module attribute (a test's stub) is seen.
LAUNCHERS = {
    GemvConfig: lambda x2, w, cfg, out: launch_gemv(x2, w, cfg, out, interpret=INTERPRET),
    MmaGemvConfig: lambda x2, w, cfg, out: launch_mma_gemv(x2, w, cfg, out, interpret=INTERPRET),
    GluonGemmConfig: lambda x2, w, cfg, out: launch_gluon_gemm(x2, w, cfg, out),
    GemmConfig: lambda x2, w, cfg, out: launch_w4a16(x2, w, cfg, out),
}


def _launch(x2: torch.Tensor, w: PreparedFP4Weight, cfg, out: torch.Tensor) -> torch.Tensor:
    """Run a config of any of the dense kernels (LAUNCHERS)."""
    launch = LAUNCHERS.get(type(cfg))
    if launch is None:
        raise TypeError(f"no W4A16 kernel for a {type(cfg).__name__}; use one of {[c.__name__ for c in LAUNCHERS]}")
    return launch(x2, w, cfg, out)


def _launch_default(x2: torch.Tensor, w: PreparedFP4Weight, cfg, out: torch.Tensor) -> torch.Tensor:
    """`_launch` for a config the library chose: a Gluon kernel that cannot be built by this Triton
    (Gluon is experimental and its API moves between releases) is reported once and replaced by the
    Triton wgmma kernel for the rest of the process."""
    global _GLUON_BROKEN
    try:
        return _launch(x2, w, cfg, out)
    except (triton.CompilationError, AttributeError, TypeError, ImportError) as e:
        if not isinstance(cfg, GluonGemmConfig):
            raise
        import warnings

        _GLUON_BROKEN = True
        warnings.warn(f"W4A16: the Gluon kernel does not build with Triton {triton.__version__} "
                      f"({type(e).__name__}: {str(e)[:200]}); using the Triton wgmma kernel instead")
        m, k = x2.shape
        return _launch(x2, w, dot_heuristic_config(w.fmt, m, w.n, k, _num_sms(x2.device)), out)


def w4a16_gemm(x: torch.Tensor, w: PreparedFP4Weight, *, out: Optional[torch.Tensor] = None,
               config: Optional[Union[GemmConfig, GemvConfig, MmaGemvConfig, GluonGemmConfig]] = None,
               autotune: Optional[bool] = None) -> torch.Tensor:
    """y = x @ dequant(w)^T for x [..., K] (bf16; fp16/fp32 are cast to bf16), w from prepare_*_weight.

    Returns [..., N] in x's dtype. `config` forces a kernel config of any of the three kernels (benchmarks,
    tests); otherwise the cached autotuned config (QRL_W4A16_AUTOTUNE=1) or the sm_90 heuristic is used.
    """
    if w.num_experts is not None:
        raise ValueError("w4a16_gemm takes one dense weight; use moe_grouped_gemm for expert stacks")
    if x.shape[-1] != w.k:
        raise ValueError(f"x has K = {x.shape[-1]} but the weight has K = {w.k}")
    if x.device != w.device:
        raise ValueError(f"x on {x.device}, weight on {w.device}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.k)
    if x2.dtype != torch.bfloat16:
        x2 = x2.to(torch.bfloat16)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if out is None:
        out = torch.empty((m, w.n), device=x.device, dtype=torch.bfloat16)
    if m == 0:
        return out.reshape(*lead, w.n).to(x.dtype)
    chosen = config is None
    cfg = config or select_config(w, m, x.device, autotune, x2)
    if isinstance(cfg, (GemvConfig, MmaGemvConfig)) and out.stride(-1) != 1:
        raise ValueError("the GEMV kernels need an output with unit inner stride")
    if isinstance(cfg, GemmConfig):
        if w.fmt == "mxfp4" and cfg.fp16_dot:
            cfg = replace(cfg, fp16_dot=False)
        if w.k % cfg.block_k:
            raise ValueError(f"config block_k={cfg.block_k} does not divide K={w.k}")
    (_launch_default if chosen else _launch)(x2, w, cfg, out)
    y = out.reshape(*lead, w.n)
    return y if x.dtype == torch.bfloat16 else y.to(x.dtype)


def w4a16_gemm_reference(x: torch.Tensor, w: PreparedFP4Weight) -> torch.Tensor:
    """Torch reference: dequantize (codec) then a bf16 matmul with fp32 accumulation."""
    from .layouts import dequantize_prepared

    wd = dequantize_prepared(w, torch.float32)
    return (x.float() @ wd.t()).to(x.dtype)
