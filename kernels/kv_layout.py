"""The packed KV cache: its byte layout (what the decode-attention kernel streams) and its torch codec.

Per layer, K and V alike, head-major, so that one (slot, kv-head) stream of positions is contiguous:
  fp4: codes     uint8 [slots, H, L, D/2]   NVFP4 codes in the W4A16 kernel packing (layouts.py: per
                                            32-element group, byte j holds elements j and 16 + j, bits
                                            placed for a one-shift float16 decode)
       scales    uint8 [slots, H, L, D/16]  E4M3 block scales, prepared (fp16 bits of s * 2^5 >> 7, layouts.py)
       row_scale fp32  [slots, H, L]        the row's global scale
  fp8: codes     uint8 [slots, H, L, D]     E4M3 bytes
       row_scale fp32  [slots, H, L]        the row's scale
That is 0.5 + 1/16 + 4/D bytes per value for fp4 (76 B per row at D = 128, 3.4x less than bf16) and
1 + 4/D for fp8 (132 B, 1.9x less). The values are megatron_qrl/quant/kv_rows.py's: `gather` dequantizes
in float32 and casts, so it returns exactly what the dequantized cache would hold.
Torch only (no Triton): the engine's prefill writes with `store`, its eager path reads with `gather`;
kernels/kv_quant_write.py writes decode steps, kernels/kv_decode_attention.py reads.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch

from megatron_qrl.quant.kv_rows import KVRows, dequantize_kv_rows, quantize_kv_rows

from .layouts import PACK_GROUP, decode_nvfp4_scales, encode_nvfp4_scales, permute_nibbles, unpermute_nibbles


def packed_supported(kv_format: str, head_dim: int) -> bool:
    """Whether the packed cache (and its attention kernel) takes this format and head_dim: a power of two,
    >= 32 for fp4 (two 16-wide dot halves, whole 32-element packing groups), >= 16 for fp8."""
    if kv_format not in ("fp4", "fp8") or head_dim & (head_dim - 1):
        return False
    return head_dim >= (PACK_GROUP if kv_format == "fp4" else 16)


@dataclass
class PackedKV:
    """One layer's K (or V) in the packed layout (module docstring)."""

    fmt: str                           # "fp4" | "fp8"
    codes: torch.Tensor
    scales: Optional[torch.Tensor]     # fp4 only
    row_scale: torch.Tensor

    @classmethod
    def zeros(cls, fmt: str, slots: int, heads: int, length: int, head_dim: int, device) -> "PackedKV":
        if not packed_supported(fmt, head_dim):
            raise ValueError(f"the packed KV cache does not take {fmt} with head_dim {head_dim} "
                             "(a power of two, >= 32 for fp4, >= 16 for fp8)")
        lead = (slots, heads, length)
        fp4 = fmt == "fp4"
        return cls(fmt, torch.zeros(*lead, head_dim // 2 if fp4 else head_dim, dtype=torch.uint8, device=device),
                   torch.zeros(*lead, head_dim // 16, dtype=torch.uint8, device=device) if fp4 else None,
                   torch.zeros(lead, dtype=torch.float32, device=device))

    @property
    def head_dim(self) -> int:
        return self.codes.shape[-1] * (2 if self.fmt == "fp4" else 1)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.scales, self.row_scale) if t is not None]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def zero_(self, slot: Optional[int] = None) -> None:
        for t in self.tensors():
            (t if slot is None else t[slot]).zero_()

    def clone(self) -> "PackedKV":
        return PackedKV(**{f.name: (v.clone() if isinstance(v, torch.Tensor) else v)
                           for f in fields(self) for v in [getattr(self, f.name)]})


def encode_rows(q: KVRows, fmt: str) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Codec bytes -> cache bytes (codes, scales) of the same rows (no host synchronisation)."""
    if fmt == "fp8":
        return q.data.view(torch.uint8), None
    return permute_nibbles(q.data), encode_nvfp4_scales(q.scales, check=False)


def decode_rows(codes: torch.Tensor, scales: Optional[torch.Tensor], row_scale: torch.Tensor, fmt: str) -> KVRows:
    """Cache bytes -> codec rows (inverse of encode_rows)."""
    if fmt == "fp8":
        return KVRows(codes.view(torch.float8_e4m3fn), None, row_scale)
    return KVRows(unpermute_nibbles(codes), decode_nvfp4_scales(scales), row_scale)


def store(kv: PackedKV, slots: torch.Tensor, positions: torch.Tensor, x: torch.Tensor) -> None:
    """Quantize x [T, H, D] (token t's heads) into kv at (slots[t], :, positions[t])."""
    q = quantize_kv_rows(x, kv.fmt)
    codes, scales = encode_rows(q, kv.fmt)
    kv.codes[slots, :, positions] = codes
    if scales is not None:
        kv.scales[slots, :, positions] = scales
    kv.row_scale[slots, :, positions] = q.row_scale


def gather(kv: PackedKV, slots: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """Dequantized values [B, length, H, D] of the given slots' first `length` positions, in dtype."""
    sl = (slots, slice(None), slice(0, length))
    rows = decode_rows(kv.codes[sl], kv.scales[sl] if kv.scales is not None else None, kv.row_scale[sl], kv.fmt)
    return dequantize_kv_rows(rows).to(dtype).transpose(1, 2)
