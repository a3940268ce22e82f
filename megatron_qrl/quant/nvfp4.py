"""NVFP4: E2M1 codes in blocks of 16 along K, one E4M3 scale per block, one FP32 scale per tensor.

The operation order is ModelOpt's (`NVFP4QTensor`), so codes and scales agree with it bit for bit:
    s_global = amax(|x|) / (6 * 448)
    s_block  = e4m3(clamp(block_amax / (6 * s_global), 2^-9, 448))     (0 -> 1.0 before the cast)
    code     = round(x / (f32(s_block) * s_global))                     (nearest: ties to even)
Every other path (Triton kernels, export, weight sync) must reproduce these bytes.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import e2m1
from .blocks import NVFP4_BLOCK as BLOCK
from .validate import check_input, check_packed

E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0 ** -9


def nvfp4_global_scale(x: torch.Tensor) -> torch.Tensor:
    """Per-tensor FP32 scale. An all-zero tensor gets 1/(6*448) (ModelOpt would produce NaN scales)."""
    amax = x.detach().abs().amax().float()
    amax = torch.where(amax > 0, amax, torch.ones_like(amax))
    # divide by a tensor: PyTorch's CUDA kernel turns division by a Python scalar into a multiply by its
    # reciprocal, which can land 1 ulp away from the CPU's (and the Triton kernels') true quotient
    return amax / torch.tensor(e2m1.E2M1_MAX * E4M3_MAX, dtype=torch.float32, device=amax.device)


def nvfp4_global_scales(amax: torch.Tensor) -> torch.Tensor:
    """`nvfp4_global_scale` of many tensors at once, from their amaxes (fp32 [n], e.g. one per expert):
    the same elementwise operations, so each entry equals the 0-dim scale of its own tensor."""
    amax = amax.detach().float()
    amax = torch.where(amax > 0, amax, torch.ones_like(amax))
    return amax / torch.tensor(e2m1.E2M1_MAX * E4M3_MAX, dtype=torch.float32, device=amax.device)


def nvfp4_block_scales(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """E4M3 scale per block of 16 along the last dim: float8_e4m3fn [..., K/16]."""
    blocks = x.detach().reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    block_amax = blocks.abs().amax(dim=-1).float()
    scale = block_amax / (e2m1.E2M1_MAX * global_scale.float())
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return scale.clamp(min=E4M3_MIN_SUBNORMAL, max=E4M3_MAX).to(torch.float8_e4m3fn)


def nvfp4_scaled(x: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """z = x / (s_block * s_global) in float32, shaped like x."""
    blocks = x.detach().reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK).float()
    denom = scales.to(torch.float32) * global_scale.float()
    return (blocks / denom.unsqueeze(-1)).reshape(x.shape)


def _as_global_scale(global_scale, x: torch.Tensor) -> torch.Tensor:
    """fp32 0-dim, or one scale per row ([..., 1]) for guided replays of rows from several engine calls."""
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
    if gs.numel() == 1:
        return gs.reshape(())
    if tuple(gs.shape) == (*x.shape[:-1], 1):
        return gs
    raise ValueError(f"global_scale must be a scalar or one per row {(*x.shape[:-1], 1)}, got {tuple(gs.shape)}")


def nvfp4_quantize(x: torch.Tensor, global_scale: Optional[torch.Tensor] = None, rounding: str = "nearest", *,
                   scales: Optional[torch.Tensor] = None, trace_bits: Optional[torch.Tensor] = None,
                   capture: bool = False, generator: Optional[torch.Generator] = None, fallback_shift: float = 0.25,
                   stats: Optional[dict] = None):
    """Quantize x (fp32/fp16/bf16, last dim a multiple of 16) to packed NVFP4.

    Returns (packed uint8 [..., K/2], scales float8_e4m3fn [..., K/16], global_scale fp32 0-dim) and, with
    capture=True, a 4th item: the mantissa bit of every chosen code packed 8 per byte, uint8 [..., K/8].

    rounding="guided" replays a rollout: pass the rollout's `scales`, `global_scale` and packed
    `trace_bits`; elements too far from the rollout's choice fall back to nearest, counted in
    stats["guided_fallback"] when a dict is given. rounding="stochastic" draws from `generator`.
    """
    check_input(x, BLOCK, "nvfp4_quantize")
    e2m1.check_rounding(rounding)
    if global_scale is None:
        if rounding == "guided":
            raise ValueError("rounding='guided' needs the rollout's global_scale (and scales, trace_bits)")
        global_scale = nvfp4_global_scale(x)
    global_scale = _as_global_scale(global_scale, x)
    if scales is None:
        if rounding == "guided":
            raise ValueError("rounding='guided' needs the rollout's block scales: pass scales=")
        scales = nvfp4_block_scales(x, global_scale)
    elif scales.shape != (*x.shape[:-1], x.shape[-1] // BLOCK) or scales.dtype != torch.float8_e4m3fn:
        raise ValueError(f"scales must be float8_e4m3fn {(*x.shape[:-1], x.shape[-1] // BLOCK)}, got "
                         f"{scales.dtype} {tuple(scales.shape)}")
    packed, bits = e2m1.encode(nvfp4_scaled(x, scales, global_scale), rounding, trace_bits, generator,
                               fallback_shift, stats, capture)
    return (packed, scales, global_scale, bits) if capture else (packed, scales, global_scale)


def nvfp4_dequantize(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """codes * f32(s_block) * s_global, computed in float32 then cast to dtype."""
    check_packed(packed, scales, BLOCK, "nvfp4_dequantize")
    values = e2m1.code_values(packed.device)[e2m1.unpack_nibbles(packed).long()]
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=packed.device)
    per_block = scales.to(torch.float32) * (gs.reshape(()) if gs.numel() == 1 else gs)
    out = values.reshape(*values.shape[:-1], -1, BLOCK) * per_block.unsqueeze(-1)
    return out.reshape(values.shape).to(dtype)


def nvfp4_codes(packed: torch.Tensor) -> torch.Tensor:
    """Unpacked 4-bit codes, uint8 [..., K]."""
    return e2m1.unpack_nibbles(packed)
