"""Input checks shared by the codecs: every bad input gets an error that says what is wrong and the fix."""
from __future__ import annotations

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_input(x: torch.Tensor, block: int, where: str, check_finite: bool = True) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{where}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{where}: dtype {x.dtype} is not supported; convert to float32, float16 or bfloat16")
    if x.dim() == 0 or x.numel() == 0:
        raise ValueError(f"{where}: empty or 0-dim tensor (shape {tuple(x.shape)}); nothing to quantize")
    if x.shape[-1] % block:
        raise ValueError(f"{where}: last dimension {x.shape[-1]} is not a multiple of the block size {block}; "
                         f"pad K to a multiple of {block} or quantize a different layout")
    if check_finite and not bool(torch.isfinite(x).all()):
        n_nan = int(torch.isnan(x).sum())
        n_inf = int(torch.isinf(x).sum())
        raise ValueError(f"{where}: input holds {n_nan} NaN and {n_inf} Inf values; FP4 cannot encode them "
                         "(find where they come from: overflow, bad data, a diverged step)")


def check_packed(packed: torch.Tensor, scales: torch.Tensor, block: int, where: str) -> None:
    if packed.dtype != torch.uint8:
        raise TypeError(f"{where}: packed codes must be uint8, got {packed.dtype}")
    if packed.numel() == 0:
        raise ValueError(f"{where}: empty packed tensor")
    k = packed.shape[-1] * 2
    if k % block or tuple(scales.shape) != (*packed.shape[:-1], k // block):
        raise ValueError(f"{where}: scales shape {tuple(scales.shape)} does not match packed "
                         f"{tuple(packed.shape)} (expected {(*packed.shape[:-1], k // block)})")
