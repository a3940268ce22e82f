"""Decode attention straight from the packed KV cache (kernels/kv_layout.py: NVFP4 or FP8 bytes + scales).

The packed twin of cache_attention.py, for CUDA-graph decode steps: row b's query [H_q, D] attends to the
first lens[b] positions of cache slot slots[b]; slots and lens are device tensors, the grid (row, KV head,
split) is fixed by the batch and the cache shape, so a graph replays it as captured.

Flash-decoding with split-K over positions: each program takes the GQA group of query heads that share a
KV head (padded to 16 rows for the tensor cores) and one of NUM_SPLITS equal slices of the row's OWN length
(sized in the kernel from lens[b], so every split works whatever max_len is), walks it in BLOCK_S steps with
an online softmax (exp2) and writes a partial (acc, max, sum); attention_combine._combine_kernel merges the
splits in a fixed order (deterministic). The head-major layout makes each program's K and V one
contiguous stream (codes, block scales, row scales).

Arithmetic (why it is cheap): the K / V tiles are never built in fp32.
  * NVFP4: each code byte decodes to two float16 bit patterns holding code * 2^-14 (one shift/mask each,
    or inline PTX: 5 integer instructions per 4 values; w4a16_gemm._dequant_tile), times the block scale
    as float16 s * 2^5: code * s * 2^-9 in float16, EXACT for every code and E4M3 scale. The even/odd
    split of the packing (byte j: elements j and 16 + j of a 32-group) gives two half-tiles that dot with
    two column subsets of q; no interleave.
  * FP8: E4M3 -> float16 is exact (the GPU's native conversion; bit placement under the interpreter,
    value * 2^-8).
  * q is scaled per row by a power of two into [2^14, 2^15) and cast to float16: exact for bf16 queries.
  * Scores: float16 tensor-core dots, fp32 accumulation, then per-row factors in fp32: the query's power
    of two, sm_scale * log2(e), the code offsets, and per column the position's row scale.
  * P.V: the value row scales vary per position, so p * (vs / max(vs over the tile)) <= 1 goes to float16
    for the dot and the tile's max(vs) (times the code offset) multiplies the fp32 result.
With a float32 query (fp32 models, CPU tests) the q and p roundings to float16 are skipped (Q16=False: fp32
dots of the same exact K / V values). The interpreter's dots run in float32 on the same rounded operands.
Reference: `packed_decode_attention_reference` (dequantize with kv_layout.gather, float32 softmax).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from . import kv_decode_gluon
from .attention_combine import _combine_kernel
from .kv_layout import PackedKV, gather
from .w4a16_gemm import INTERPRET, _dequant_tile, _nvfp4_scale_f16
from .w4a16_gemv import _DECODE as _DECODE_WORD_ASM   # four code bytes (one register) -> 4 fp16 pairs

LOG2E = 1.4426950408889634
# defaults = the fastest of tools/bench_attention.py's sweeps: 128-position blocks, 4 warps, 2 stages (H200,
# 2026-12-02); 4 programs per SM since the V conversion moved (168 registers: 3 fit an SM; FP8 best at 4 in 9 of
# 10 shapes, H100, 2026-12-06)
BLOCK_S = 128
PROGRAMS_PER_SM = 4      # split target: batch * kv_heads * splits >= this many programs per SM
MIN_BLOCKS = 2           # ... but a split of a full-length row keeps at least this many BLOCK_S steps
# NVFP4 code decode: bit operations (any backend, the interpreter's), inline PTX on 2 bytes, on 4 bytes, or on 4
# bytes kept where the tile was loaded (GPU; _dequant_fp4)
DECODERS = ("bits", "pair", "word", "word_early")


@triton.jit
def _dot(a, b, F32: tl.constexpr):
    # one return: Triton's code generator still visits the statements after a return inside a constexpr if,
    # so an early return here compiled the fp16 dot too and failed on fp32 queries (H200, 2026-12-02)
    if F32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


# Four E4M3 bytes -> four float16 (two pairs), the GPU's conversion, as non-pure PTX so that the compiler keeps it
# where it stands: converted in registers *before* the V tile changes layout (float16, then ldmatrix.trans). As a
# cast, Triton 3.6 hoists it past the layout change, which then moves single bytes (the P.V operand wants 4
# positions per register; the cache holds rows of D): 128 one-byte shared loads per thread and tile, 255
# registers; as here, 805 instead of 1177 instructions per warp and tile and 168 registers
# (tools/inspect_attention_sm90.py, sm_90a). The PTX is kv_decode_gluon's (its FP8 K decode).
_FP8_WORD_ASM = kv_decode_gluon.FP8_WORD_ASM


@triton.jit
def _fp8_f16_v(u, NATIVE: tl.constexpr):
    """The V tile's E4M3 bytes -> float16: converted where they were loaded (GPU, _FP8_WORD_ASM), or _fp8_f16."""
    if NATIVE:
        out = tl.inline_asm_elementwise(_FP8_WORD_ASM, "=r,=r,r", [u], dtype=tl.float16, is_pure=False, pack=4)
    else:
        out = _fp8_f16(u, False)
    return out


@triton.jit
def _dequant_fp4(b, sb, BLOCK_S: tl.constexpr, HALF: tl.constexpr, DECODE: tl.constexpr):
    """Packed NVFP4 tile (uint8 [BLOCK_S, HALF], prepared block scales [BLOCK_S, HALF/8]) -> (low, high) float16
    halves, code * s * 2^-9 exactly. DECODE indexes DECODERS: 0 bit operations (the interpreter's), 1 inline PTX
    on two bytes (w4a16_gemm's), 2 on four bytes, 3 on four bytes where the tile was loaded."""
    if DECODE >= 2:
        G: tl.constexpr = HALF // 16
        # pure: the compiler may move the decode past the tile's layout change (code bytes, not float16, go
        # through shared memory); not pure ("early"): decoded where loaded, fewer registers (PERF.md measures both)
        c_lo, c_hi = tl.inline_asm_elementwise(_DECODE_WORD_ASM, "=r,=r,=r,=r,r", [b], dtype=(tl.float16, tl.float16),
                                               is_pure=DECODE == 2, pack=4)
        s_lo, s_hi = tl.split(tl.reshape(sb, (BLOCK_S, G, 2)))
        w_lo = tl.reshape(c_lo, (BLOCK_S, G, 16)) * _nvfp4_scale_f16(s_lo)[:, :, None]
        w_hi = tl.reshape(c_hi, (BLOCK_S, G, 16)) * _nvfp4_scale_f16(s_hi)[:, :, None]
        out = tl.reshape(w_lo, (BLOCK_S, HALF)), tl.reshape(w_hi, (BLOCK_S, HALF))
    else:
        out = _dequant_tile(b, sb, 1.0, BLOCK_S, HALF, False, True, DECODE == 1)
    return out


@triton.jit
def _load_fp4(codes_ptr, scales_ptr, r, s_mask, BLOCK_S: tl.constexpr, HALF: tl.constexpr, D: tl.constexpr,
              DECODE: tl.constexpr):
    """Rows r of a packed NVFP4 stream -> (low, high) float16 halves [BLOCK_S, HALF] (_dequant_fp4's values)."""
    b = tl.load(codes_ptr + r[:, None] * HALF + tl.arange(0, HALF)[None, :], mask=s_mask[:, None], other=0)
    sb = tl.load(scales_ptr + r[:, None] * (D // 16) + tl.arange(0, D // 16)[None, :], mask=s_mask[:, None], other=0)
    return _dequant_fp4(b, sb, BLOCK_S, HALF, DECODE)


@triton.jit
def _q_pow2(amax):
    """Per query row: f = 2^(141 - e) with amax in [2^(e-127), 2^(e-126)), so amax * f lies in [2^14, 2^15)
    (float16 holds every bf16 value of the row exactly); 1/f. Zero rows (padding) get f = 2^-14 (clamped)."""
    e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    fe = tl.minimum(tl.maximum(268 - e, 1), 254)
    return (fe << 23).to(tl.float32, bitcast=True), ((254 - fe) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_f16(u, NATIVE: tl.constexpr):
    """E4M3 bytes -> float16: the value (NATIVE, GPU conversion) or value * 2^-8 (bit placement)."""
    if NATIVE:
        out = u.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    else:
        w = u.to(tl.int32)
        out = (((w & 0x80) << 8) | ((w & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True)
    return out


@triton.jit(do_not_specialize=["HQ", "HKV", "L", "GROUP", "NUM_SPLITS"])
def _packed_decode_kernel(q_ptr, kc_ptr, ks_ptr, kr_ptr, vc_ptr, vs_ptr, vr_ptr, slots_ptr, lens_ptr, acc_ptr,
                          ml_ptr, HQ, HKV, L, GROUP, NUM_SPLITS, qk_scale,
                          G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, IS_FP4: tl.constexpr,
                          Q16: tl.constexpr, F32: tl.constexpr, DECODE: tl.constexpr, FP8_NATIVE: tl.constexpr):
    """Shapes and the split count are runtime values (one compile per tunable set, format and query dtype)."""
    b = tl.program_id(0)
    hk = tl.program_id(1)
    sp = tl.program_id(2)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    seq_len = tl.load(lens_ptr + b)
    per = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_S) * BLOCK_S
    s_begin = sp * per
    s_end = tl.minimum(s_begin + per, seq_len)

    HALF: tl.constexpr = D // 2
    W: tl.constexpr = HALF if IS_FP4 else D            # width of one dot operand
    g = tl.arange(0, G_PAD)
    g_mask = g < GROUP
    q_rows = (b * HQ + hk * GROUP + g).to(tl.int64)
    c = tl.arange(0, W)
    if IS_FP4:                                         # packing: byte j of group n holds elements 32n+j, 32n+16+j
        col_a = (c // 16) * 32 + c % 16
        col_b = col_a + 16
    else:
        col_a = c
        col_b = c
    qa = tl.load(q_ptr + q_rows[:, None] * D + col_a[None, :], mask=g_mask[:, None], other=0.0).to(tl.float32)
    if IS_FP4:
        qb = tl.load(q_ptr + q_rows[:, None] * D + col_b[None, :], mask=g_mask[:, None], other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(qa), 1), tl.max(tl.abs(qb), 1))
    else:
        qb = qa
        amax = tl.max(tl.abs(qa), 1)
    # per-row score factor: sm_scale * log2(e) (exp2 softmax) * the code offset (fp4: 2^9; bit-placed fp8: 2^8)
    row_f = tl.full((G_PAD,), qk_scale, tl.float32)
    if IS_FP4:
        row_f = row_f * 512.0
    elif not FP8_NATIVE:
        row_f = row_f * 256.0
    if Q16:
        f, inv_f = _q_pow2(amax)
        qa = (qa * f[:, None]).to(tl.float16)
        qb = (qb * f[:, None]).to(tl.float16)
        row_f = row_f * inv_f

    stream = (slot * HKV + hk) * L                     # first row of this (slot, KV head) stream
    m_i = tl.full((G_PAD,), -float("inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc_a = tl.zeros((G_PAD, W), tl.float32)
    acc_b = tl.zeros((G_PAD, W), tl.float32)
    for s0 in range(s_begin, s_end, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        s_mask = offs_s < s_end
        r = stream + offs_s
        kr = tl.load(kr_ptr + r, mask=s_mask, other=0.0)
        vr = tl.load(vr_ptr + r, mask=s_mask, other=0.0)
        if IS_FP4:
            k_a, k_b = _load_fp4(kc_ptr, ks_ptr, r, s_mask, BLOCK_S, HALF, D, DECODE)
            sc = _dot(qa, tl.trans(k_a), F32) + _dot(qb, tl.trans(k_b), F32)
        else:
            kb = tl.load(kc_ptr + r[:, None] * D + c[None, :], mask=s_mask[:, None], other=0)
            sc = _dot(qa, tl.trans(_fp8_f16(kb, FP8_NATIVE)), F32)
        sc = sc * row_f[:, None] * kr[None, :]
        sc = tl.where(s_mask[None, :], sc, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_top = tl.max(vr, 0)
        v_top = tl.where(v_top > 0.0, v_top, 1.0)      # an unwritten tile (zeros) must not divide by 0
        p = p * (vr * (1.0 / v_top))[None, :]
        if Q16:
            p = p.to(tl.float16)
        if IS_FP4:
            v_a, v_b = _load_fp4(vc_ptr, vs_ptr, r, s_mask, BLOCK_S, HALF, D, DECODE)
            v_f = v_top * 512.0
            acc_a = acc_a * alpha[:, None] + _dot(p, v_a, F32) * v_f
            acc_b = acc_b * alpha[:, None] + _dot(p, v_b, F32) * v_f
        else:
            vb = tl.load(vc_ptr + r[:, None] * D + c[None, :], mask=s_mask[:, None], other=0)
            v_f = v_top if FP8_NATIVE else v_top * 256.0
            acc_a = acc_a * alpha[:, None] + _dot(p, _fp8_f16_v(vb, FP8_NATIVE), F32) * v_f
        m_i = m_new

    out_row = q_rows * NUM_SPLITS + sp
    acc_rows = acc_ptr + out_row[:, None] * D
    tl.store(acc_rows + col_a[None, :], acc_a, mask=g_mask[:, None])
    if IS_FP4:
        tl.store(acc_rows + col_b[None, :], acc_b, mask=g_mask[:, None])
    tl.store(ml_ptr + out_row * 2, m_i * 0.6931471805599453, mask=g_mask)     # natural-log units for the combine
    tl.store(ml_ptr + out_row * 2 + 1, l_i, mask=g_mask)


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def split_count(batch: int, kv_heads: int, max_len: int, block_s: int, sms: int,
                programs_per_sm: int = PROGRAMS_PER_SM, min_blocks: int = MIN_BLOCKS) -> int:
    """Splits per (row, KV head): enough programs to fill the SMs, but no more than a max_len row can give
    min_blocks BLOCK_S steps each (a power of two; static for a batch bucket and a cache, so CUDA graphs keep
    their grid; the kernel sizes the splits from each row's own length)."""
    want = triton.next_power_of_2(triton.cdiv(sms * programs_per_sm, max(1, batch * kv_heads)))
    cap = triton.next_power_of_2(triton.cdiv(max_len, block_s * min_blocks))
    return max(1, min(want, cap))


def kernel_args(q: torch.Tensor, keys: PackedKV, values: PackedKV, slots: torch.Tensor, lens: torch.Tensor,
                acc: torch.Tensor, ml: torch.Tensor, sm_scale: float, block_s: int, *, decode: str,
                fp8_native: bool) -> dict:
    """The kernel's arguments by name (one place for the launch and tools/inspect_attention_sm90.py, which
    compiles the kernel for sm_90a on a machine without a GPU)."""
    bsz, hq, d = q.shape
    _, hkv, max_len, _ = keys.codes.shape
    fp4 = keys.fmt == "fp4"
    q16 = q.dtype != torch.float32
    group = hq // hkv

    def scales(c):
        return c.scales if fp4 else c.codes
    return dict(q_ptr=q, kc_ptr=keys.codes, ks_ptr=scales(keys), kr_ptr=keys.row_scale, vc_ptr=values.codes,
                vs_ptr=scales(values), vr_ptr=values.row_scale, slots_ptr=slots, lens_ptr=lens, acc_ptr=acc,
                ml_ptr=ml, HQ=hq, HKV=hkv, L=max_len, GROUP=group, NUM_SPLITS=acc.shape[2],
                qk_scale=sm_scale * LOG2E, G_PAD=max(16, triton.next_power_of_2(group)), D=d, BLOCK_S=block_s,
                IS_FP4=fp4, Q16=q16, F32=INTERPRET or not q16, DECODE=DECODERS.index(decode), FP8_NATIVE=fp8_native)


def packed_decode_attention(q: torch.Tensor, keys: PackedKV, values: PackedKV, slots: torch.Tensor,
                            lens: torch.Tensor, sm_scale: float, *, block_s: Optional[int] = None,
                            num_warps: int = 4, num_stages: int = 2, num_splits: Optional[int] = None,
                            decode: Optional[str] = None, kernel: str = "auto", prefetch: Optional[int] = None,
                            programs_per_sm: Optional[int] = None, min_blocks: Optional[int] = None,
                            fused_merge: Optional[bool] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """softmax(q K^T * sm_scale) V for each row over the first lens[b] positions of cache slot slots[b].

    q [B, H_q, D] (bf16 / fp16 / fp32); keys / values: one layer of a packed KVCache (PackedKV, fp4 or fp8);
    slots, lens: int [B] device tensors (1 <= lens[b] <= max_len). Returns [B, H_q, D] in q's dtype (into
    `out` when given: contiguous, q's shape and dtype). No
    host synchronisation. kernel picks "triton", "gluon" (kv_decode_gluon: NVFP4, or FP8 at block_s 32; head_dim
    128, <= 8 query heads per KV head, 16-bit q, CUDA) or "auto" (gluon where it applies; for FP8 from
    kv_decode_gluon.FP8_MIN_PAIRS rows x KV heads). Tunables (None: the chosen kernel's
    default): block_s (positions per loop trip), num_splits (or programs_per_sm / min_blocks for the split
    count); the Triton kernel's num_warps / num_stages / decode (how NVFP4 codes become float16: DECODERS); the
    Gluon kernel's prefetch (0: none; 1: the next trip's bytes load into registers during this one; 2: code
    words through a 3-slot cp.async ring; 3, the default at 32-position trips: code words and scales through
    the ring) and fused_merge (the last split's program merges the splits instead of a combine launch; default
    up to kv_decode_gluon.MERGE_MAX_SPLITS splits).
    tools/bench_attention.py sweeps them."""
    bsz, hq, d = q.shape
    if keys.fmt != values.fmt or keys.codes.shape != values.codes.shape:
        raise ValueError("K and V caches must share one format and shape")
    _, hkv, max_len, _ = keys.codes.shape
    if keys.head_dim != d or hq % hkv:
        raise ValueError(f"unsupported shapes: q {tuple(q.shape)}, cache heads {hkv}, head_dim {keys.head_dim}")
    if block_s is not None and (block_s < 16 or block_s & (block_s - 1)):
        raise ValueError(f"block_s must be a power of two >= 16, got {block_s}")
    if out is None:
        out = torch.empty((bsz, hq, d), device=q.device, dtype=q.dtype)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {q.dtype} tensor {tuple(q.shape)}")
    if kernel not in ("auto", "triton", "gluon"):
        raise ValueError(f"kernel must be 'auto', 'triton' or 'gluon', got {kernel!r}")
    gluon_ok = (not INTERPRET and q.device.type == "cuda"
                and kv_decode_gluon.supported(keys.fmt, d, hq // hkv, q.dtype, block_s or kv_decode_gluon.TILE))
    if kernel == "gluon" and not gluon_ok:
        raise ValueError(f"the Gluon kernel takes NVFP4 (or FP8 at block_s 32), head_dim 128, <= "
                         f"{kv_decode_gluon.HEADS} query heads per KV head and a 16-bit q on CUDA; got {keys.fmt}, "
                         f"block_s {block_s}, head_dim {d}, {hq // hkv} heads per KV head, {q.dtype} on {q.device}: "
                         "pass kernel='triton'")
    if gluon_ok and (kernel == "gluon" or (kernel == "auto" and (keys.fmt == "fp4"
                                                                 or bsz * hkv >= kv_decode_gluon.FP8_MIN_PAIRS))):
        tile = block_s or kv_decode_gluon.TILE
        if num_splits is None and programs_per_sm is None and min_blocks is None:
            num_splits = kv_decode_gluon.small_grid_splits(bsz, hkv, max_len, _sm_count(q.device), tile)
        if num_splits is None:
            num_splits = split_count(bsz, hkv, max_len, tile, _sm_count(q.device),
                                     programs_per_sm or kv_decode_gluon.PROGRAMS_PER_SM,
                                     min_blocks or kv_decode_gluon.default_min_tiles(bsz, hkv, max_len,
                                                                                     _sm_count(q.device), tile))
        return kv_decode_gluon.gluon_decode_attention(q, keys, values, slots, lens, sm_scale, out,
                                                      triton.next_power_of_2(num_splits), tile,
                                                      kv_decode_gluon.default_prefetch(tile)
                                                      if prefetch is None else prefetch, fused_merge)
    block_s = block_s or BLOCK_S
    if num_splits is None:
        num_splits = split_count(bsz, hkv, max_len, block_s, _sm_count(q.device), programs_per_sm or PROGRAMS_PER_SM,
                                 min_blocks or MIN_BLOCKS)
    num_splits = triton.next_power_of_2(num_splits)
    qc = q.contiguous()
    acc = torch.empty((bsz, hq, num_splits, d), device=q.device, dtype=torch.float32)
    ml = torch.empty((bsz, hq, num_splits, 2), device=q.device, dtype=torch.float32)

    _packed_decode_kernel[(bsz, hkv, num_splits)](
        **kernel_args(qc, keys, values, slots, lens, acc, ml, sm_scale, block_s,
                      decode=decode or ("bits" if INTERPRET else "word"), fp8_native=not INTERPRET),
        num_warps=num_warps, num_stages=num_stages)
    _combine_kernel[(bsz * hq,)](acc, ml, out, D=d, NUM_SPLITS=num_splits, RNE=INTERPRET, num_warps=4)
    return out


def packed_decode_attention_reference(q: torch.Tensor, keys: PackedKV, values: PackedKV, slots: torch.Tensor,
                                      lens: torch.Tensor, sm_scale: float,
                                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize the rows' slots (kv_layout.gather), then softmax attention per row in `dtype` (GQA by
    repetition); returned in `dtype`."""
    bsz, hq, d = q.shape
    group = hq // keys.codes.shape[1]
    out = torch.empty(bsz, hq, d, dtype=dtype, device=q.device)
    for b in range(bsz):
        n = int(lens[b])
        sl = slots[b:b + 1]
        kk = gather(keys, sl, n, dtype)[0].repeat_interleave(group, 1).transpose(0, 1)      # [H, n, D]
        vv = gather(values, sl, n, dtype)[0].repeat_interleave(group, 1).transpose(0, 1)
        p = torch.softmax((q[b].to(dtype)[:, None, :] @ kk.transpose(1, 2)).squeeze(1) * sm_scale, -1)
        out[b] = (p[:, None, :] @ vv).squeeze(1)
    return out


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
