"""Quantize a decode step's K and V rows into the packed KV cache (kernels/kv_layout.py) in one launch.

One program per (row, kv head) quantizes that head's key and value (head_dim values each) with the
numerics of megatron_qrl/quant/kv_rows.py and writes codes, block scales and the row scale at
(slots[b], head, positions[b]). No host synchronisation: CUDA graphs capture it. Reference: kv_layout.store
(the torch codec), byte for byte, on the CPU (interpreter) and on the GPU:
- divisions are correctly rounded (div_rn) like torch's tensor / tensor; the row scale's division by a
  constant follows the device like torch's tensor / float (the CPU divides, CUDA multiplies by the fp32
  reciprocal): RECIP is set from the tensors' device;
- fp32 -> E4M3 and E2M1 rounding with integer / magic-number arithmetic (kernels/fp4_quant.py helpers): the
  interpreter's float -> fp8 cast rounds unlike the GPU's; the fp8 sign is the float's sign bit (torch's
  cast keeps -0.0), the fp4 sign is z < 0 (the codec's);
- bf16 inputs are widened by moving their bits (the interpreter's cast loses bf16 subnormals).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_qrl.quant.nvfp4 import E4M3_MAX

from .fp4_quant import _e2m1_nearest, _f32_to_e4m3, _nvfp4_block_scale
from .kv_layout import PackedKV

FP4_ROW_DIV = 6.0 * E4M3_MAX      # global scale = amax / (6 * 448)


def _f32_reciprocal(d: float) -> float:
    """RN_fp32(1 / d), as torch's CUDA division by a Python float computes it."""
    return float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(d, dtype=torch.float32))


@triton.jit
def _load_row(ptr, offs):
    x = tl.load(ptr + offs)
    if x.dtype == tl.bfloat16:
        x = (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _row_scale(amax, DIV: tl.constexpr, INV: tl.constexpr, RECIP: tl.constexpr):
    """amax / DIV as torch's `tensor / float` computes it on the tensors' device (module docstring)."""
    amax = tl.where(amax > 0.0, amax, 1.0)
    if RECIP:
        return amax * INV
    return tl.math.div_rn(amax, amax * 0.0 + DIV)          # DIV as an fp32 tensor (amax is finite)


@triton.jit
def _quantize_store_fp4(src_ptr, codes_ptr, scales_ptr, rs_ptr, row, D: tl.constexpr, INV: tl.constexpr,
                        RECIP: tl.constexpr):
    """One row of D values -> kernel-packed codes [D/2], prepared block scales [D/16], its global scale."""
    NG: tl.constexpr = D // 32                  # 32-element packing groups; block 2g + h = elements 32g + 16h + j
    gi = tl.arange(0, NG)[:, None, None]
    j = tl.arange(0, 16)[None, :, None]
    h = tl.arange(0, 2)[None, None, :]
    x = _load_row(src_ptr, gi * 32 + h * 16 + j)                                  # [NG, 16, 2]
    gs = _row_scale(tl.max(tl.max(tl.max(tl.abs(x), 2), 1), 0), 2688.0, INV, RECIP)
    bits, sval = _nvfp4_block_scale(tl.max(tl.abs(x), 1), gs)                     # [NG, 2]
    z = tl.math.div_rn(x, tl.broadcast_to((sval * gs)[:, None, :], x.shape))
    code = _e2m1_nearest(z, 2) | tl.where(z < 0.0, 8, 0)
    a, b = tl.split(code)                                                          # low / high element, [NG, 16]
    byte = (b >> 3) | ((a & 7) << 1) | ((b & 7) << 4) | ((a >> 3) << 7)
    tl.store(codes_ptr + row * (D // 2) + tl.arange(0, NG)[:, None] * 16 + tl.arange(0, 16)[None, :],
             byte.to(tl.uint8))
    prep = ((sval * 32.0).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) >> 7) & 0xFF
    tl.store(scales_ptr + row * (D // 16) + tl.arange(0, NG)[:, None] * 2 + tl.arange(0, 2)[None, :],
             prep.to(tl.uint8))
    tl.store(rs_ptr + row, gs)


@triton.jit
def _quantize_store_fp8(src_ptr, codes_ptr, rs_ptr, row, D: tl.constexpr, INV: tl.constexpr, RECIP: tl.constexpr):
    """One row of D values -> E4M3 bytes [D] and its scale."""
    d = tl.arange(0, D)
    x = _load_row(src_ptr, d)
    scale = _row_scale(tl.max(tl.abs(x), 0), 448.0, INV, RECIP)
    y = tl.math.div_rn(x, tl.full(x.shape, 1.0, tl.float32) * scale)
    mag, _ = _f32_to_e4m3(tl.abs(y))
    sign = (y.to(tl.int32, bitcast=True) >> 24) & 0x80
    tl.store(codes_ptr + row * D + d, (mag | sign).to(tl.uint8))
    tl.store(rs_ptr + row, scale)


@triton.jit
def _quantize_write_kernel(k_ptr, v_ptr, slots_ptr, pos_ptr, kc_ptr, ks_ptr, kr_ptr, vc_ptr, vs_ptr, vr_ptr,
                           stride_kb, stride_kh, stride_vb, stride_vh, H, L,
                           D: tl.constexpr, IS_FP4: tl.constexpr, INV: tl.constexpr, RECIP: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    pos = tl.load(pos_ptr + b).to(tl.int64)
    row = (slot * H + g) * L + pos
    k_src = k_ptr + b * stride_kb + g * stride_kh
    v_src = v_ptr + b * stride_vb + g * stride_vh
    if IS_FP4:
        _quantize_store_fp4(k_src, kc_ptr, ks_ptr, kr_ptr, row, D, INV, RECIP)
        _quantize_store_fp4(v_src, vc_ptr, vs_ptr, vr_ptr, row, D, INV, RECIP)
    else:
        _quantize_store_fp8(k_src, kc_ptr, kr_ptr, row, D, INV, RECIP)
        _quantize_store_fp8(v_src, vc_ptr, vr_ptr, row, D, INV, RECIP)


def quantize_write(key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                   k_cache: PackedKV, v_cache: PackedKV) -> None:
    """Quantize key / value [B, H, D] (head_dim contiguous; bf16, fp16 or fp32) and store row b's heads at
    (slots[b], :, positions[b]) of the packed caches. slots / positions: int [B] device tensors (not
    checked: no host sync). One launch for K and V."""
    B, H, D = key.shape
    if value.shape != key.shape or key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError(f"key / value must be [B, H, D] with contiguous heads, got {tuple(key.shape)} / "
                         f"{tuple(value.shape)}")
    if k_cache.fmt != v_cache.fmt or k_cache.codes.shape != v_cache.codes.shape:
        raise ValueError("K and V caches must share one format and shape")
    _, hc, L, _ = k_cache.codes.shape
    if hc != H or k_cache.head_dim != D:
        raise ValueError(f"rows [B, {H}, {D}] do not fit a cache of {hc} heads, head_dim {k_cache.head_dim}")
    if B == 0:
        return
    fp4 = k_cache.fmt == "fp4"
    inv = _f32_reciprocal(FP4_ROW_DIV if fp4 else E4M3_MAX)

    def scales(c):
        return c.scales if fp4 else c.codes
    _quantize_write_kernel[(B, H)](
        key, value, slots, positions, k_cache.codes, scales(k_cache), k_cache.row_scale, v_cache.codes,
        scales(v_cache), v_cache.row_scale, key.stride(0), key.stride(1), value.stride(0), value.stride(1), H, L,
        D=D, IS_FP4=fp4, INV=inv, RECIP=key.is_cuda, num_warps=1 if D <= 128 else 2)
