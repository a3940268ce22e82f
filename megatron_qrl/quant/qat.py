"""QAT fake quantization with a straight-through gradient: y = x + (dequant(quant(x)) - x).detach().

One entry point for weights and activations, both formats, and all rounding modes, so the trainer's
forward uses exactly the codec that the engine and the exporter use.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .mxfp4 import mxfp4_dequantize, mxfp4_quantize
from .nvfp4 import nvfp4_dequantize, nvfp4_quantize


@dataclass
class GuidedRounding:
    """A rollout's rounding record for one tensor: packed mantissa bits and its scales."""

    bits: torch.Tensor                  # uint8 [..., K/8]
    scales: torch.Tensor                # float8_e4m3fn [..., K/16] (NVFP4) or uint8 [..., K/32] (MXFP4)
    global_scale: Optional[torch.Tensor] = None  # fp32 0-dim (NVFP4 only)


def quant_dequant(x: torch.Tensor, fmt: str = "nvfp4", rounding: str = "nearest",
                  guide: Optional[GuidedRounding] = None, global_scale: Optional[torch.Tensor] = None,
                  generator: Optional[torch.Generator] = None, fallback_shift: float = 0.25,
                  stats: Optional[dict] = None) -> torch.Tensor:
    """dequant(quant(x)) in x's dtype, no gradient."""
    with torch.no_grad():
        if fmt == "nvfp4":
            if guide is not None:
                packed, scales, gs = nvfp4_quantize(x, guide.global_scale, "guided", scales=guide.scales,
                                                    trace_bits=guide.bits, fallback_shift=fallback_shift,
                                                    stats=stats)
            else:
                packed, scales, gs = nvfp4_quantize(x, global_scale, rounding, generator=generator)
            return nvfp4_dequantize(packed, scales, gs, dtype=x.dtype)
        if fmt == "mxfp4":
            if guide is not None:
                packed, scales = mxfp4_quantize(x, "guided", scales=guide.scales, trace_bits=guide.bits,
                                                fallback_shift=fallback_shift, stats=stats)
            else:
                packed, scales = mxfp4_quantize(x, rounding, generator=generator)
            return mxfp4_dequantize(packed, scales, dtype=x.dtype)
        if fmt == "bf16":
            return x.detach().clone()
        raise ValueError(f"unknown FP4 format '{fmt}'; use nvfp4, mxfp4 or bf16")


def fake_quant(x: torch.Tensor, fmt: str = "nvfp4", rounding: str = "nearest",
               guide: Optional[GuidedRounding] = None, global_scale: Optional[torch.Tensor] = None,
               generator: Optional[torch.Generator] = None, fallback_shift: float = 0.25,
               stats: Optional[dict] = None) -> torch.Tensor:
    """Straight-through fake quant: forward value = dequant(quant(x)), gradient = identity."""
    q = quant_dequant(x, fmt, rounding, guide, global_scale, generator, fallback_shift, stats)
    return x + (q - x).detach()
