"""MXFP4 (OCP MX): E2M1 codes in blocks of 32 along K, one E8M0 (power-of-two) scale per block.

Scale rule (ModelOpt's MXFP4QTensor, made exact): e = ceil(log2(block_amax / 6)), clamped to [-127, 127],
stored as uint8 e + 127; an all-zero block stores 0 (2^-127). Because 2^e >= amax/6 no element saturates.
We compute the ceil-log2 from the float's exponent bits instead of torch.log2, which can round a value
just above a power of two down to it. Codes use the same nearest-even rounding as NVFP4.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import e2m1
from .blocks import MXFP4_BLOCK as BLOCK
from .validate import check_input, check_packed


def mxfp4_block_exponents(x: torch.Tensor) -> torch.Tensor:
    """int32 [..., K/32]: the unbiased shared exponent of each block."""
    blocks = x.detach().reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1).float()
    d = amax / torch.tensor(e2m1.E2M1_MAX, dtype=torch.float32, device=amax.device)  # true division on CUDA too
    mant, exp = torch.frexp(d)  # d = mant * 2^exp, mant in [0.5, 1)
    ceil_log2 = torch.where(mant == 0.5, exp - 1, exp)
    ceil_log2 = torch.where(d > 0, ceil_log2, torch.full_like(ceil_log2, -127))
    return ceil_log2.clamp(-127, 127).to(torch.int32)


def mxfp4_quantize(x: torch.Tensor, rounding: str = "nearest", *, scales: Optional[torch.Tensor] = None,
                   trace_bits: Optional[torch.Tensor] = None, capture: bool = False,
                   generator: Optional[torch.Generator] = None, fallback_shift: float = 0.25,
                   stats: Optional[dict] = None):
    """Quantize x to packed MXFP4: (packed uint8 [..., K/2], E8M0 scales uint8 [..., K/32]) [+ bits]."""
    check_input(x, BLOCK, "mxfp4_quantize")
    e2m1.check_rounding(rounding)
    if scales is None:
        if rounding == "guided":
            raise ValueError("rounding='guided' needs the rollout's E8M0 scales: pass scales=")
        scales = (mxfp4_block_exponents(x) + 127).to(torch.uint8)
    elif scales.dtype != torch.uint8 or tuple(scales.shape) != (*x.shape[:-1], x.shape[-1] // BLOCK):
        raise ValueError(f"scales must be uint8 {(*x.shape[:-1], x.shape[-1] // BLOCK)}, got "
                         f"{scales.dtype} {tuple(scales.shape)}")
    packed, bits = e2m1.encode(_scaled(x, scales), rounding, trace_bits, generator, fallback_shift, stats, capture)
    return (packed, scales, bits) if capture else (packed, scales)


def _scale_values(scales: torch.Tensor) -> torch.Tensor:
    return torch.exp2(scales.to(torch.float32) - 127.0)


def _scaled(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    blocks = x.detach().reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK).float()
    return (blocks / _scale_values(scales).unsqueeze(-1)).reshape(x.shape)


def mxfp4_dequantize(packed: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    check_packed(packed, scales, BLOCK, "mxfp4_dequantize")
    values = e2m1.code_values(packed.device)[e2m1.unpack_nibbles(packed).long()]
    out = values.reshape(*values.shape[:-1], -1, BLOCK) * _scale_values(scales).unsqueeze(-1)
    return out.reshape(values.shape).to(dtype)
