"""Bit-level packing shared by the cache format: row-set masks and narrow integer indices.

Both use the codec's bit order (`pack_bits`: element 8j+i is bit i of byte j, LSB first), so every packed
array in a TRACE cache reads the same way.
"""
from __future__ import annotations

import torch

from megatron_qrl.quant import pack_bits, unpack_bits


def _pad_to_byte(bits: torch.Tensor) -> torch.Tensor:
    pad = (-bits.numel()) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    return bits


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """bool [n] -> uint8 [ceil(n/8)]."""
    return pack_bits(_pad_to_byte(mask.reshape(-1).to(torch.uint8)))


def unpack_mask(packed: torch.Tensor, n: int) -> torch.Tensor:
    """uint8 [ceil(n/8)] -> bool [n]."""
    return unpack_bits(packed.reshape(-1))[:n].bool()


def index_width(num_values: int) -> int:
    """Bits per index into a table of `num_values` entries (0 when there is at most one entry)."""
    return 0 if num_values <= 1 else (num_values - 1).bit_length()


def pack_indices(idx: torch.Tensor, width: int) -> torch.Tensor:
    """int [n] in [0, 2^width) -> uint8 [ceil(n*width/8)]: index i occupies bits [i*width, (i+1)*width)."""
    if width == 0 or idx.numel() == 0:
        return torch.zeros(0, dtype=torch.uint8, device=idx.device)
    shifts = torch.arange(width, device=idx.device, dtype=torch.int64)
    bits = (idx.reshape(-1, 1).to(torch.int64) >> shifts) & 1
    return pack_bits(_pad_to_byte(bits.reshape(-1)))


def unpack_indices(packed: torch.Tensor, n: int, width: int) -> torch.Tensor:
    """Inverse of pack_indices: int64 [n]."""
    if width == 0:
        return torch.zeros(n, dtype=torch.int64, device=packed.device)
    bits = unpack_bits(packed.reshape(-1))[: n * width].to(torch.int64).reshape(n, width)
    weights = 1 << torch.arange(width, device=packed.device, dtype=torch.int64)
    return (bits * weights).sum(-1)


def packed_index_bytes(n: int, width: int) -> int:
    return (n * width + 7) // 8
