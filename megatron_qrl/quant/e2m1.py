"""E2M1 (FP4) code selection: nearest (ties to even), stochastic, and TRACE-guided rounding.

A code is sign (bit 3) + magnitude index 0..7 for |values| 0, .5, 1, 1.5, 2, 3, 4, 6. The lowest bit of
the code is the mantissa bit that TRACE records. All functions take the *scaled* value z = x / scale in
float32 and return uint8 codes; they are the single definition that every path of the project (QAT,
engine, export, weight sync, Triton kernels) must reproduce.
"""
from __future__ import annotations

from typing import Optional

import torch

E2M1_MAX = 6.0
ROUNDING_MODES = ("nearest", "stochastic", "guided")
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbours; a magnitude exactly on one of the odd ones (0.75, 1.75, 3.5) rounds up to
# the even code, one on an even one (0.25, 1.25, 2.5, 5) rounds down: ties to even, as ModelOpt does.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_ODD_MIDPOINTS = (0.75, 1.75, 3.5)

_table_cache: dict[torch.device, torch.Tensor] = {}


def code_values(device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 [16]: the value of every 4-bit code (codes 8..15 are the negatives, 8 is -0)."""
    device = torch.device(device)
    t = _table_cache.get(device)
    if t is None:
        mags = torch.tensor(E2M1_VALUES, dtype=torch.float32)
        t = torch.cat([mags, -mags]).to(device)
        _table_cache[device] = t
    return t


def _sign_bit(z: torch.Tensor) -> torch.Tensor:
    return (z < 0).to(torch.uint8) << 3


def round_nearest(z: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code, ties to even, magnitudes above 6 saturate (bit-identical to ModelOpt)."""
    a = z.abs()
    mag = torch.zeros_like(a, dtype=torch.uint8)
    for m in _MIDPOINTS:
        mag += (a > m).to(torch.uint8)
    for m in _ODD_MIDPOINTS:
        mag += (a == m).to(torch.uint8)
    return _sign_bit(z) | mag


def floor_code(a: torch.Tensor) -> torch.Tensor:
    """Largest magnitude index whose value is <= a (a >= 0), in 0..7."""
    lo = torch.zeros_like(a, dtype=torch.uint8)
    for v in E2M1_VALUES[1:]:
        lo += (a >= v).to(torch.uint8)
    return lo


def _bracket(a: torch.Tensor):
    """Lower/upper neighbouring magnitude codes around a and a's fractional position between them."""
    vals = code_values(a.device)[:8]
    lo = floor_code(a)
    hi = torch.clamp(lo + 1, max=7)
    v_lo = vals[lo.long()]
    v_hi = vals[hi.long()]
    gap = torch.where(hi > lo, v_hi - v_lo, torch.ones_like(v_lo))
    frac = torch.where(hi > lo, (a - v_lo) / gap, torch.zeros_like(a))
    return lo, hi, frac


def round_stochastic(z: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Unbiased stochastic rounding between the two neighbouring codewords (seeded by `generator`)."""
    a = torch.clamp(z.abs(), max=E2M1_MAX)
    lo, hi, frac = _bracket(a)
    u = torch.rand(a.shape, generator=generator, device=a.device, dtype=torch.float32)
    mag = torch.where(u < frac, hi, lo)
    return _sign_bit(z) | mag


def round_guided(z: torch.Tensor, mantissa_bits: torch.Tensor, fallback_shift: float = 0.25,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """TRACE replay: of the two codewords around z take the one whose mantissa bit equals the rollout's.

    `mantissa_bits` is uint8/bool per element (unpacked). When z lies so far from the chosen codeword that
    the rollout's choice cannot have been one codeword away (distance > (0.5 + fallback_shift) of the
    spacing), the element falls back to nearest rounding. Returns (codes, fallback_mask).
    """
    a = torch.clamp(z.abs(), max=E2M1_MAX)
    lo, hi, frac = _bracket(a)
    bit = mantissa_bits.to(torch.uint8) & 1
    lo_matches = (lo & 1) == bit
    # At the top (lo == 7 == hi) a mismatching bit can only mean code 6.
    top = lo == hi
    chosen = torch.where(lo_matches, lo, torch.where(top, lo - 1, hi))
    vals = code_values(z.device)[:8]
    spacing = torch.where(top, vals[7] - vals[6], vals[hi.long()] - vals[lo.long()])
    dist = (a - vals[chosen.long()]).abs() / spacing
    fallback = dist > (0.5 + fallback_shift)
    nearest = round_nearest(z) & 7
    mag = torch.where(fallback, nearest, chosen)
    return _sign_bit(z) | mag, fallback


def mantissa_bits(codes: torch.Tensor) -> torch.Tensor:
    """The TRACE bit of each code (its lowest bit), uint8 0/1."""
    return codes & 1


def canonical(codes: torch.Tensor) -> torch.Tensor:
    """Codes with -0 mapped to +0, for counting value disagreements."""
    return torch.where(codes == 8, torch.zeros_like(codes), codes)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K] codes -> uint8 [..., K/2]; element 2i in the low nibble, 2i+1 in the high."""
    return (codes[..., 1::2] << 4) | codes[..., 0::2]


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_nibbles."""
    out = torch.stack([packed & 0x0F, packed >> 4], dim=-1)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


_BIT_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """0/1 [..., K] -> uint8 [..., K/8]; element 8j+i is bit i (LSB first) of byte j."""
    if bits.shape[-1] % 8:
        raise ValueError(f"pack_bits needs a last dimension divisible by 8, got {bits.shape[-1]}")
    w = _BIT_WEIGHTS.get(bits.device)
    if w is None:
        w = _BIT_WEIGHTS[bits.device] = (1 << torch.arange(8, dtype=torch.int32)).to(bits.device)
    b = bits.to(torch.int32).reshape(*bits.shape[:-1], bits.shape[-1] // 8, 8)
    return (b * w).sum(-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_bits: uint8 [..., K/8] -> uint8 0/1 [..., K]."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    b = (packed.unsqueeze(-1) >> shifts) & 1
    return b.reshape(*packed.shape[:-1], packed.shape[-1] * 8)


def check_rounding(rounding: str) -> None:
    if rounding not in ROUNDING_MODES:
        raise ValueError(f"rounding='{rounding}' is not supported; use one of {ROUNDING_MODES}")


def round_codes(z: torch.Tensor, rounding: str, trace_bits: Optional[torch.Tensor],
                generator: Optional[torch.Generator], fallback_shift: float, stats: Optional[dict]) -> torch.Tensor:
    """Codes of scaled values z in one of ROUNDING_MODES (guided: `trace_bits` packed, fallbacks counted in
    stats['guided_fallback'] / stats['guided_elements'] when a dict is given). Shared by both formats."""
    if rounding == "nearest":
        return round_nearest(z)
    if rounding == "stochastic":
        return round_stochastic(z, generator)
    if trace_bits is None:
        raise ValueError("rounding='guided' needs trace_bits (the rollout's packed mantissa bits)")
    expected = (*z.shape[:-1], z.shape[-1] // 8)
    if tuple(trace_bits.shape) != expected or trace_bits.dtype != torch.uint8:
        raise ValueError(f"trace_bits must be uint8 {expected} (8 bits per byte), got "
                         f"{trace_bits.dtype} {tuple(trace_bits.shape)}")
    codes, fallback = round_guided(z, unpack_bits(trace_bits), fallback_shift)
    if stats is not None:
        stats["guided_fallback"] = stats.get("guided_fallback", 0) + int(fallback.sum())
        stats["guided_elements"] = stats.get("guided_elements", 0) + fallback.numel()
    return codes


def encode(z: torch.Tensor, rounding: str, trace_bits: Optional[torch.Tensor], generator: Optional[torch.Generator],
           fallback_shift: float, stats: Optional[dict], capture: bool):
    """(packed codes uint8 [..., K/2], packed mantissa bits uint8 [..., K/8] or None) of scaled values z."""
    codes = round_codes(z, rounding, trace_bits, generator, fallback_shift, stats)
    return pack_nibbles(codes), (pack_bits(mantissa_bits(codes)) if capture else None)
