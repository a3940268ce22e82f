"""Elements per block scale along K, per FP4 format: the one definition of the block sizes.

Torch-free (like quant/__init__, which imports lazily), so config validation reads it without torch.
"""
from __future__ import annotations

NVFP4_BLOCK = 16     # one E4M3 scale per 16 elements (and one FP32 global scale per tensor)
MXFP4_BLOCK = 32     # one E8M0 (power-of-two) scale per 32 elements
BLOCK_SIZES = {"nvfp4": NVFP4_BLOCK, "mxfp4": MXFP4_BLOCK}


def block_size(fmt: str) -> int:
    """Elements per block scale of an FP4 format ('nvfp4': 16, 'mxfp4': 32)."""
    if fmt not in BLOCK_SIZES:
        raise ValueError(f"unknown FP4 format '{fmt}'; use one of {tuple(BLOCK_SIZES)}")
    return BLOCK_SIZES[fmt]


__all__ = ["BLOCK_SIZES", "MXFP4_BLOCK", "NVFP4_BLOCK", "block_size"]
