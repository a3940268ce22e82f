"""Fused FP4 fake quantization for QAT: dequant(quant(x)) in one pass, nearest or TRACE-guided.

One kernel reads x (and, for guided rounding, the rollout's block scales and packed mantissa bits), picks
every element's E2M1 code exactly like megatron_qrl/quant (e2m1.round_nearest / e2m1.round_guided with
its fallback_shift and top-code rule) and writes code * f32(s_block) * s_global in x's dtype, optionally
counting the guided fallbacks. The output is bit-identical to `quant_dequant(...)` (fake_quant.py): the
fp32 product is the reference's and the final cast rounds to nearest even on both paths.

Guided rounding needs the exact scaled value z = x / (s_block * s_global) for its distance test, so the
same correctly rounded division as fp4_quant.py is used (module docstring there). The distance
|a - v_chosen| / spacing is computed as |a - v_chosen| * (1 / spacing): spacing is 0.5, 1 or 2, so both
are the correctly rounded value of the same real number.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from megatron_qrl.quant.qat import GuidedRounding

from .fp4_quant import (MXFP4_BLOCK, NVFP4_BLOCK, ROWS_FIRST, _as_blocks, _block_amax, _check_amax_bits,
                        _e2m1_nearest, _e2m1_value, _e4m3_to_f32, _gs_from_amax, _load_global_scale, _load_tile,
                        _mxfp4_block_scale, _negative, _nvfp4_block_scale, _nvfp4_scaled, _pack_store, _store_tile,
                        amax_bits, as_global_scale, check_input_fast)

DEFAULT_CONFIG = {"nvfp4": {"BB": 128, "num_warps": 4}, "mxfp4": {"BB": 128, "num_warps": 4}}

MODE_NEAREST = 0         # scales computed in the kernel
MODE_NEAREST_SCALES = 1  # nearest rounding with given scales
MODE_GUIDED = 2          # TRACE replay with the rollout's scales and bits


@triton.jit
def _load_bits(bits_ptr, rows, mask, BB: tl.constexpr, G: tl.constexpr, C: tl.constexpr,
               HAS_MASK: tl.constexpr, RB: tl.constexpr):
    """Packed mantissa bits [BB, G/8] -> the bit of every element, int32 canonical [G/C, BB, C]."""
    H: tl.constexpr = G // C
    if RB:
        boffs = rows[:, None] * (G // 8) + tl.arange(0, G // 8)[None, :]
        if HAS_MASK:
            b = tl.load(bits_ptr + boffs, mask=mask[:, None], other=0)
        else:
            b = tl.load(bits_ptr + boffs)
        b = tl.permute(b, (1, 0))
    else:
        boffs = rows[None, :] * (G // 8) + tl.arange(0, G // 8)[:, None]
        if HAS_MASK:
            b = tl.load(bits_ptr + boffs, mask=mask[None, :], other=0)
        else:
            b = tl.load(bits_ptr + boffs)
    b = tl.broadcast_to(b.to(tl.int32)[:, None, :, None], (G // 8, 8 // C, BB, C))
    b = tl.reshape(b, (H, BB, C))
    shift = (tl.arange(0, H)[:, None, None] * C + tl.arange(0, C)[None, None, :]) % 8
    return (b >> shift) & 1


@triton.jit
def _e2m1_guided(z, bit, thr, ROUND: tl.constexpr):
    """e2m1.round_guided on magnitudes: returns (magnitude index int32, fallback mask)."""
    a = tl.minimum(tl.abs(z), 6.0)
    b = a.to(tl.int32, bitcast=True)
    # floor_code: for a >= 1 truncate to one mantissa bit; below 1 it is 0 or 1
    lo = tl.where(a < 1.0, (a >= 0.5).to(tl.int32), (b >> 22) - 252)
    top = lo == 7
    hi = tl.minimum(lo + 1, 7)
    chosen = tl.where((lo & 1) == bit, lo, tl.where(top, lo - 1, hi))
    inv_spacing = tl.where(lo < 4, 2.0, tl.where(lo < 6, 1.0, 0.5))
    dist = tl.abs(a - _e2m1_value(chosen)) * inv_spacing
    fallback = dist > thr
    mag = tl.where(fallback, _e2m1_nearest(z, ROUND), chosen)
    return mag, fallback


@triton.jit
def _cast_out(v, out_ty: tl.constexpr, NATIVE_CAST: tl.constexpr):
    """fp32 -> the output dtype, round to nearest even. The interpreter's fp32 -> bf16 cast does not round
    to nearest even, so off the GPU (NATIVE_CAST=False) bf16 is rounded with bit arithmetic."""
    if NATIVE_CAST or out_ty != tl.bfloat16:
        out = v.to(out_ty)
    else:
        b = v.to(tl.int32, bitcast=True)
        r = (b + (0x7FFF + ((b >> 16) & 1))) >> 16
        r = tl.where(v != v, 0x7FC0, r)                  # NaN stays a quiet NaN
        out = r.to(tl.int16).to(tl.bfloat16, bitcast=True)
    return out


@triton.jit
def _fp4_fake_quant_kernel(x_ptr, out_ptr, gs_ptr, gs_out_ptr, scales_ptr, bits_ptr, count_ptr, n_blocks, nkb, thr,
                           cap_packed_ptr, cap_scales_ptr, cap_bits_ptr,
                           FMT: tl.constexpr, MODE: tl.constexpr, BB: tl.constexpr, C: tl.constexpr,
                           HAS_MASK: tl.constexpr, DIV: tl.constexpr, ROUND: tl.constexpr,
                           CHECK: tl.constexpr, COUNT: tl.constexpr, NATIVE_CAST: tl.constexpr,
                           RB: tl.constexpr, PER_ROW: tl.constexpr, GS_AMAX: tl.constexpr,
                           CAPTURE: tl.constexpr = False, MISMATCH: tl.constexpr = False):
    """FMT 0 = NVFP4, 1 = MXFP4; MODE: 0 nearest, 1 nearest with given scales, 2 guided.
    CAPTURE (MODE 0): also the quantize kernel's outputs -- packed codes, block-scale bytes and the TRACE
    mantissa bits -- from the same pass, so the engine's capture costs no extra launch.
    MISMATCH (MODE 2, with COUNT): count_ptr[1] also counts the elements whose chosen code's mantissa bit
    differs from the guide's bit (TRACE's code mismatch after guidance, trace/metrics.py)."""
    G: tl.constexpr = 16 if FMT == 0 else 32
    blk0 = tl.program_id(0).to(tl.int64) * BB
    rows = tl.arange(0, BB)
    x_ptr += blk0 * G
    out_ptr += blk0 * G
    scales_ptr += blk0
    mask = (blk0 + rows) < n_blocks
    x = _load_tile(x_ptr, rows, mask, BB, G, C, HAS_MASK, RB)
    amax = _block_amax(x)
    if MODE != 0:
        if HAS_MASK:
            sc = tl.load(scales_ptr + rows, mask=mask, other=0x38).to(tl.int32)
        else:
            sc = tl.load(scales_ptr + rows).to(tl.int32)
    if FMT == 0:
        if GS_AMAX:
            gs, safe = _gs_from_amax(gs_ptr, gs_out_ptr)     # gs_ptr: amax bits (fp4_quant.amax_bits)
        else:
            gs = _load_global_scale(gs_ptr, blk0, rows, mask, nkb, PER_ROW)
            safe = False
        if MODE == 0:
            scode, sval = _nvfp4_block_scale(amax, gs)
        else:
            sval = _e4m3_to_f32(sc)
        d = sval * gs
        z = _nvfp4_scaled(x, amax, d, DIV, CHECK, safe)
        neg = _negative(x, z, d[None, :, None], DIV)
        dq = d
    else:
        if MODE == 0:
            scode, inv = _mxfp4_block_scale(amax)
            e = scode - 127
            sv = ((e + 127) << 23).to(tl.float32, bitcast=True)                 # 2^e, e >= -126
            dq = tl.where(e == -127, tl.full(sv.shape, 0x400000, tl.int32).to(tl.float32, bitcast=True), sv)
        else:
            # E8M0 byte s: scale 2^(s-127); s = 0 -> 2^-127 (subnormal); s = 255 -> inf (x / inf = 0)
            sub = tl.full(sc.shape, 0x400000, tl.int32).to(tl.float32, bitcast=True)
            sv = (sc << 23).to(tl.float32, bitcast=True)
            dq = tl.where(sc == 0, sub, sv)                                      # sc == 255 gives inf
            inv_n = ((254 - sc) << 23).to(tl.float32, bitcast=True)
            inv = tl.where(sc == 254, sub, tl.where(sc == 255, 0.0, inv_n))
        z = x * inv[None, :, None]
        neg = z < 0.0
    if MODE == 2:
        bit = _load_bits(bits_ptr + blk0 * (G // 8), rows, mask, BB, G, C, HAS_MASK, RB)
        mag, fallback = _e2m1_guided(z, bit, thr, ROUND)
    else:
        mag = _e2m1_nearest(z, ROUND)
    val = _e2m1_value(mag)
    val = (val.to(tl.int32, bitcast=True) | tl.where(neg, -2147483648, 0)).to(tl.float32, bitcast=True)
    out = _cast_out(val * dq[None, :, None], out_ptr.dtype.element_ty, NATIVE_CAST)
    _store_tile(out_ptr, out, rows, mask, BB, G, C, HAS_MASK, RB)
    if CAPTURE:
        if HAS_MASK:
            tl.store(cap_scales_ptr + blk0 + rows, scode.to(tl.uint8), mask=mask)
        else:
            tl.store(cap_scales_ptr + blk0 + rows, scode.to(tl.uint8))
        _pack_store(mag | tl.where(neg, 8, 0), cap_packed_ptr + blk0 * (G // 2), cap_bits_ptr + blk0 * (G // 8),
                    rows, mask, BB, G, C, True, HAS_MASK, RB)
    if MODE == 2:
        if COUNT:
            fb = fallback
            if HAS_MASK:
                fb = fb & mask[None, :, None]
            tl.atomic_add(count_ptr, tl.sum(tl.sum(tl.sum(fb.to(tl.int32), axis=2), axis=1), axis=0))
            if MISMATCH:
                mm = (mag & 1) != bit
                if HAS_MASK:
                    mm = mm & mask[None, :, None]
                tl.atomic_add(count_ptr + 1, tl.sum(tl.sum(tl.sum(mm.to(tl.int32), axis=2), axis=1), axis=0))


# ----------------------------------------------------------------------------------------------------------
# Python wrappers
# ----------------------------------------------------------------------------------------------------------
def _threshold(fallback_shift: float) -> float:
    """The fp32 value that `dist > (0.5 + fallback_shift)` compares with in torch (the scalar is rounded to
    the tensor's float32)."""
    return float(torch.tensor(0.5 + fallback_shift, dtype=torch.float32))


def _launch(x, fmt, mode, gs, scales_u8, bits, fallback_shift, count, BB, num_warps, div, round_impl, check,
            rows_first, amax=None, capture=None, mismatch=False):
    """The fake-quant kernel; NVFP4 with gs=None takes `amax` (fp4_quant.amax_bits) and computes the global
    scale in the kernel. capture: (packed, scales, bits) uint8 outputs to fill as well (MODE_NEAREST)."""
    G = NVFP4_BLOCK if fmt == 0 else MXFP4_BLOCK
    n_blocks = x.numel() // G
    out = torch.empty_like(x)
    thr = _threshold(fallback_shift)
    if thr < 2.0 ** -30:
        div = 0  # decisions then depend on tiny z exactly: use the per-element division
    dummy = x
    gs_amax = fmt == 0 and gs is None
    gs_out = torch.empty((), dtype=torch.float32, device=x.device) if gs_amax else dummy
    grid = (triton.cdiv(n_blocks, BB),)
    _fp4_fake_quant_kernel[grid](
        x, out, amax if gs_amax else (gs if gs is not None else dummy), gs_out,
        scales_u8 if scales_u8 is not None else dummy,
        bits if bits is not None else dummy, count if count is not None else dummy, n_blocks, x.shape[-1] // G,
        thr, *(capture if capture is not None else (dummy, dummy, dummy)),
        FMT=fmt, MODE=mode, BB=BB, C=16 // x.element_size(), HAS_MASK=(n_blocks % BB != 0), DIV=div,
        ROUND=round_impl, CHECK=check, COUNT=count is not None, NATIVE_CAST=x.is_cuda,
        RB=ROWS_FIRST if rows_first is None else rows_first, PER_ROW=gs is not None and gs.dim() > 0,
        GS_AMAX=gs_amax, CAPTURE=capture is not None, MISMATCH=mismatch,
        num_warps=num_warps)
    return out


def _check_guide(guide: GuidedRounding, x: torch.Tensor, block: int, scale_dtype, where: str):
    lead, K = tuple(x.shape[:-1]), x.shape[-1]
    if tuple(guide.bits.shape) != (*lead, K // 8) or guide.bits.dtype != torch.uint8:
        raise ValueError(f"{where}: guide.bits must be uint8 {(*lead, K // 8)} (8 bits per byte), got "
                         f"{guide.bits.dtype} {tuple(guide.bits.shape)}")
    _check_scales(guide.scales, x, block, scale_dtype, "guide.scales", where)


def _check_scales(scales: torch.Tensor, x: torch.Tensor, block: int, scale_dtype, name: str, where: str) -> None:
    """One scale per `block` elements of x's last dim, in the format's scale dtype."""
    shape = (*x.shape[:-1], x.shape[-1] // block)
    if tuple(scales.shape) != shape or scales.dtype != scale_dtype:
        raise ValueError(f"{where}: {name} must be {str(scale_dtype).removeprefix('torch.')} {shape}, got "
                         f"{scales.dtype} {tuple(scales.shape)}")


def _guide_blocks(guide: GuidedRounding, x: torch.Tensor, block: int, scale_dtype, where: str):
    """The guide's (scale bytes, rounding bits) as the kernel reads them, after checking their shapes."""
    _check_guide(guide, x, block, scale_dtype, where)
    return _as_blocks(guide.scales).view(torch.uint8), _as_blocks(guide.bits)


def _rounding(x: torch.Tensor, guide: Optional[GuidedRounding], scales: Optional[torch.Tensor], block: int,
              scale_dtype, where: str):
    """(mode, scale bytes, rounding bits): TRACE replay of the guide, nearest rounding with the given scales, or
    nearest rounding with scales computed in-kernel."""
    if guide is not None:
        return (MODE_GUIDED, *_guide_blocks(guide, x, block, scale_dtype, where))
    if scales is not None:
        return MODE_NEAREST_SCALES, _given_scale_blocks(scales, x, block, scale_dtype, where), None
    return MODE_NEAREST, None, None


def _fallback_count(x: torch.Tensor, guide, stats, return_fallback: bool, return_mismatch: bool = False):
    """The kernel's int32 counters when a guided call reports them: [fallback, mismatch] or the fallback
    count alone; None otherwise (the kernel then counts nothing)."""
    if guide is None:
        return None
    if return_mismatch:
        return torch.zeros(2, dtype=torch.int32, device=x.device)
    if stats is not None or return_fallback:
        return torch.zeros((), dtype=torch.int32, device=x.device)
    return None


def _given_scale_blocks(scales: torch.Tensor, x: torch.Tensor, block: int, scale_dtype, where: str):
    """scales= (nearest rounding with the caller's scales) as the kernel reads them."""
    _check_scales(scales, x, block, scale_dtype, "scales", where)
    return _as_blocks(scales).view(torch.uint8)


def _finish(out, count, x, stats, return_fallback):
    if stats is not None and count is not None:
        stats["guided_fallback"] = stats.get("guided_fallback", 0) + int(count)
        stats["guided_elements"] = stats.get("guided_elements", 0) + x.numel()
    if return_fallback:
        return out, count
    return out


def nvfp4_fake_quant_triton(x: torch.Tensor, guide: Optional[GuidedRounding] = None,
                            global_scale: Optional[torch.Tensor] = None, fallback_shift: float = 0.25, *,
                            scales: Optional[torch.Tensor] = None, stats: Optional[dict] = None,
                            return_fallback: bool = False, check_finite: bool = True,
                            block_blocks: Optional[int] = None, num_warps: Optional[int] = None,
                            div: int = 1, round_impl: int = 2, rows_first: Optional[bool] = None,
                            return_mismatch: bool = False):
    """dequant(quant(x)) for NVFP4 in x's dtype, bit-identical to `quant_dequant(x, "nvfp4", ...)`.

    guide (GuidedRounding: bits, scales, global_scale) selects TRACE replay with the rollout's scales
    (global scale: a scalar or one per row [..., 1], like the reference);
    otherwise nearest rounding with `scales` (+ `global_scale`) if given, else scales computed in-kernel
    (global_scale=None: amax/(6*448) by torch). The guided fallback count (elements that fell back to
    nearest) is added to stats["guided_fallback"] (one host sync) and/or returned as an int32 device tensor
    with return_fallback=True: then the result is (out, count). return_mismatch=True (guided only) returns
    (out, fallback count, mismatch count): the second int32 device tensor counts the elements whose chosen
    code's mantissa bit differs from guide.bits (no host sync; stats is then left alone).
    """
    where = "nvfp4_fake_quant_triton"
    check_input_fast(x, NVFP4_BLOCK, where)
    if return_mismatch and guide is None:
        raise ValueError(f"{where}: return_mismatch counts against a TRACE guide; pass guide=")
    if guide is None and scales is not None and global_scale is None:
        raise ValueError(f"{where}: scales= needs its global_scale")
    mode, scales_u8, bits = _rounding(x, guide, scales, NVFP4_BLOCK, torch.float8_e4m3fn, where)
    if guide is not None:
        if guide.global_scale is None:
            raise ValueError(f"{where}: guided NVFP4 needs the rollout's global_scale (guide.global_scale)")
        global_scale = guide.global_scale
    gs = None if global_scale is None else as_global_scale(global_scale, x, where)
    count = _fallback_count(x, guide, stats, return_fallback, return_mismatch)
    xc = _as_blocks(x.detach())
    amax = amax_bits(xc) if (gs is None or check_finite) else None
    cfg = DEFAULT_CONFIG["nvfp4"]
    out = _launch(xc, 0, mode, gs, scales_u8, bits, fallback_shift, count, block_blocks or cfg["BB"],
                  num_warps or cfg["num_warps"], div, round_impl, True, rows_first, amax, mismatch=return_mismatch)
    if check_finite:
        _check_amax_bits(amax, where)
    if return_mismatch:
        return out.view(x.shape), count[0], count[1]
    return _finish(out.view(x.shape), count, x, stats, return_fallback)


def mxfp4_fake_quant_triton(x: torch.Tensor, guide: Optional[GuidedRounding] = None,
                            fallback_shift: float = 0.25, *, scales: Optional[torch.Tensor] = None,
                            stats: Optional[dict] = None, return_fallback: bool = False,
                            check_finite: bool = True, block_blocks: Optional[int] = None,
                            num_warps: Optional[int] = None, round_impl: int = 2,
                            rows_first: Optional[bool] = None):
    """dequant(quant(x)) for MXFP4 in x's dtype, bit-identical to `quant_dequant(x, "mxfp4", ...)`.
    guide: the rollout's E8M0 scales (uint8 [..., K/32]) and bits; scales=: nearest with given scales."""
    where = "mxfp4_fake_quant_triton"
    check_input_fast(x, MXFP4_BLOCK, where)
    mode, scales_u8, bits = _rounding(x, guide, scales, MXFP4_BLOCK, torch.uint8, where)
    count = _fallback_count(x, guide, stats, return_fallback)
    xc = _as_blocks(x.detach())
    amax = amax_bits(xc) if check_finite else None
    cfg = DEFAULT_CONFIG["mxfp4"]
    out = _launch(xc, 1, mode, None, scales_u8, bits, fallback_shift, count, block_blocks or cfg["BB"],
                  num_warps or cfg["num_warps"], 1, round_impl, False, rows_first)
    if check_finite:
        _check_amax_bits(amax, where)
    return _finish(out.view(x.shape), count, x, stats, return_fallback)


def fp4_fake_quant_capture_triton(x: torch.Tensor, fmt: str, global_scale: Optional[torch.Tensor] = None):
    """The engine's W4A4 activation quantizer with TRACE capture, in one launch: returns
    (dequant(quant(x)) in x's dtype, packed uint8 [..., K/2], scales [..., K/G], bits uint8 [..., K/8]) with
    exactly the bytes of `nvfp4_quantize_triton(x, gs, capture=True)` / `mxfp4_quantize_triton(x, capture=True)`
    and the dequantized values of `nvfp4_fake_quant_triton` / `mxfp4_fake_quant_triton` (nearest rounding).
    NVFP4 needs its global scale (a scalar or one per row [..., 1]); scales are float8_e4m3fn (NVFP4) or E8M0
    uint8 (MXFP4). No host synchronisation (non-finite input gives unspecified bytes, like check_finite=False).
    """
    where = "fp4_fake_quant_capture_triton"
    G = {"nvfp4": NVFP4_BLOCK, "mxfp4": MXFP4_BLOCK}.get(fmt)
    if G is None:
        raise ValueError(f"{where}: unknown FP4 format '{fmt}'; use nvfp4 or mxfp4")
    check_input_fast(x, G, where)
    gs = None
    if fmt == "nvfp4":
        if global_scale is None:
            raise ValueError(f"{where}: NVFP4 capture needs the global scale (the caller's amax / (6 * 448))")
        gs = as_global_scale(global_scale, x, where)
    xc = _as_blocks(x.detach())
    lead, K = tuple(xc.shape[:-1]), xc.shape[-1]
    packed = torch.empty((*lead, K // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((*lead, K // G), dtype=torch.uint8, device=x.device)
    bits = torch.empty((*lead, K // 8), dtype=torch.uint8, device=x.device)
    cfg = DEFAULT_CONFIG[fmt]
    out = _launch(xc, 0 if fmt == "nvfp4" else 1, MODE_NEAREST, gs, None, None, 0.25, None, cfg["BB"],
                  cfg["num_warps"], 1, 2, fmt == "nvfp4", None, capture=(packed, scales, bits))
    return out.view(x.shape), packed, (scales.view(torch.float8_e4m3fn) if fmt == "nvfp4" else scales), bits


class _StraightThrough(torch.autograd.Function):
    """Forward: the fake-quantized tensor; backward: the gradient unchanged (STE)."""

    @staticmethod
    def forward(ctx, x, q):
        return q

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def fake_quant_ste_triton(x: torch.Tensor, fmt: str = "nvfp4", guide: Optional[GuidedRounding] = None,
                          global_scale: Optional[torch.Tensor] = None, fallback_shift: float = 0.25,
                          stats: Optional[dict] = None) -> torch.Tensor:
    """QAT forward with a straight-through gradient. The forward value is exactly dequant(quant(x));
    the reference's `x + (q - x).detach()` equals it up to the rounding of that sum in x's dtype; the
    gradient (identity) is the same."""
    if fmt == "nvfp4":
        q = nvfp4_fake_quant_triton(x, guide, global_scale, fallback_shift, stats=stats)
    elif fmt == "mxfp4":
        q = mxfp4_fake_quant_triton(x, guide, fallback_shift, stats=stats)
    else:
        raise ValueError(f"fake_quant_ste_triton: unknown FP4 format '{fmt}'; use nvfp4 or mxfp4")
    return _StraightThrough.apply(x, q)


__all__ = ["nvfp4_fake_quant_triton", "mxfp4_fake_quant_triton", "fp4_fake_quant_capture_triton", "fake_quant_ste_triton",
           "DEFAULT_CONFIG"]
