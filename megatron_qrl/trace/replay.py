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


# ---------------------------------------------------------------------------------------------------------
# Device-side replay of gathered guide rows (trace/device_guides.py): no host synchronisation
# ---------------------------------------------------------------------------------------------------------
_POPCOUNT: dict = {}


def _popcount_sum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int64 0-dim: the number of differing bits of two uint8 tensors."""
    table = _POPCOUNT.get(a.device)
    if table is None:
        table = _POPCOUNT[a.device] = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.int64,
                                                   device=a.device)
    return table.index_select(0, (a ^ b).reshape(-1).to(torch.int64)).sum()


def _guided_rows(x2: torch.Tensor, bits, scales, gs, fallback_shift: float):
    """(values, fallback count, mismatch count): guided NVFP4 with one global scale per row; device tensors."""
    from megatron_qrl.quant import GuidedRounding, mantissa_bits

    guide = GuidedRounding(bits, scales, gs)
    if x2.is_cuda:
        from megatron_qrl.kernels import use_triton

        if use_triton(x2):
            from megatron_qrl.kernels.fp4_fake_quant import nvfp4_fake_quant_triton

            return nvfp4_fake_quant_triton(x2, guide, fallback_shift=fallback_shift, check_finite=False,
                                           return_mismatch=True)
    codes, fallback = guided_codes(x2, guide, fallback_shift)
    values = code_values(x2.device)[codes.long()]
    per_block = scales.to(torch.float32) * _row_scale(gs, x2)
    out = (values.reshape(*values.shape[:-1], -1, BLOCK) * per_block.unsqueeze(-1)).reshape(values.shape)
    mismatch = (mantissa_bits(codes) != unpack_bits(bits)).sum()
    return out.to(x2.dtype), fallback.sum(), mismatch


def replay_rows(x: torch.Tensor, guide, own_scales: torch.Tensor, fallback_shift: float = 0.25,
                stats: Optional[dict] = None) -> torch.Tensor:
    """dequant(guided quant(x)) of gathered guide rows (a device_guides.GuidedRows), no gradient, no host sync.

    own_scales (fp32 [rows, 1] or 0-dim): the trainer's own NVFP4 global scale of every row (its tensor's,
    or its expert's). Rows the cache lacks (guide.found False) round to nearest with those scales, as
    TraceGuide.complete_with_nearest does; with guide.counters set, the code mismatch before guidance
    (trainer-nearest's mantissa bits vs the cache's) and after it are added to those device counters over
    the rows the cache holds (trace/metrics.py). stats gets 'guided_fallback' as a device tensor.
    """
    with torch.no_grad():
        from megatron_qrl.models.expert_quant import fake_quant_rows

        K = x.shape[-1]
        x2 = x.detach().reshape(-1, K)
        n = x2.shape[0]
        own_gs = torch.as_tensor(own_scales, dtype=torch.float32, device=x.device)
        own_gs = own_gs.reshape(1, 1).expand(n, 1).contiguous() if own_gs.numel() == 1 else own_gs.reshape(n, 1)
        bits, scales = guide.bits.reshape(n, -1), guide.scales.reshape(n, -1)
        gs = guide.global_scale.reshape(n, 1)
        counters = getattr(guide, "counters", None)
        own_bits = None
        if guide.any_missing or counters is not None:
            _, (_, own_block, own_bits) = fake_quant_rows(x2, "nvfp4", own_gs, capture=True)
            if guide.any_missing:
                f = guide.found.reshape(n, 1)
                bits = torch.where(f, bits, own_bits)
                scales = torch.where(f, scales.view(torch.uint8), own_block.view(torch.uint8)).view(torch.float8_e4m3fn)
                gs = torch.where(f, gs, own_gs)
        out, fallback, mismatch = _guided_rows(x2, bits, scales, gs, fallback_shift)
        if stats is not None:
            stats["guided_fallback"] = stats.get("guided_fallback", 0) + fallback.to(torch.int64)
            stats["guided_elements"] = stats.get("guided_elements", 0) + x.numel()
        if counters is not None:
            counters.add_device_mismatch(_popcount_sum(own_bits, bits), mismatch.to(torch.int64), guide.n_found * K)
        return out.view(x.shape)
