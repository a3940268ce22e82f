"""Guided replay with one global scale per row: the codec's guided NVFP4 path, broadcast per row.

A trainer tensor (all tokens of a micro-batch for one site) mixes rows that the engine quantized in
different calls (prefill, each decode step), hence with different FP32 global scales. The codec's
`nvfp4_quantize` takes one 0-dim global scale; this module runs the very same functions
(`nvfp4_scaled`, `round_guided`, the code table and the dequant product order) with the global scale
broadcast per row ([..., 1]), so per row the bytes equal the codec's. A 0-dim scale gives exactly
`fake_quant(x, guide=...)`.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_qrl.quant import code_values, round_guided, unpack_bits
from megatron_qrl.quant.nvfp4 import BLOCK, nvfp4_scaled

from .errors import MisshapenCacheError


def _row_scale(global_scale: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    if global_scale is None:
        raise ValueError("this guide has rows the TRACE cache lacks (global_scale is None); call "
                         "guide.complete_with_nearest(x) before replaying it")
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
    if gs.numel() == 1:
        return gs.reshape(())
    if gs.numel() != x[..., 0].numel():
        raise MisshapenCacheError(f"{gs.numel()} global scales for {x[..., 0].numel()} rows of x {tuple(x.shape)}")
    return gs.reshape(*x.shape[:-1], 1)


def guided_codes(x: torch.Tensor, guide, fallback_shift: float = 0.25, stats: Optional[dict] = None):
    """(codes uint8 [..., K], fallback bool [..., K]) of guided rounding with per-row global scales."""
    kb = x.shape[-1] // BLOCK
    if x.shape[-1] % BLOCK or tuple(guide.scales.shape) != (*x.shape[:-1], kb) or \
            tuple(guide.bits.shape) != (*x.shape[:-1], x.shape[-1] // 8):
        raise MisshapenCacheError(f"guide bits {tuple(guide.bits.shape)} / scales {tuple(guide.scales.shape)} do "
                                  f"not match x {tuple(x.shape)} (expect [..., K/8] and [..., K/{BLOCK}])")
    gs = _row_scale(guide.global_scale, x)
    z = nvfp4_scaled(x, guide.scales, gs)
    codes, fallback = round_guided(z, unpack_bits(guide.bits), fallback_shift)
    if stats is not None:
        stats["guided_fallback"] = stats.get("guided_fallback", 0) + int(fallback.sum())
        stats["guided_elements"] = stats.get("guided_elements", 0) + fallback.numel()
    return codes, fallback


def guided_quant_dequant(x: torch.Tensor, guide, fallback_shift: float = 0.25,
                         stats: Optional[dict] = None) -> torch.Tensor:
    """dequant(guided quant(x)) in x's dtype, no gradient; guide.global_scale 0-dim or one per row."""
    with torch.no_grad():
        codes, _ = guided_codes(x, guide, fallback_shift, stats)
        values = code_values(x.device)[codes.long()]
        per_block = guide.scales.to(torch.float32) * _row_scale(guide.global_scale, x)
        out = values.reshape(*values.shape[:-1], -1, BLOCK) * per_block.unsqueeze(-1)
        return out.reshape(values.shape).to(x.dtype)


def guided_fake_quant(x: torch.Tensor, guide, fallback_shift: float = 0.25,
                      stats: Optional[dict] = None) -> torch.Tensor:
    """Straight-through guided fake quant: forward = guided_quant_dequant(x), gradient = identity."""
    return x + (guided_quant_dequant(x, guide, fallback_shift, stats) - x).detach()
