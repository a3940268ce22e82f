"""Triton FP4 quantize with TRACE capture: NVFP4 (16-element blocks, E4M3 scale + FP32 global scale) and
MXFP4 (32-element blocks, E8M0 scale).

Bit-exact contract: every byte (packed codes, block scales, mantissa bits) equals the torch reference in
megatron_qrl/quant (nvfp4.py, mxfp4.py, e2m1.py) computed on the CPU, on the GPU and under
TRITON_INTERPRET=1, for any finite input. How each fp32 step is kept exact:

* The input is a contiguous run of blocks (K % block == 0), so the kernel treats [M, K] as a 1-D array of
  blocks: a program owns BB consecutive blocks, one thread whole blocks, loaded with 16-byte vector loads
  (see _load_tile for the tile orientation, which differs between Triton 3.6 and 3.9). bf16 is widened
  by moving its bits (the interpreter's bf16 -> fp32 cast loses subnormals).
* NVFP4 block scale: s = amax_block / (6 * s_global) with a correctly rounded division (div_rn, never the
  approximate `/`), 0 -> 1, clamp [2^-9, 448], then fp32 -> E4M3 with integer bit arithmetic
  (round-to-nearest-even on the mantissa, subnormals below 2^-6 by a magic-number add), because the
  interpreter's float->fp8 cast rounds differently from the GPU's.
* z = x / (f32(s_block) * s_global) must be the correctly rounded quotient. DIV=0 uses div_rn per element.
  DIV=1 (default) uses y = RN(1/d) once per block and two Markstein corrections per element
  (q0 = x*y; q1 = q0 + (x - d*q0)*y; q2 = q1 + (x - d*q1)*y, the remainders by fma). q1 is within
  0.5 ulp + 2^-40 relative of x/d, which is Markstein's precondition, so q2 = RN(x/d) whenever the
  remainders do not underflow and nothing overflows; the kernel checks per tile that
  d in [2^-60, 2^60] and amax_block * y <= 2^100 and otherwise takes the div_rn path for that tile
  (CHECK=False skips the check when the wrapper computed s_global from this tensor and knows the bounds
  hold). Under those bounds every element whose code depends on z beyond its sign (|z| >= 2^-4) has
  |x| >= 2^-64, so the remainders are exact. The sign of a tiny quotient (-0 vs a negative subnormal,
  which decides code 0 vs 8) is decided exactly from x: RN(x/d) != 0  <=>  |x| > d * 2^-150, with the
  threshold computed exactly per block (`_zero_threshold`).
* E2M1 nearest (ties to even) from |z|: ROUND=2 (default) takes the minimum of three magic-number FMAs
  (`_e2m1_t`) and packs the codes with exact fp32 sums, keeping the work on the FMA pipe; ROUND=1 uses
  integer arithmetic on the fp32 bits; ROUND=0 counts the midpoints like the reference. All give the
  reference's codes.
* MXFP4: d = amax/6 (div_rn), e = ceil(log2 d) from d's bits, clamp [-127, 127]; z = x * 2^-e is exact
  (a power-of-two scaling, the same correctly rounded value as x / 2^e).
* Signs are set as bits, never by unary minus: Triton <= 3.6 lowers -v to 0 - v, which turns -0.0 into +0.0.

Codes are packed two per byte (element 2i low nibble), mantissa bits eight per byte (LSB first), so the
outputs are the reference's layouts. Used on CUDA, or on CPU tensors under TRITON_INTERPRET=1.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from megatron_qrl.quant.blocks import MXFP4_BLOCK, NVFP4_BLOCK

# Tile orientation that makes Triton give each thread whole blocks (see _load_tile): rows first up to 3.6.
ROWS_FIRST = tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 7)

# Tuned on an H200 (docs/PERF.md, "FP4 codec kernels"): blocks per program and warps per program.
DEFAULT_CONFIG = {
    "nvfp4": {"BB": 64, "num_warps": 1},
    "mxfp4": {"BB": 128, "num_warps": 4},
}


# ----------------------------------------------------------------------------------------------------------
# Device helpers (shared with fp4_fake_quant.py)
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _f32_to_e4m3(v):
    """v: fp32 in [2^-9, 448] -> (E4M3 bit pattern as int32, its exact fp32 value). Round to nearest even."""
    b = v.to(tl.int32, bitcast=True)
    # normal range (v >= 2^-6): keep 3 mantissa bits, ties to even; the carry may bump the exponent
    r = (b + (0x7FFFF + ((b >> 20) & 1))) & -1048576
    code_n = (r >> 20) - (120 << 3)           # ((exp32 - 127 + 7) << 3) | mant3
    val_n = r.to(tl.float32, bitcast=True)
    # subnormal range (v < 2^-6): multiples of 2^-9; v * 512 is exact, the add rounds to an integer (RNE)
    code_s = (v * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    val_s = code_s.to(tl.float32) * 0.001953125
    sub = v < 0.015625
    return tl.where(sub, code_s, code_n), tl.where(sub, val_s, val_n)


@triton.jit
def _e4m3_to_f32(c):
    """E4M3 (fn) bit pattern (int32 0..255) -> fp32 value, like torch's float8_e4m3fn -> float32."""
    mag = c & 0x7F
    e = mag >> 3
    m = mag & 7
    val_n = ((e + 120) << 23 | (m << 20)).to(tl.float32, bitcast=True)
    val_s = m.to(tl.float32) * 0.001953125
    v = tl.where(e == 0, val_s, val_n)
    v = tl.where(mag == 0x7F, float("nan"), v)
    # the sign goes in as a bit: Triton <= 3.6 lowers unary minus to 0 - v, which loses -0.0
    return (v.to(tl.int32, bitcast=True) | ((c & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_t(z):
    """2^23 + the nearest E2M1 magnitude index of |z| (ties to even, saturating), as an exact fp32.

    With a = min(|z|, 6), the index is RNE(phi(a)) for the concave piecewise-linear phi(a) =
    min(2a, a + 2, a/2 + 4), which maps the codewords 0 .. 6 to 0 .. 7 and their midpoints to half-integers
    (each adjacent pair lies in one linear piece). RNE is monotone, so RNE(min) = min(RNE): three magic
    FMAs (each rounds once, to an integer in [2^23, 2^24)) and two min. All on the FMA pipe but the mins.
    """
    a = tl.minimum(tl.abs(z), 6.0)
    t1 = a * 2.0 + 8388608.0            # 2^23 + RNE(2a)
    t2 = a + 8388610.0                  # 2^23 + RNE(a + 2)
    t3 = a * 0.5 + 8388612.0            # 2^23 + RNE(a/2 + 4)   (a/2 inexact only for subnormal a: moot)
    return tl.minimum(tl.minimum(t1, t2), t3)


@triton.jit
def _e2m1_nearest(z, ROUND: tl.constexpr):
    """Nearest E2M1 magnitude index 0..7 of |z| (ties to even, saturating above 6), int32."""
    if ROUND == 2:
        mag = _e2m1_t(z).to(tl.int32, bitcast=True) - 0x4B000000
    elif ROUND == 1:
        a = tl.minimum(tl.abs(z), 6.0)          # one FMNMX; saturation happens here
        b = a.to(tl.int32, bitcast=True)
        # 1 <= a <= 6: round to one mantissa bit (ties to even); (exponent, mantissa bit) - 252 = index
        hi = (b + (0x1FFFFF - (252 << 22) + ((b >> 22) & 1))) >> 22
        # a < 1: index = RNE(2a) in {0, 1, 2}; 2a is exact, the magic add rounds once
        lo = (a * 2.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
        mag = tl.where(a < 1.0, lo, hi)
    else:
        a = tl.abs(z)
        mag = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
               + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
               + (a > 5.0).to(tl.int32))
    return mag


@triton.jit
def _e2m1_value(i):
    """fp32 value of magnitude index i (int32 0..7): 0, .5, 1, 1.5, 2, 3, 4, 6."""
    v_n = ((((i >> 1) + 126) << 23) | ((i & 1) << 22)).to(tl.float32, bitcast=True)
    return tl.where(i < 2, i.to(tl.float32) * 0.5, v_n)


@triton.jit
def _zero_threshold(d):
    """Per block: T with  RN(x / d) != 0  <=>  |x| > T  for every fp32 x (d > 0 normal, d <= 2^60).

    RN(x/d) is 0 iff |x/d| <= 2^-150 (the tie goes to the even 0). For d < 2 every nonzero fp32 passes
    (T = 0). Otherwise T = the largest float <= d * 2^-150: p = RN(d * 2^-150) computed in two exact-then-
    rounded steps, stepped down one ulp when it rounded up (checked by scaling back exactly).
    """
    p = (d * 2.6469779601696886e-23) * 2.6469779601696886e-23          # 2^-75 twice; only the 2nd rounds
    up = (p * 3.777893186295716e22) * 3.777893186295716e22 > d          # exact scale-back by 2^150
    p_dn = (p.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True)
    t = tl.where(up, p_dn, p)
    return tl.where(d < 2.0, 0.0, t)


@triton.jit
def _nvfp4_block_scale(amax, gs):
    """amax per block (fp32), gs fp32 scalar -> (E4M3 bits int32, fp32 value of the scale)."""
    s = tl.math.div_rn(amax, gs * 6.0)
    s = tl.where(s == 0.0, 1.0, s)
    s = tl.minimum(tl.maximum(s, 0.001953125), 448.0)
    return _f32_to_e4m3(s)


@triton.jit
def _mxfp4_block_scale(amax):
    """amax per block -> (E8M0 byte as int32, 2^-e as fp32) with e = clamp(ceil(log2(amax/6)), -127, 127)."""
    d = tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32))
    b = d.to(tl.int32, bitcast=True)
    ex = b >> 23                    # biased exponent (d >= 0)
    mant = b & 0x7FFFFF
    e_norm = tl.where(mant == 0, ex - 127, ex - 126)
    two_m127 = tl.full(d.shape, 0x400000, tl.int32).to(tl.float32, bitcast=True)   # 2^-127 (subnormal)
    e_sub = tl.where(d > two_m127, -126, -127)   # d subnormal: ceil(log2 d) in [-149, -126]
    e = tl.where(ex == 0, e_sub, e_norm)
    e = tl.minimum(tl.maximum(e, -127), 127)
    inv_n = ((127 - e) << 23).to(tl.float32, bitcast=True)    # 2^-e for e <= 126
    inv = tl.where(e == 127, two_m127, inv_n)
    return e + 127, inv


@triton.jit
def _markstein_div(x, y, d):
    """RN(x / d) from y = RN(1/d): q0 = x*y and two corrections with exact (fma) remainders."""
    yb = tl.broadcast_to(y[None, :, None], x.shape)
    ndb = tl.broadcast_to((0.0 - d)[None, :, None], x.shape)      # -d (d > 0), per block
    q = x * yb
    q = tl.fma(tl.fma(q, ndb, x), yb, q)
    return tl.fma(tl.fma(q, ndb, x), yb, q)


@triton.jit
def _nvfp4_scaled_y(x, amax, d, y, DIV: tl.constexpr, CHECK: tl.constexpr, safe):
    """Correctly rounded z = x / d (d per block, broadcast over the [G/C, BB, C] tile; see the module doc),
    y = RN(1/d) per block. `safe` (False, or a scalar
    computed in the kernel from the tensor's amax) skips the per-tile range check like CHECK=False."""
    if DIV == 1:
        if CHECK:
            if safe:
                z = _markstein_div(x, y, d)
            else:
                # 2^-60 <= d <= 2^60 and amax * y <= 2^100 for every block of the tile, else div_rn
                ok = ((d >= 8.673617379884035e-19) & (d <= 1.152921504606847e18)
                      & (amax * y <= 1.2676506002282294e30))
                if tl.min(ok.to(tl.int32), axis=0) == 1:
                    z = _markstein_div(x, y, d)
                else:
                    z = tl.math.div_rn(x, tl.broadcast_to(d[None, :, None], x.shape))
        else:
            z = _markstein_div(x, y, d)   # the caller guarantees the bounds (see _SAFE_AMAX)
    else:
        z = tl.math.div_rn(x, tl.broadcast_to(d[None, :, None], x.shape))
    return z


@triton.jit
def _nvfp4_scaled(x, amax, d, DIV: tl.constexpr, CHECK: tl.constexpr, safe=False):
    """_nvfp4_scaled_y with y = RN(1/d) computed here (one div_rn per block)."""
    y = tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), d)
    return _nvfp4_scaled_y(x, amax, d, y, DIV, CHECK, safe)


@triton.jit
def _negative(x, z, d, DIV: tl.constexpr):
    """Where the reference's z = RN(x/d) is < 0 (the code's sign bit). d: per block, [1, BB, 1]."""
    if DIV == 1:
        # x < -T  <=>  x < 0 and |x| > T  <=>  RN(x/d) < 0  (T >= 0; -0.0 gives 0 like the reference)
        neg = x < 0.0 - _zero_threshold(d)
    else:
        neg = z < 0.0
    return neg


@triton.jit
def _pack_store_f(t, neg, packed_ptr, bits_ptr, rows, mask, BB: tl.constexpr, G: tl.constexpr,
                  C: tl.constexpr, CAPTURE: tl.constexpr, HAS_MASK: tl.constexpr, RB: tl.constexpr):
    """Like _pack_store, from t = 2^23 + magnitude index (fp32, canonical [G/C, BB, C]) and the sign mask.
    The 4-bit codes are combined into 16-bit words with exact fp32 arithmetic (4 codes < 2^16), so the
    packing runs on the FMA pipe; packed_ptr is the uint8 output viewed as int16."""
    H: tl.constexpr = G // C
    cf = t - tl.where(neg, 8388600.0, 8388608.0)                 # code incl. the sign bit, 0..15, exact
    w = tl.where(tl.arange(0, 4) == 0, 1.0, tl.where(tl.arange(0, 4) == 1, 16.0,
                 tl.where(tl.arange(0, 4) == 2, 256.0, 4096.0)))
    hw = tl.sum(tl.reshape(cf, (H, BB, C // 4, 4)) * w[None, None, None, :], axis=3)   # < 2^16, exact
    hb = ((hw + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000).to(tl.int16)
    _store_tile(packed_ptr, hb, rows, mask, BB, G // 4, C // 4, HAS_MASK, RB)
    if CAPTURE:
        code = t.to(tl.int32, bitcast=True)                          # its lowest bit is the mantissa bit
        _store_mantissa_bits(bits_ptr, code, rows, mask, BB, G, C, HAS_MASK, RB)


@triton.jit
def _store_mantissa_bits(bits_ptr, code, rows, mask, BB: tl.constexpr, G: tl.constexpr, C: tl.constexpr,
                         HAS_MASK: tl.constexpr, RB: tl.constexpr):
    """TRACE capture: the lowest bit of every code [G/C, BB, C], packed 8 per byte LSB first -> [rows, G/8]."""
    H: tl.constexpr = G // C
    shift = (tl.arange(0, H)[:, None, None] * C + tl.arange(0, C)[None, None, :]) % 8
    m = (code & 1) << shift
    m = tl.sum(tl.reshape(m, (G // 8, 8 // C, BB, C)), axis=3)
    bits = tl.sum(m, axis=1).to(tl.uint8)                      # [G/8, BB]
    if RB:
        bits = tl.permute(bits, (1, 0))
        boffs = rows[:, None] * (G // 8) + tl.arange(0, G // 8)[None, :]
        bmask = mask[:, None]
    else:
        boffs = rows[None, :] * (G // 8) + tl.arange(0, G // 8)[:, None]
        bmask = mask[None, :]
    if HAS_MASK:
        tl.store(bits_ptr + boffs, bits, mask=bmask)
    else:
        tl.store(bits_ptr + boffs, bits)


@triton.jit
def _load_tile(ptr, rows, mask, BB: tl.constexpr, G: tl.constexpr, C: tl.constexpr, HAS_MASK: tl.constexpr,
               RB: tl.constexpr):
    """The BB consecutive blocks of G elements, in fp32, as the canonical tile [G/C, BB, C] (chunk h of block r at
    [h, r, :]; a chunk is 16 bytes of input). Built so that Triton gives every thread whole blocks (no
    shuffles for the block amax): Triton orders tied dimensions differently across versions, so the load
    is issued as [BB, G/C, C] (RB=True, Triton <= 3.6) or [G/C, BB, C] and permuted (free) if needed."""
    H: tl.constexpr = G // C
    if RB:
        offs = rows[:, None, None] * G + tl.arange(0, H)[None, :, None] * C + tl.arange(0, C)[None, None, :]
        if HAS_MASK:
            x = tl.load(ptr + offs, mask=mask[:, None, None], other=0.0)
        else:
            x = tl.load(ptr + offs)
        x = tl.permute(x, (1, 0, 2))
    else:
        offs = rows[None, :, None] * G + tl.arange(0, H)[:, None, None] * C + tl.arange(0, C)[None, None, :]
        if HAS_MASK:
            x = tl.load(ptr + offs, mask=mask[None, :, None], other=0.0)
        else:
            x = tl.load(ptr + offs)
    if x.dtype == tl.bfloat16:
        # bf16 -> fp32 by moving the bits (exact, subnormals too; the interpreter's cast loses bf16
        # subnormals). On the GPU this is the same shift the native conversion does.
        x = (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        x = x.to(tl.float32)
    return x


@triton.jit
def _store_tile(ptr, v, rows, mask, BB: tl.constexpr, W: tl.constexpr, C: tl.constexpr, HAS_MASK: tl.constexpr,
                RB: tl.constexpr):
    """Store the canonical tile v [W/C, BB, C] to rows of W elements (row r, chunk h at r*W + h*C)."""
    H: tl.constexpr = W // C
    if RB:
        offs = rows[:, None, None] * W + tl.arange(0, H)[None, :, None] * C + tl.arange(0, C)[None, None, :]
        v = tl.permute(v, (1, 0, 2))
        if HAS_MASK:
            tl.store(ptr + offs, v, mask=mask[:, None, None])
        else:
            tl.store(ptr + offs, v)
    else:
        offs = rows[None, :, None] * W + tl.arange(0, H)[:, None, None] * C + tl.arange(0, C)[None, None, :]
        if HAS_MASK:
            tl.store(ptr + offs, v, mask=mask[None, :, None])
        else:
            tl.store(ptr + offs, v)


@triton.jit
def _pack_store(code, packed_ptr, bits_ptr, rows, mask, BB: tl.constexpr, G: tl.constexpr,
                C: tl.constexpr, CAPTURE: tl.constexpr, HAS_MASK: tl.constexpr, RB: tl.constexpr):
    """code: int32 canonical [G/C, BB, C] -> packed nibbles uint8 [BB, G/2] (element 2i low nibble) and,
    with CAPTURE, mantissa bits uint8 [BB, G/8] (element i is bit i%8 of byte i//8)."""
    H: tl.constexpr = G // C
    lo, hi = tl.split(tl.reshape(code, (H, BB, C // 2, 2)))
    packed = (lo | (hi << 4)).to(tl.uint8)
    _store_tile(packed_ptr, packed, rows, mask, BB, G // 2, C // 2, HAS_MASK, RB)
    if CAPTURE:
        _store_mantissa_bits(bits_ptr, code, rows, mask, BB, G, C, HAS_MASK, RB)


@triton.jit
def _load_global_scale(gs_ptr, blk0, rows, mask, nkb, PER_ROW: tl.constexpr):
    """The fp32 global scale: one per tensor, or (PER_ROW) one per row of nkb blocks, as a [BB] vector."""
    if PER_ROW:
        gs = tl.load(gs_ptr + (blk0 + rows) // nkb, mask=mask, other=1.0)
    else:
        gs = tl.load(gs_ptr)
    return gs


@triton.jit
def _abs_bits(v):
    """fp32 bit pattern of |v| as int32 (bf16 / fp16 / fp32 v). Non-negative floats order like their bits,
    and NaN / Inf sort above every finite value."""
    if v.dtype == tl.bfloat16:
        b = (v.to(tl.int16, bitcast=True).to(tl.int32) & 0x7FFF) << 16
    elif v.dtype == tl.float16:
        b = tl.abs(v).to(tl.float32).to(tl.int32, bitcast=True)
    else:
        b = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return b


@triton.jit
def _amax_bits_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """out[0] = max(out[0], bits of max |x|) over this program's BLOCK * ITERS elements (atomic max)."""
    base = tl.program_id(0).to(tl.int64) * (BLOCK * ITERS)
    offs = tl.arange(0, BLOCK)
    m = tl.zeros((BLOCK,), tl.int32)
    for i in range(ITERS):
        o = base + i * BLOCK + offs
        m = tl.maximum(m, _abs_bits(tl.load(x_ptr + o, mask=o < n, other=0.0)))
    tl.atomic_max(out_ptr, tl.max(m, axis=0))


@triton.jit
def _gs_from_amax(amax_ptr, gs_out_ptr):
    """s_global = amax / (6 * 448) (amax 0 -> 1; a true division, the CPU reference's value) from the amax
    bits of _amax_bits_kernel, as a [1] tensor; program 0 writes it out. Also whether the fast division may
    skip its range check (amax in [2^-40, 2^40], see _SAFE_AMAX), as a scalar."""
    a = tl.load(amax_ptr + tl.arange(0, 1)).to(tl.float32, bitcast=True)
    safe = tl.max(((a >= 9.094947017729282e-13) & (a <= 1099511627776.0)).to(tl.int32), axis=0) == 1
    a = tl.where(a > 0.0, a, 1.0)
    gs = tl.math.div_rn(a, tl.full(a.shape, 2688.0, tl.float32))
    tl.store(gs_out_ptr + tl.arange(0, 1), gs, mask=(tl.arange(0, 1) + tl.program_id(0)) == 0)
    return gs, safe


@triton.jit
def _block_amax(x):
    return tl.max(tl.max(tl.abs(x), axis=2), axis=0)   # [BB]


# ----------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _fp4_quant_kernel(x_ptr, gs_ptr, gs_out_ptr, packed_ptr, scales_ptr, bits_ptr, n_blocks, nkb,
                      FMT: tl.constexpr, BB: tl.constexpr, C: tl.constexpr, CAPTURE: tl.constexpr,
                      HAS_MASK: tl.constexpr, DIV: tl.constexpr, ROUND: tl.constexpr, CHECK: tl.constexpr,
                      RB: tl.constexpr, PER_ROW: tl.constexpr, GS_AMAX: tl.constexpr):
    """FMT 0 = NVFP4 (G=16), 1 = MXFP4 (G=32). One program: BB consecutive blocks. C = elements per 16 B.
    CHECK=False skips the per-tile range check of the fast division (see _nvfp4_scaled). PER_ROW: one
    NVFP4 global scale per row of nkb blocks.
    GS_AMAX: gs_ptr holds the amax bits of _amax_bits_kernel; the global scale is computed here (and written
    to gs_out_ptr by program 0), with no host round trip."""
    G: tl.constexpr = 16 if FMT == 0 else 32
    blk0 = tl.program_id(0).to(tl.int64) * BB
    rows = tl.arange(0, BB)
    x_ptr += blk0 * G
    packed_ptr += blk0 * (G // 2)
    scales_ptr += blk0
    if CAPTURE:
        bits_ptr += blk0 * (G // 8)
    mask = (blk0 + rows) < n_blocks
    x = _load_tile(x_ptr, rows, mask, BB, G, C, HAS_MASK, RB)
    amax = _block_amax(x)
    if FMT == 0:
        if GS_AMAX:
            gs, safe = _gs_from_amax(gs_ptr, gs_out_ptr)
        else:
            gs = _load_global_scale(gs_ptr, blk0, rows, mask, nkb, PER_ROW)
            safe = False
        scode, sval = _nvfp4_block_scale(amax, gs)
        d = sval * gs
        z = _nvfp4_scaled(x, amax, d, DIV, CHECK, safe)
        neg = _negative(x, z, d[None, :, None], DIV)
    else:
        scode, inv = _mxfp4_block_scale(amax)
        z = x * inv[None, :, None]
        neg = z < 0.0
    if HAS_MASK:
        tl.store(scales_ptr + rows, scode.to(tl.uint8), mask=mask)
    else:
        tl.store(scales_ptr + rows, scode.to(tl.uint8))
    if ROUND == 2:
        _pack_store_f(_e2m1_t(z), neg, packed_ptr.to(tl.pointer_type(tl.int16)), bits_ptr, rows, mask, BB, G, C,
                      CAPTURE, HAS_MASK, RB)
    else:
        code = _e2m1_nearest(z, ROUND) | tl.where(neg, 8, 0)
        _pack_store(code, packed_ptr, bits_ptr, rows, mask, BB, G, C, CAPTURE, HAS_MASK, RB)


# ----------------------------------------------------------------------------------------------------------
# Python wrappers
# ----------------------------------------------------------------------------------------------------------
# With s_global = amax/2688 and amax in [2^-40, 2^40], every block has d = s_block * s_global in
# [2^-9 * 2^-51.4, 448 * 2^28.6] and amax_block / d <= 2688 * 512, inside the fast division's bounds.
_SAFE_AMAX = (2.0 ** -40, 2.0 ** 40)


def amax_bits(x: torch.Tensor) -> torch.Tensor:
    """int32 [1]: the fp32 bits of max |x| (NaN / Inf above every finite value), one read of x."""
    out = torch.zeros(1, dtype=torch.int32, device=x.device)
    n = x.numel()
    block = 2048
    iters = 8 if n >= (1 << 22) else 1
    _amax_bits_kernel[(triton.cdiv(n, block * iters),)](x, out, n, BLOCK=block, ITERS=iters, num_warps=4)
    return out


def _check_amax_bits(bits: torch.Tensor, where: str) -> None:
    """Host check (one sync) that the amax from amax_bits is finite."""
    if (int(bits.item()) & 0x7FFFFFFF) >= 0x7F800000:
        _raise_nonfinite(where)


def _as_blocks(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_contiguous() else x.contiguous()


def _launch_quant(x, gs_t, fmt, capture, BB, num_warps, div, round_impl, check, rows_first=None, amax=None):
    """The quantize kernel. gs_t: the global scale (scalar or per row), or None with `amax` (amax_bits):
    then the kernel computes it; returns (packed, scales, bits or None, global scale)."""
    G = NVFP4_BLOCK if fmt == 0 else MXFP4_BLOCK
    lead, K = x.shape[:-1], x.shape[-1]
    n_blocks = x.numel() // G
    packed = torch.empty((*lead, K // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((*lead, K // G), dtype=torch.uint8, device=x.device)
    bits = torch.empty((*lead, K // 8), dtype=torch.uint8, device=x.device) if capture else packed
    grid = (triton.cdiv(n_blocks, BB),)
    per_row = gs_t is not None and gs_t.dim() > 0
    gs_amax = fmt == 0 and gs_t is None
    if gs_amax:
        gs_out = torch.empty((), dtype=torch.float32, device=x.device)
        check = True
    _fp4_quant_kernel[grid](x, amax if gs_amax else (gs_t if gs_t is not None else x),
                            gs_out if gs_amax else x, packed, scales, bits, n_blocks, K // G,
                            FMT=fmt, BB=BB, C=16 // x.element_size(), CAPTURE=capture,
                            HAS_MASK=(n_blocks % BB != 0), DIV=div, ROUND=round_impl, CHECK=check,
                            RB=ROWS_FIRST if rows_first is None else rows_first, PER_ROW=per_row,
                            GS_AMAX=gs_amax, num_warps=num_warps)
    return packed, scales, (bits if capture else None), (gs_out if gs_amax else gs_t)


def _raise_nonfinite(where: str) -> None:
    raise ValueError(f"{where}: input holds NaN or Inf values; FP4 cannot encode them "
                     "(find where they come from: overflow, bad data, a diverged step)")


def as_global_scale(global_scale, x: torch.Tensor, where: str) -> torch.Tensor:
    """fp32 0-dim, or one scale per row ([..., 1], contiguous) like the reference accepts."""
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
    if gs.numel() == 1:
        return gs.reshape(())
    if tuple(gs.shape) == (*x.shape[:-1], 1):
        return gs.contiguous()
    raise ValueError(f"{where}: global_scale must be a scalar or one per row {(*x.shape[:-1], 1)}, "
                     f"got {tuple(gs.shape)}")


def nvfp4_quantize_triton(x: torch.Tensor, global_scale: Optional[torch.Tensor] = None, capture: bool = False,
                          *, check_finite: bool = True, block_blocks: Optional[int] = None,
                          num_warps: Optional[int] = None, div: int = 1, round_impl: int = 2,
                          rows_first: Optional[bool] = None):
    """NVFP4 nearest quantization on the Triton kernel; the same contract as `nvfp4_quantize(x, gs)`.

    Returns (packed uint8 [..., K/2], scales float8_e4m3fn [..., K/16], global_scale fp32 0-dim) and with
    capture=True also the packed mantissa bits uint8 [..., K/8]. global_scale: a scalar or one per row
    ([..., 1]). x: fp32/fp16/bf16, last dim % 16 == 0, any leading dims (a non-contiguous x is copied
    first). global_scale=None: amax / (6 * 448) from a one-read amax kernel and computed inside the quantize
    kernel (the CPU reference's value; torch on CUDA can be 1 ulp off, see docs/PERF.md), no host round trip.
    check_finite=True rejects NaN/Inf like the reference: one host sync after the launch (plus the amax
    read when global_scale is given); check_finite=False never synchronizes (NaN/Inf then give unspecified
    bytes). block_blocks / num_warps override the tuned launch; div=0 (div_rn per element) and
    round_impl=1 (integer bit tricks) / 0 (midpoint counting) select other implementations (same bytes,
    slower on an H200); rows_first picks the tile orientation (default: the one that suits the installed
    Triton, see _load_tile).
    """
    where = "nvfp4_quantize_triton"
    check_input_fast(x, NVFP4_BLOCK, where)
    x = _as_blocks(x.detach())
    if global_scale is not None:
        global_scale = as_global_scale(global_scale, x, where)
    amax = amax_bits(x) if (global_scale is None or check_finite) else None
    cfg = DEFAULT_CONFIG["nvfp4"]
    packed, scales, bits, global_scale = _launch_quant(
        x, global_scale, 0, capture, block_blocks or cfg["BB"], num_warps or cfg["num_warps"], div,
        round_impl, True, rows_first, amax)
    if check_finite:
        _check_amax_bits(amax, where)
    scales = scales.view(torch.float8_e4m3fn)
    if capture:
        return packed, scales, global_scale, bits
    return packed, scales, global_scale


def mxfp4_quantize_triton(x: torch.Tensor, capture: bool = False, *, check_finite: bool = True,
                          block_blocks: Optional[int] = None, num_warps: Optional[int] = None,
                          round_impl: int = 2, rows_first: Optional[bool] = None):
    """MXFP4 nearest quantization on the Triton kernel; the same contract as `mxfp4_quantize(x)`:
    (packed uint8 [..., K/2], E8M0 scales uint8 [..., K/32]) [+ bits uint8 [..., K/8]]."""
    where = "mxfp4_quantize_triton"
    check_input_fast(x, MXFP4_BLOCK, where)
    x = _as_blocks(x.detach())
    amax = amax_bits(x) if check_finite else None
    cfg = DEFAULT_CONFIG["mxfp4"]
    packed, scales, bits, _ = _launch_quant(x, None, 1, capture, block_blocks or cfg["BB"],
                                            num_warps or cfg["num_warps"], 1, round_impl, False, rows_first)
    if check_finite:
        _check_amax_bits(amax, where)
    if capture:
        return packed, scales, bits
    return packed, scales


def check_input_fast(x: torch.Tensor, block: int, where: str) -> None:
    """The reference's input checks without its finiteness pass (done by the callers, see check_finite)."""
    from megatron_qrl.quant.validate import check_input

    check_input(x, block, where, check_finite=False)


__all__ = ["nvfp4_quantize_triton", "mxfp4_quantize_triton", "DEFAULT_CONFIG", "check_input_fast",
           "as_global_scale", "amax_bits"]
