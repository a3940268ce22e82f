"""Decode attention over a quantized KV cache (NVFP4 or FP8 E4M3), dequantized in registers.

One new query token per sequence attends to its cached keys/values (flash-decoding): the grid is
(batch, KV head, KV split); each program takes the GQA group of query heads that share the KV head (padded
to 16 rows for the tensor cores), walks its slice of the sequence in BLOCK_S steps with an online softmax,
and writes a partial (acc, max, sum) per split; `_combine_kernel` merges the splits in a fixed order.

Cache formats (per layer, K and V alike, contiguous [B, H_kv, S_max, D]):
  * "nvfp4": codes packed like the codec (element 2i in the low nibble of byte i) uint8 [B, H_kv, S, D/2],
    E4M3 block scales [B, H_kv, S, D/16], one fp32 global scale per tensor (megatron_qrl.quant's format,
    quantized along head_dim). The even and odd head-dim elements (low / high nibbles) stay separate: the
    score is q_even . k_even + q_odd . k_odd and the output's even / odd columns come from two dots, so no
    in-register interleave is needed.
  * "fp8": float8_e4m3fn [B, H_kv, S, D] and one fp32 scale per tensor (x = fp8 * scale).
Codes and E4M3 bytes are decoded with bit arithmetic through float16 bit patterns (exact, identical on
the GPU and in the CPU interpreter). Probabilities are rounded to bf16 for the P.V tensor-core dot.
Reference: `decode_attention_reference` (dequantize the cache, softmax attention in fp32).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .rounding import _cast_out, _to_bf16
from .w4a16_gemm import INTERPRET


@dataclass
class QuantizedKV:
    """One quantized K or V cache tensor (see the module docstring for the formats)."""

    fmt: str                       # "nvfp4" | "fp8"
    data: torch.Tensor             # nvfp4: uint8 [B, H, S, D/2]; fp8: float8_e4m3fn [B, H, S, D]
    scales: Optional[torch.Tensor]  # nvfp4: float8_e4m3fn [B, H, S, D/16]; fp8: None
    global_scale: torch.Tensor     # fp32 scalar tensor

    @property
    def head_dim(self) -> int:
        return self.data.shape[-1] * (2 if self.fmt == "nvfp4" else 1)


def quantize_kv(x: torch.Tensor, fmt: str = "nvfp4") -> QuantizedKV:
    """Quantize a [B, H, S, D] cache tensor (the engine does this when it appends tokens)."""
    if fmt == "nvfp4":
        from megatron_qrl.quant import nvfp4_quantize

        packed, scales, g = nvfp4_quantize(x)
        return QuantizedKV("nvfp4", packed.contiguous(), scales.contiguous(), g.reshape(()))
    if fmt == "fp8":
        amax = x.detach().abs().amax().float().clamp_min(1e-12)
        scale = amax / 448.0
        return QuantizedKV("fp8", (x.float() / scale).to(torch.float8_e4m3fn).contiguous(), None, scale)
    raise ValueError(f"KV cache format {fmt!r}: use 'nvfp4' or 'fp8'")


def dequantize_kv(kv: QuantizedKV) -> torch.Tensor:
    if kv.fmt == "nvfp4":
        from megatron_qrl.quant import nvfp4_dequantize

        return nvfp4_dequantize(kv.data, kv.scales, kv.global_scale, torch.float32)
    return kv.data.to(torch.float32) * kv.global_scale


# ----------------------------------------------------------------------------------------------------
@triton.jit
def _nib_f32(c):
    """4-bit E2M1 codes (int32) -> fp32 value * 2^-14 (fp16 bit pattern, exact)."""
    h = ((c & 0x7) << 9) | ((c & 0x8) << 12)
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e4m3_f32(u):
    """E4M3 bytes (int32) -> fp32 value * 2^-8 (fp16 bit pattern, exact)."""
    h = ((u & 0x80) << 8) | ((u & 0x7F) << 7)
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _load_kv_halves(base, offs_s, s_mask, sc_base, gsc, BLOCK_S: tl.constexpr, HALF: tl.constexpr,
                    IS_FP4: tl.constexpr, RNE: tl.constexpr):
    """Rows offs_s of one [S, D] cache slice -> (even, odd) head-dim halves, bf16 [BLOCK_S, D/2]."""
    dd = tl.arange(0, HALF)
    if IS_FP4:
        # [BLOCK_S, blocks, 8 bytes]: each scale byte is loaded once and broadcast over its block's 8 code
        # bytes (loading it per byte, 8x over, made the FP4 path 2.7x slower than the FP8 one on an H200)
        nb: tl.constexpr = HALF // 8                       # scale blocks of 16 elements = 8 bytes
        j = tl.arange(0, nb)
        e = tl.arange(0, 8)
        b = tl.load(base + offs_s[:, None, None] * HALF + (j[:, None] * 8 + e[None, :])[None, :, :],
                    mask=s_mask[:, None, None], other=0).to(tl.int32)
        sb = tl.load(sc_base + offs_s[:, None] * nb + j[None, :], mask=s_mask[:, None], other=0).to(tl.int32)
        s = (_e4m3_f32(sb) * (gsc * 4194304.0))[:, :, None]   # * 2^22: undo the 2^-14 and 2^-8 offsets
        ev = tl.reshape(_nib_f32(b & 0xF) * s, (BLOCK_S, HALF))
        od = tl.reshape(_nib_f32(b >> 4) * s, (BLOCK_S, HALF))
    else:   # base: int16 words, each an (even, odd) pair of E4M3 bytes: one contiguous load per row
        w = tl.load(base + offs_s[:, None] * HALF + dd[None, :], mask=s_mask[:, None], other=0).to(tl.int32)
        ev = _e4m3_f32(w & 0xFF) * (gsc * 256.0)
        od = _e4m3_f32((w >> 8) & 0xFF) * (gsc * 256.0)
    return _to_bf16(ev, RNE), _to_bf16(od, RNE)


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr):
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit(do_not_specialize=["s_per_split"])
def _decode_attn_kernel(q_ptr, k_ptr, ks_ptr, kg_ptr, v_ptr, vs_ptr, vg_ptr, lens_ptr, acc_ptr, ml_ptr,
                        HQ, HKV, S_MAX, s_per_split, sm_scale,
                        GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr,
                        NUM_SPLITS: tl.constexpr, IS_FP4: tl.constexpr, DOT_F32: tl.constexpr):
    b = tl.program_id(0)
    hk = tl.program_id(1)
    sp = tl.program_id(2)
    HALF: tl.constexpr = D // 2
    seq_len = tl.load(lens_ptr + b)
    s_begin = sp * s_per_split
    s_end = tl.minimum(s_begin + s_per_split, seq_len)

    g = tl.arange(0, G_PAD)
    g_mask = g < GROUP
    heads = hk * GROUP + g
    dd = tl.arange(0, HALF)
    q_rows = q_ptr + (b * HQ + heads).to(tl.int64)[:, None] * D
    q_ev = tl.load(q_rows + (2 * dd)[None, :], mask=g_mask[:, None], other=0.0).to(tl.bfloat16)
    q_od = tl.load(q_rows + (2 * dd + 1)[None, :], mask=g_mask[:, None], other=0.0).to(tl.bfloat16)

    row = (b * HKV + hk).to(tl.int64) * S_MAX
    k_base = k_ptr + row * HALF                            # uint8 codes (FP4) or int16 byte pairs (FP8)
    v_base = v_ptr + row * HALF
    if IS_FP4:
        ks_base = ks_ptr + row * (D // 16)
        vs_base = vs_ptr + row * (D // 16)
    else:
        ks_base = ks_ptr
        vs_base = vs_ptr
    kg = tl.load(kg_ptr)
    vg = tl.load(vg_ptr)

    m_i = tl.full((G_PAD,), -float("inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc_ev = tl.zeros((G_PAD, HALF), tl.float32)
    acc_od = tl.zeros((G_PAD, HALF), tl.float32)
    for s0 in range(s_begin, s_end, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        s_mask = offs_s < s_end
        k_ev, k_od = _load_kv_halves(k_base, offs_s, s_mask, ks_base, kg, BLOCK_S, HALF, IS_FP4, DOT_F32)
        sc = _dot(q_ev, tl.trans(k_ev), DOT_F32) + _dot(q_od, tl.trans(k_od), DOT_F32)
        sc = tl.where(s_mask[None, :], sc * sm_scale, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ev, v_od = _load_kv_halves(v_base, offs_s, s_mask, vs_base, vg, BLOCK_S, HALF, IS_FP4, DOT_F32)
        pb = _to_bf16(p, DOT_F32)
        acc_ev = acc_ev * alpha[:, None] + _dot(pb, v_ev, DOT_F32)
        acc_od = acc_od * alpha[:, None] + _dot(pb, v_od, DOT_F32)
        m_i = m_new

    out_row = ((b * HQ + heads).to(tl.int64) * NUM_SPLITS + sp)
    acc_rows = acc_ptr + out_row[:, None] * D
    tl.store(acc_rows + (2 * dd)[None, :], acc_ev, mask=g_mask[:, None])
    tl.store(acc_rows + (2 * dd + 1)[None, :], acc_od, mask=g_mask[:, None])
    tl.store(ml_ptr + out_row * 2, m_i, mask=g_mask)
    tl.store(ml_ptr + out_row * 2 + 1, l_i, mask=g_mask)


@triton.jit
def _combine_kernel(acc_ptr, ml_ptr, o_ptr, D: tl.constexpr, NUM_SPLITS: tl.constexpr, RNE: tl.constexpr):
    """Merge the splits' (acc, max, sum) partials in a fixed order; the output in o_ptr's dtype (also used by
    cache_attention.py)."""
    r = tl.program_id(0).to(tl.int64)                  # (batch, q head)
    sp = tl.arange(0, NUM_SPLITS)
    m = tl.load(ml_ptr + (r * NUM_SPLITS + sp) * 2)
    l = tl.load(ml_ptr + (r * NUM_SPLITS + sp) * 2 + 1)
    m_all = tl.max(m, 0)
    w = tl.where(m > -float("inf"), tl.exp(m - m_all), 0.0)
    denom = tl.sum(w * l, 0)
    d = tl.arange(0, D)
    acc = tl.load(acc_ptr + (r * NUM_SPLITS + sp)[:, None] * D + d[None, :])
    out = tl.sum(acc * w[:, None], 0) / denom
    tl.store(o_ptr + r * D + d, _cast_out(out, o_ptr, RNE))


def decode_attention(q: torch.Tensor, k: QuantizedKV, v: QuantizedKV, seq_lens: torch.Tensor,
                     sm_scale: Optional[float] = None, num_splits: Optional[int] = None,
                     block_s: int = 64, num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """softmax(q K^T * sm_scale) V per sequence over its first seq_lens[b] cached positions.

    q [B, H_q, D] (bf16); k, v from quantize_kv over [B, H_kv, S_max, D]; seq_lens int [B] (>= 1).
    Returns [B, H_q, D] bf16. H_q must be a multiple of H_kv (GQA); D a power of two >= 32.
    """
    bsz, hq, d = q.shape
    if k.fmt != v.fmt:
        raise ValueError(f"K is {k.fmt} but V is {v.fmt}; use one cache format per layer")
    _, hkv, s_max, _ = k.data.shape
    if hq % hkv or d != k.head_dim or d < 32 or d & (d - 1):
        raise ValueError(f"unsupported shapes: q {tuple(q.shape)}, cache heads {hkv}, head_dim {k.head_dim}")
    group = hq // hkv
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    if num_splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 8
        num_splits = max(1, min(triton.next_power_of_2(triton.cdiv(2 * sms, bsz * hkv)),
                                triton.next_power_of_2(triton.cdiv(s_max, block_s))))
    num_splits = triton.next_power_of_2(num_splits)
    s_per_split = triton.cdiv(triton.cdiv(s_max, num_splits), block_s) * block_s
    qc = q.contiguous()
    acc = torch.empty((bsz, hq, num_splits, d), device=q.device, dtype=torch.float32)
    ml = torch.empty((bsz, hq, num_splits, 2), device=q.device, dtype=torch.float32)
    fp4 = k.fmt == "nvfp4"

    def u8(t):
        return t.view(torch.uint8)

    def words(t):   # FP4: packed code bytes; FP8: int16 pairs of E4M3 bytes (little-endian: even element low)
        return u8(t) if fp4 else t.view(torch.uint8).view(torch.int16)

    ks = u8(k.scales) if fp4 else k.global_scale
    vs = u8(v.scales) if fp4 else v.global_scale
    kg = k.global_scale.reshape(1).to(torch.float32)
    vg = v.global_scale.reshape(1).to(torch.float32)
    _decode_attn_kernel[(bsz, hkv, num_splits)](
        qc, words(k.data), ks, kg, words(v.data), vs, vg, seq_lens.to(torch.int32).contiguous(), acc, ml,
        hq, hkv, s_max, s_per_split, sm_scale,
        GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)), D=d, BLOCK_S=block_s,
        NUM_SPLITS=num_splits, IS_FP4=fp4, DOT_F32=INTERPRET, num_warps=num_warps, num_stages=num_stages)
    out = torch.empty((bsz, hq, d), device=q.device, dtype=torch.bfloat16)
    _combine_kernel[(bsz * hq,)](acc, ml, out, D=d, NUM_SPLITS=num_splits, RNE=INTERPRET, num_warps=4)
    return out


def decode_attention_reference(q: torch.Tensor, k: QuantizedKV, v: QuantizedKV, seq_lens: torch.Tensor,
                               sm_scale: Optional[float] = None) -> torch.Tensor:
    """Dequantize the cache, then plain softmax attention in fp32 (per sequence, GQA by repetition)."""
    kd, vd = dequantize_kv(k), dequantize_kv(v)
    bsz, hq, d = q.shape
    group = hq // kd.shape[1]
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    out = torch.empty(bsz, hq, d, dtype=torch.float32, device=q.device)
    for b in range(bsz):
        n = int(seq_lens[b])
        kk = kd[b, :, :n].repeat_interleave(group, 0)
        vv = vd[b, :, :n].repeat_interleave(group, 0)
        p = torch.softmax((q[b].float()[:, None, :] @ kk.transpose(1, 2)).squeeze(1) * sm_scale, -1)
        out[b] = (p[:, None, :] @ vv).squeeze(1)
    return out.to(torch.bfloat16)
