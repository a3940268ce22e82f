"""Per-row KV-cache quantization: one scale set per (token, kv-head) row of head_dim values.

The numerics of the engine's quantized KV caches (rollout/kv_cache.py), in one place so that the
dequantized cache (CPU default), the packed cache (kernels/kv_layout.py) and the Triton write kernel
(kernels/kv_quant_write.py) store the same values:
- fp8: e4m3(x / s) with s = amax / 448 (fp32), value = e4m3 * s;
- fp4: NVFP4 along head_dim (blocks of 16, E4M3 block scales, the codec's ops) with the row's own FP32 global
  scale amax / (6 * 448) in place of a per-tensor one (a token's entry does not depend on the batch).
An all-zero row gets amax 1. The divisions by the constants are written `tensor / float`, as they always
were: torch divides on the CPU and multiplies by the fp32 reciprocal on CUDA (the write kernel follows).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from . import e2m1
from .blocks import NVFP4_BLOCK
from .nvfp4 import E4M3_MAX, nvfp4_block_scales, nvfp4_dequantize, nvfp4_scaled

KV_QUANT_FORMATS = ("fp8", "fp4")


@dataclass
class KVRows:
    """Quantized rows in the codec's byte order (fp4: element 2i in the low nibble of byte i)."""

    data: torch.Tensor              # fp4: uint8 [..., D/2]; fp8: float8_e4m3fn [..., D]
    scales: Optional[torch.Tensor]  # fp4: float8_e4m3fn [..., D/16]; fp8: None
    row_scale: torch.Tensor         # fp32 [...]: the row's global scale


def check_head_dim(kv_format: str, head_dim: int) -> None:
    if kv_format == "fp4" and head_dim % NVFP4_BLOCK:
        raise ValueError(f"rollout.kv_cache=fp4 needs head_dim divisible by {NVFP4_BLOCK}, got {head_dim}; "
                         "use kv_cache=fp8 or bf16")


def quantize_kv_rows(x: torch.Tensor, kv_format: str) -> KVRows:
    """x [..., head_dim] (any float dtype) -> its quantized rows, one scale set per row."""
    if kv_format not in KV_QUANT_FORMATS:
        raise ValueError(f"unknown quantized KV cache format '{kv_format}'; use one of {KV_QUANT_FORMATS}")
    check_head_dim(kv_format, x.shape[-1])
    rows = x.float()
    amax = rows.abs().amax(-1, keepdim=True)
    amax = torch.where(amax > 0, amax, torch.ones_like(amax))
    if kv_format == "fp8":
        scale = amax / E4M3_MAX
        return KVRows((rows / scale).to(torch.float8_e4m3fn), None, scale.squeeze(-1))
    global_scale = amax / (e2m1.E2M1_MAX * E4M3_MAX)
    scales = nvfp4_block_scales(rows, global_scale)
    codes = e2m1.round_nearest(nvfp4_scaled(rows, scales, global_scale))
    return KVRows(e2m1.pack_nibbles(codes), scales, global_scale.squeeze(-1))


def dequantize_kv_rows(q: KVRows) -> torch.Tensor:
    """The float32 values of quantized rows."""
    gs = q.row_scale.unsqueeze(-1)
    if q.scales is None:
        return q.data.float() * gs
    return nvfp4_dequantize(q.data, q.scales, gs, dtype=torch.float32)
