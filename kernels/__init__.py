"""Triton kernels of megatron-qrl, each with its torch reference; importable as `megatron_qrl.kernels`.

FP4 codec (fp4_quant.py, fp4_fake_quant.py): NVFP4/MXFP4 quantize with TRACE capture and fused
nearest/guided fake quantization, byte-for-byte equal to megatron_qrl/quant.

The entry points below keep the reference's signatures and pick the implementation per call:
Triton for CUDA tensors when `available()`, the torch reference otherwise (CPU tensors, stochastic
rounding, guided *quantization* to codes, which only the reference implements). QRL_KERNELS=torch forces the
reference; QRL_KERNELS=triton also sends CPU tensors to the kernels when TRITON_INTERPRET=1 (tests).
Triton is imported lazily: this module imports without it.
"""
from __future__ import annotations

import os
from importlib.util import find_spec
from typing import Optional

import torch

_FORMATS = ("nvfp4", "mxfp4")


def interpreter_enabled() -> bool:
    """TRITON_INTERPRET=1: Triton kernels run on the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


def available() -> bool:
    """Triton is importable and can run here: a CUDA device, or TRITON_INTERPRET=1."""
    if find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # a broken install counts as absent
        return False
    return interpreter_enabled() or torch.cuda.is_available()


def use_triton(x: torch.Tensor) -> bool:
    """Whether the codec entry points send `x` to the Triton kernels (QRL_KERNELS=auto|torch|triton)."""
    mode = os.environ.get("QRL_KERNELS", "auto").lower()
    if mode not in ("auto", "torch", "triton"):
        raise ValueError(f"QRL_KERNELS={mode!r}: use auto, torch or triton")
    if mode == "torch":
        return False
    if not available():
        if mode == "triton":
            raise RuntimeError("QRL_KERNELS=triton but Triton cannot run here: install triton and use a CUDA "
                               "device, or set TRITON_INTERPRET=1 for the CPU interpreter")
        return False
    if x.is_cuda:
        return True
    return mode == "triton" and interpreter_enabled()


def nvfp4_quantize(x: torch.Tensor, global_scale: Optional[torch.Tensor] = None, rounding: str = "nearest",
                   *, scales: Optional[torch.Tensor] = None, trace_bits: Optional[torch.Tensor] = None,
                   capture: bool = False, generator: Optional[torch.Generator] = None,
                   fallback_shift: float = 0.25, stats: Optional[dict] = None):
    """`megatron_qrl.quant.nvfp4_quantize` with the Triton kernel for nearest rounding (same bytes)."""
    if rounding == "nearest" and scales is None and use_triton(x):
        from .fp4_quant import nvfp4_quantize_triton
        return nvfp4_quantize_triton(x, global_scale, capture)
    from megatron_qrl.quant.nvfp4 import nvfp4_quantize as ref
    return ref(x, global_scale, rounding, scales=scales, trace_bits=trace_bits, capture=capture,
               generator=generator, fallback_shift=fallback_shift, stats=stats)


def mxfp4_quantize(x: torch.Tensor, rounding: str = "nearest", *, scales: Optional[torch.Tensor] = None,
                   trace_bits: Optional[torch.Tensor] = None, capture: bool = False,
                   generator: Optional[torch.Generator] = None, fallback_shift: float = 0.25,
                   stats: Optional[dict] = None):
    """`megatron_qrl.quant.mxfp4_quantize` with the Triton kernel for nearest rounding (same bytes)."""
    if rounding == "nearest" and scales is None and use_triton(x):
        from .fp4_quant import mxfp4_quantize_triton
        return mxfp4_quantize_triton(x, capture)
    from megatron_qrl.quant.mxfp4 import mxfp4_quantize as ref
    return ref(x, rounding, scales=scales, trace_bits=trace_bits, capture=capture, generator=generator,
               fallback_shift=fallback_shift, stats=stats)


def quant_dequant(x: torch.Tensor, fmt: str = "nvfp4", rounding: str = "nearest", guide=None,
                  global_scale: Optional[torch.Tensor] = None, generator: Optional[torch.Generator] = None,
                  fallback_shift: float = 0.25, stats: Optional[dict] = None) -> torch.Tensor:
    """`megatron_qrl.quant.quant_dequant` with the fused kernel for nearest and guided rounding."""
    if fmt in _FORMATS and (rounding == "nearest" or guide is not None) and use_triton(x):
        from .fp4_fake_quant import mxfp4_fake_quant_triton, nvfp4_fake_quant_triton
        with torch.no_grad():
            if fmt == "nvfp4":
                if guide is not None:
                    return nvfp4_fake_quant_triton(x, guide, fallback_shift=fallback_shift, stats=stats)
                return nvfp4_fake_quant_triton(x, None, global_scale)
            return mxfp4_fake_quant_triton(x, guide, fallback_shift, stats=stats)
    from megatron_qrl.quant.fake_quant import quant_dequant as ref
    return ref(x, fmt, rounding, guide, global_scale, generator, fallback_shift, stats)


def fake_quant(x: torch.Tensor, fmt: str = "nvfp4", rounding: str = "nearest", guide=None,
               global_scale: Optional[torch.Tensor] = None, generator: Optional[torch.Generator] = None,
               fallback_shift: float = 0.25, stats: Optional[dict] = None) -> torch.Tensor:
    """`megatron_qrl.quant.fake_quant` (x + (q - x).detach(), the same forward value and gradient)."""
    q = quant_dequant(x, fmt, rounding, guide, global_scale, generator, fallback_shift, stats)
    return x + (q - x).detach()


__all__ = ["available", "interpreter_enabled", "use_triton", "nvfp4_quantize", "mxfp4_quantize",
           "quant_dequant", "fake_quant"]
