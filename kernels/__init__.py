"""Triton kernels of megatron-qrl, each with its torch reference; importable as `megatron_qrl.kernels`.

FP4 codec (fp4_quant.py, fp4_fake_quant.py): NVFP4/MXFP4 quantize with TRACE capture and fused
nearest/guided fake quantization, byte-for-byte equal to megatron_qrl/quant.

Which implementation runs is decided in one place, `backend.use_triton` (re-exported here): Triton for CUDA
tensors when `available()`, the torch reference otherwise. QRL_KERNELS=torch forces the reference;
QRL_KERNELS=triton also sends CPU tensors to the kernels when TRITON_INTERPRET=1 (tests). The FP4 codec
entry points below keep the reference's signatures and go through the format objects of
megatron_qrl.quant.formats, which make that choice per call (stochastic rounding and guided quantization to
codes run on the reference only). `prepare_weight` is the registry of W4A16 weight layouts per format.
Triton is imported lazily: this module imports without it.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .backend import available, interpreter_enabled, use_triton


def nvfp4_quantize(x: torch.Tensor, global_scale: Optional[torch.Tensor] = None, rounding: str = "nearest",
                   *, scales: Optional[torch.Tensor] = None, trace_bits: Optional[torch.Tensor] = None,
                   capture: bool = False, generator: Optional[torch.Generator] = None,
                   fallback_shift: float = 0.25, stats: Optional[dict] = None):
    """`megatron_qrl.quant.nvfp4_quantize` with the Triton kernel for nearest rounding (same bytes)."""
    from megatron_qrl.quant.formats import NVFP4

    enc = NVFP4.quantize(x, rounding, global_scale=global_scale, scales=scales, trace_bits=trace_bits,
                         capture=capture, generator=generator, fallback_shift=fallback_shift, stats=stats)
    return tuple(enc) if capture else tuple(enc[:3])


def mxfp4_quantize(x: torch.Tensor, rounding: str = "nearest", *, scales: Optional[torch.Tensor] = None,
                   trace_bits: Optional[torch.Tensor] = None, capture: bool = False,
                   generator: Optional[torch.Generator] = None, fallback_shift: float = 0.25,
                   stats: Optional[dict] = None):
    """`megatron_qrl.quant.mxfp4_quantize` with the Triton kernel for nearest rounding (same bytes)."""
    from megatron_qrl.quant.formats import MXFP4

    enc = MXFP4.quantize(x, rounding, scales=scales, trace_bits=trace_bits, capture=capture, generator=generator,
                         fallback_shift=fallback_shift, stats=stats)
    return (enc.packed, enc.scales, enc.bits) if capture else (enc.packed, enc.scales)


def quant_dequant(x: torch.Tensor, fmt: str = "nvfp4", rounding: str = "nearest", guide=None,
                  global_scale: Optional[torch.Tensor] = None, generator: Optional[torch.Generator] = None,
                  fallback_shift: float = 0.25, stats: Optional[dict] = None) -> torch.Tensor:
    """`megatron_qrl.quant.quant_dequant` with the fused kernel for nearest and guided rounding."""
    from megatron_qrl.quant.formats import FORMATS

    f = FORMATS.get(fmt)
    if f is not None and guide is not None:
        return f.guided(x, guide, fallback_shift=fallback_shift, stats=stats)[0]
    if f is not None and rounding == "nearest":
        return f.fake_quant(x, global_scale)[0]
    from megatron_qrl.quant.qat import quant_dequant as ref
    return ref(x, fmt, rounding, guide, global_scale, generator, fallback_shift, stats)


def fake_quant(x: torch.Tensor, fmt: str = "nvfp4", rounding: str = "nearest", guide=None,
               global_scale: Optional[torch.Tensor] = None, generator: Optional[torch.Generator] = None,
               fallback_shift: float = 0.25, stats: Optional[dict] = None) -> torch.Tensor:
    """`megatron_qrl.quant.fake_quant` (x + (q - x).detach(), the same forward value and gradient)."""
    q = quant_dequant(x, fmt, rounding, guide, global_scale, generator, fallback_shift, stats)
    return x + (q - x).detach()


# --------------------------------------------------------------------------- W4A16 weight layouts
def _prepare_nvfp4(packed, scales, global_scale):
    from .layouts import prepare_nvfp4_weight

    return prepare_nvfp4_weight(packed, scales, global_scale)


def _prepare_mxfp4(packed, scales, global_scale):
    from .layouts import prepare_mxfp4_weight

    return prepare_mxfp4_weight(packed, scales)


WEIGHT_LAYOUTS: dict[str, Callable] = {"nvfp4": _prepare_nvfp4, "mxfp4": _prepare_mxfp4}


def prepare_weight(fmt: str, packed: torch.Tensor, scales: torch.Tensor,
                   global_scale: Optional[torch.Tensor] = None):
    """The W4A16 kernels' PreparedFP4Weight of one synced FP4 weight (packed [N, K/2]) or of a stack of
    experts ([E, N, K/2], global scales [E]), by format (kernels/layouts.py documents the layouts)."""
    prepare = WEIGHT_LAYOUTS.get(fmt)
    if prepare is None:
        raise ValueError(f"no W4A16 weight layout for format '{fmt}'; use one of {tuple(WEIGHT_LAYOUTS)}")
    return prepare(packed, scales, global_scale)


__all__ = ["WEIGHT_LAYOUTS", "available", "fake_quant", "interpreter_enabled", "mxfp4_quantize", "nvfp4_quantize",
           "prepare_weight", "quant_dequant", "use_triton"]


if __name__ == "kernels":      # imported by its directory name, not as megatron_qrl.kernels: see _toplevel_name
    from ._toplevel_name import yield_to_installed as _yield_to_installed
    _yield_to_installed()
