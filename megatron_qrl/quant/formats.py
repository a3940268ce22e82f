"""The FP4 formats as objects: block size, scale type and the codec calls, each dispatched to the kernels.

`fp4_format("nvfp4")` / `NVFP4` / `MXFP4` are the one entry point the trainer's QAT linears, the engine,
the weight sync and the export quantize through. Every call picks its implementation at one place,
`megatron_qrl.kernels.backend.use_triton` (CUDA tensors -> the Triton codec, byte-identical to the torch
reference: tests/test_kernels_codec.py; CPU tensors -> the torch reference in nvfp4.py / mxfp4.py, which
stays pure torch so the kernels have something to be checked against). What only the reference implements
(stochastic rounding, guided rounding to codes with capture) always runs there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from .blocks import MXFP4_BLOCK, NVFP4_BLOCK
from .mxfp4 import mxfp4_dequantize, mxfp4_quantize
from .nvfp4 import nvfp4_dequantize, nvfp4_global_scale, nvfp4_global_scales, nvfp4_quantize


class Encoding(NamedTuple):
    """One tensor in FP4: packed E2M1 codes, block scales, the NVFP4 global scale (None for MXFP4) and, when
    captured, the packed mantissa bits (what TRACE records)."""

    packed: torch.Tensor                       # uint8 [..., K/2]
    scales: torch.Tensor                       # float8_e4m3fn [..., K/16] (NVFP4) | uint8 E8M0 [..., K/32]
    global_scale: Optional[torch.Tensor]       # fp32 0-dim or one per row [..., 1] (NVFP4) | None
    bits: Optional[torch.Tensor] = None        # uint8 [..., K/8], with capture=True


def _kernels(x: torch.Tensor, kernels: Optional[bool]) -> bool:
    """The Triton codec for `x`? `kernels` None: the backend decides (`use_triton`); True: a caller that runs
    on the kernels already (the engine's kernel mode, rollout/kernel_linears.py); False: the reference."""
    if kernels is not None:
        return kernels
    from megatron_qrl.kernels.backend import use_triton

    return use_triton(x)


def uses_kernels(x: torch.Tensor) -> bool:
    """Whether the format objects' calls on `x` run on the Triton codec (for callers whose own paths differ
    with it, e.g. TRACE's per-row replay in models/fp4_linear.py)."""
    return _kernels(x, None)


@dataclass(frozen=True)
class FP4Format:
    """One FP4 format: its block size along K, its block-scale dtype, and its codec."""

    name: str
    block: int
    scale_dtype: torch.dtype

    @property
    def has_global_scale(self) -> bool:
        return self.name == "nvfp4"

    def global_scales(self, amax: torch.Tensor) -> Optional[torch.Tensor]:
        """NVFP4 global scales amax / (6 * 448) of many tensors at once (zero amax -> 1 / (6 * 448)); None
        for MXFP4, which has none."""
        return nvfp4_global_scales(amax) if self.has_global_scale else None

    # ------------------------------------------------------------------------------------------ codec
    def quantize(self, x: torch.Tensor, rounding: str = "nearest", *, global_scale: Optional[torch.Tensor] = None,
                 scales: Optional[torch.Tensor] = None, trace_bits: Optional[torch.Tensor] = None,
                 capture: bool = False, generator: Optional[torch.Generator] = None, fallback_shift: float = 0.25,
                 stats: Optional[dict] = None, check_finite: bool = True, kernels: Optional[bool] = None) -> Encoding:
        """x in FP4 (nvfp4.py / mxfp4.py document the rounding modes); the kernel for nearest rounding of
        computed scales. check_finite=False lets the kernel skip its finiteness read (no host sync)."""
        if rounding == "nearest" and scales is None and _kernels(x, kernels):
            from megatron_qrl.kernels.fp4_quant import mxfp4_quantize_triton, nvfp4_quantize_triton

            if self.has_global_scale:
                return Encoding(*nvfp4_quantize_triton(x, global_scale, capture, check_finite=check_finite))
            out = mxfp4_quantize_triton(x, capture, check_finite=check_finite)
            return Encoding(out[0], out[1], None, *out[2:])
        options = dict(scales=scales, trace_bits=trace_bits, capture=capture, generator=generator,
                       fallback_shift=fallback_shift, stats=stats)
        if self.has_global_scale:
            return Encoding(*nvfp4_quantize(x, global_scale, rounding, **options))
        out = mxfp4_quantize(x, rounding, **options)
        return Encoding(out[0], out[1], None, *out[2:])

    def dequantize(self, packed: torch.Tensor, scales: torch.Tensor, global_scale: Optional[torch.Tensor] = None,
                   dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        if self.has_global_scale:
            return nvfp4_dequantize(packed, scales, global_scale, dtype=dtype)
        return mxfp4_dequantize(packed, scales, dtype=dtype)

    def fake_quant(self, x: torch.Tensor, global_scale: Optional[torch.Tensor] = None, *, capture: bool = False,
                   check_finite: bool = True, kernels: Optional[bool] = None,
                   ) -> tuple[torch.Tensor, Optional[Encoding]]:
        """dequant(quant(x)) in x's dtype, nearest rounding, no gradient; with capture=True also the Encoding
        the values came from (one fused launch on the kernels). NVFP4: global_scale is a scalar or one per
        row; None computes the tensor's own."""
        with torch.no_grad():
            gs = global_scale
            if self.has_global_scale and gs is None and capture:
                gs = nvfp4_global_scale(x)
            if _kernels(x, kernels):
                import megatron_qrl.kernels.fp4_fake_quant as fq

                if capture:
                    deq, packed, scales, bits = fq.fp4_fake_quant_capture_triton(x, self.name, gs)
                    return deq, Encoding(packed, scales, gs, bits)
                if self.has_global_scale:
                    return fq.nvfp4_fake_quant_triton(x, global_scale=gs, check_finite=check_finite), None
                return fq.mxfp4_fake_quant_triton(x, check_finite=check_finite), None
            enc = self.quantize(x, global_scale=gs, capture=capture, kernels=False)
            return self.dequantize(enc.packed, enc.scales, enc.global_scale, x.dtype), (enc if capture else None)

    def guided(self, x: torch.Tensor, guide, *, fallback_shift: float = 0.25, stats: Optional[dict] = None,
               capture: bool = False, check_finite: bool = True, kernels: Optional[bool] = None,
               ) -> tuple[torch.Tensor, Optional[Encoding]]:
        """TRACE replay: dequant(guided quant(x)) with the rollout's scales and mantissa bits (`guide`, a
        GuidedRounding), no gradient; fallbacks counted in `stats`. Capture runs on the reference."""
        with torch.no_grad():
            if not capture and _kernels(x, kernels):
                import megatron_qrl.kernels.fp4_fake_quant as fq

                if self.has_global_scale:
                    return fq.nvfp4_fake_quant_triton(x, guide, fallback_shift=fallback_shift, stats=stats,
                                                      check_finite=check_finite), None
                return fq.mxfp4_fake_quant_triton(x, guide, fallback_shift, stats=stats,
                                                  check_finite=check_finite), None
            enc = self.quantize(x, "guided", global_scale=guide.global_scale, scales=guide.scales,
                                trace_bits=guide.bits, capture=capture, fallback_shift=fallback_shift, stats=stats)
            return self.dequantize(enc.packed, enc.scales, enc.global_scale, x.dtype), (enc if capture else None)


NVFP4 = FP4Format("nvfp4", NVFP4_BLOCK, torch.float8_e4m3fn)
MXFP4 = FP4Format("mxfp4", MXFP4_BLOCK, torch.uint8)
FORMATS = {f.name: f for f in (NVFP4, MXFP4)}
FP4_FORMATS = tuple(FORMATS)


def fp4_format(name: str) -> FP4Format:
    """The format object of 'nvfp4' / 'mxfp4'."""
    f = FORMATS.get(name)
    if f is None:
        raise ValueError(f"unknown FP4 format '{name}'; use one of {FP4_FORMATS}")
    return f


__all__ = ["Encoding", "FORMATS", "FP4Format", "FP4_FORMATS", "MXFP4", "NVFP4", "fp4_format", "uses_kernels"]
