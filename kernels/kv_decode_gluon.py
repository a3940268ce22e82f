"""Decode attention over the packed NVFP4 (and FP8) KV cache on Hopper, written in Gluon: one warp per program, the
K and V tiles decoded straight into MMA registers (no layout change through shared memory, no barrier between
warps).

Why: the Triton kernel (kv_decode_attention.py) spends its time in instructions, not bytes. On sm_90a its loop
issues ~48 warp instructions per cached position at 32/4 heads, a third of them register moves that rebuild
MMA fragments after shared-memory round trips; it streams NVFP4 at 1.2-1.4 TB/s while bf16 SDPA streams 2.5-4
TB/s (docs/PERF.md). Here each lane loads exactly the bytes its MMA fragments hold, as 16- or 8-byte vectors:

* Scores as S^T = K Q^T (mma.sync m16n8k16; M = positions, N = the GQA group padded to 8, K = head_dim). In a
  k16 slice the A fragment of lane (g, t) holds K positions 2t, 2t+1, 2t+8, 2t+9 of rows g and g+8; the dot
  may sum head_dim in any order that Q^T follows, so lane t takes the whole 32-element packing group t of its
  rows (16 contiguous bytes) and the logical order is
      k = 64 h + 32 j3 + 16 j2 + 8 j1 + 2 gr + j0   <->   d = 32 gr + 16 h + 8 j3 + 4 j2 + 2 j1 + j0
  (gr = group, byte j = 8 j3 + 4 j2 + 2 j1 + j0 holds elements j (h = 0) and 16 + j (h = 1); `q_order`).
  Q^T is gathered in that order once per program. The scale pair of a group (its low and high blocks) is
  one 16-bit load per row.
* Output as O^T = V^T P^T (M = head_dim, N = the group, K = positions): the A fragment wants pairs of
  positions per register, so lane (g, t) takes positions 2t, 2t+1, 2t+8, 2t+9 (+16 ...) and half group g of
  each (8 contiguous bytes); head_dim rows are in the logical order
      row = hg + 8 j0 + 16 j1 + 32 w + 64 h   <->   d = 32 (hg // 2) + 16 h + 8 (hg % 2) + 4 w + 2 j1 + j0
  (`o_order`), undone at the store. P^T comes from the score accumulator with one layout conversion.
* Softmax over positions is a reduction across the lanes of one warp (shuffles). The GQA group is the MMA's N,
  not its M: no softmax work on padding rows at 8 query heads per KV head.
* The bytes arrive ahead of their trip (PREFETCH): by default the code words, scale pairs and row scales
  through a ring of shared-memory slots filled by cp.async two trips ahead (the scales a row per lane, read back
  by other lanes after the ring's wait and a barrier).
* Up to MERGE_MAX_SPLITS splits, the program that finishes last merges the splits' partials (a counter per
  row and KV head, acq_rel): no combine launch.
* FP8 (E4M3 + a row scale): the same program with wider groups (a lane takes 32 K bytes of a row, 16 V bytes of
  a position), `cvt.rn.f16x2.e4m3x2` for the values, one prmt per V word pair to put two positions in a register
  (`q_order("fp8")`, `o_order("fp8")`).
Numerics are the Triton kernel's (code * s * 2^-9 in fp16, exact; q scaled per head by a power of two into
fp16; fp32 accumulation; p * (vr / max vr) in fp16), so the two agree to fp32 rounding order.

Gluon compiles for sm_90 only; there is no interpreter path. `emulate_orders` checks the two index maps on
the CPU; the GPU tests run the kernel against the dequantize-then-softmax reference.
"""
from __future__ import annotations

import math

import torch
import triton

from .attention_combine import _combine_kernel
from .kv_layout import PackedKV

TILE = 32            # positions per loop trip (2 m16 tiles of scores, 2 k16 steps of P.V)
RING_STAGES = 3      # prefetch >= 2: shared-memory slots of the cp.async ring (code words; scales at 3)
HEAD_DIM = 128
HEADS = 8            # query heads per KV head, padded: the MMA's N
# defaults: tools/bench_attention.py's sweeps on an H100, 2026-12-06 (docs/PERF.md): code words and scales
# through the cp.async ring (prefetch 3; 2 below 32-position trips) with long splits; `default_min_tiles` picks
# the trips per split, `small_grid_splits` the split count where long splits would leave SMs idle
PROGRAMS_PER_SM = 4   # one-warp programs: split target for kv_decode_attention.split_count
MIN_TILES = 16        # ... but a split keeps at least this many TILE steps
SMALL_GRID_MIN_TILES = 2  # ... or this many where 16-trip splits leave fewer than 2 programs per SM
SMALL_GRID_ROUND_DOWN = True  # ... and there about PROGRAMS_PER_SM programs per SM, rounded down (small_grid_splits)
LOG2E = math.log2(math.e)
# FP8 takes this kernel by default from this many (row, KV head) pairs (docs/PERF.md: at 64 pairs, 32/4 heads x
# batch 16, 1.12x the Triton kernel on an H200 and 1.02x on an H100; 0.9x at 4 pairs on both); kernel="gluon"
# forces it
FP8_MIN_PAIRS = 64
# The in-kernel merge loads this many splits' partials at a time, 32 floats a lane each (H200, 4 splits: 47.2 us
# against 50.4 at 2 and 50.7 with the combine launch; with 4 or more splits the kernel takes 186 registers, not
# 156, where the grid is small anyway)
MERGE_ROUND = 4
# The ring's copies skip rows past the split's end (zero-filled) instead of rereading its last row: no bytes for
# the look-ahead trips past the end. H100, 2026-12-07: 1.01-1.04x at all six shapes of tools/bench_attention.py
# (NVFP4; 32/4 batch 16 x 4,096: 30.1 us against 30.8); 978 loop instructions per trip, not 983
RING_MASKS = True
# The split's partial O goes out as 16-byte stores (4 contiguous head_dim values x 8 heads a lane, one layout change
# through shared memory) instead of 32 scattered 4-byte stores a lane: on an H100 (ncu source counters, 32/4 heads,
# batch 16 x 4,096) those stores' LG throttle and the exit's drain behind them were ~14% of the warp's stall samples.
# H100, 2026-12-07 (with Q_VECTOR_LOADS; tools/bench_attention.py, 8 shapes): NVFP4 1.00-1.35x, FP8 1.00-1.12x
VECTOR_STORES = True
# Q^T comes in as four 16-byte loads a lane (head g's 32 contiguous values of group t, reordered into the score MMA's
# B fragment by a reshape + permute that moves no data) instead of 32 two-byte gathers in q_order: on an H100 (ncu
# source counters, as above) the q gather's wait was ~7% of the warp's stall samples. Timed with VECTOR_STORES (above)
Q_VECTOR_LOADS = True

# Four E4M3 bytes -> two fp16x2 (bytes 0, 1 and 2, 3), the GPU's conversion (kv_decode_attention's FP8 V tiles too)
FP8_WORD_ASM = triton.language.constexpr("""{
.reg .b16 lo, hi;
mov.b32 {lo, hi}, $2;
cvt.rn.f16x2.e4m3x2 $0, lo;
cvt.rn.f16x2.e4m3x2 $1, hi;
}""")
# Two positions' words of E4M3 bytes (even $4, odd $5) -> four fp16x2 (byte b of each: even low, odd high)
_FP8_PAIR_ASM = triton.language.constexpr("""{
.reg .b32 t0, t1;
.reg .b16 l0, h0, l1, h1;
prmt.b32 t0, $4, $5, 0x5140;
prmt.b32 t1, $4, $5, 0x7362;
mov.b32 {l0, h0}, t0;
mov.b32 {l1, h1}, t1;
cvt.rn.f16x2.e4m3x2 $0, l0;
cvt.rn.f16x2.e4m3x2 $1, h0;
cvt.rn.f16x2.e4m3x2 $2, l1;
cvt.rn.f16x2.e4m3x2 $3, h1;
}""")

try:  # Gluon ships with Triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

    from .w4a16_gluon_gemm import HAVE_GLUON
    if HAVE_GLUON:
        from .w4a16_gluon_gemm import _DECODE_WORD_ASM, _SCALE_ASM, _decode_pairs, _halves, _joined_halves
except Exception:  # pragma: no cover - an old Triton: packed_decode_attention keeps the Triton kernel
    HAVE_GLUON = False


def _small_grid(batch: int, kv_heads: int, max_len: int, sms: int, tile: int) -> bool:
    """Would 16-trip splits leave fewer than 2 programs per SM?"""
    return batch * kv_heads * triton.next_power_of_2(triton.cdiv(max_len, tile * MIN_TILES)) < 2 * sms


def default_min_tiles(batch: int, kv_heads: int, max_len: int, sms: int, tile: int = TILE) -> int:
    """Trips per split: 16 (the ring fills once per program, so long programs win: 32/4 heads, batch 16: 37.6 us
    at 8 splits against 39.8 at 16), unless 16-trip splits leave fewer than 2 programs per SM (batch 1: 15.7 us
    at 64 splits against 27.1 at 16)."""
    return SMALL_GRID_MIN_TILES if _small_grid(batch, kv_heads, max_len, sms, tile) else MIN_TILES


def small_grid_splits(batch: int, kv_heads: int, max_len: int, sms: int, tile: int = TILE) -> int | None:
    """Splits per (row, KV head) where 16-trip splits leave SMs idle (None elsewhere: split_count's rule): about
    PROGRAMS_PER_SM programs per SM rounded down to a power of two, each of at least SMALL_GRID_MIN_TILES trips.
    H100, batch 1, 32/4 heads, us at 4k / 8k / 16k: 9.0 / 10.1 / 12.0 with split_count's rule (round up, 4 trips),
    8.1 / 9.1 / 12.0 this way; 32/8 heads at 16k 17.1 -> 16.5 (docs/PERF.md, 2026-12-07 fourth session)."""
    if not SMALL_GRID_ROUND_DOWN or not _small_grid(batch, kv_heads, max_len, sms, tile):
        return None
    want = max(1, PROGRAMS_PER_SM * sms // (batch * kv_heads))
    want = 1 << (want.bit_length() - 1)                                   # a power of two, rounded down
    return max(1, min(want, triton.next_power_of_2(triton.cdiv(max_len, tile * SMALL_GRID_MIN_TILES))))


def default_prefetch(tile: int) -> int:
    """3 (codes and scales through the ring: 1.05-1.25x prefetch 2, docs/PERF.md) at 32-position trips, 2 below
    (3 needs a scale row per lane), none above (the ring's shared memory grows with the trip; not measured)."""
    return 3 if tile == 32 else 2 if tile < 32 else 0


def supported(fmt: str, head_dim: int, group: int, q_dtype: torch.dtype, tile: int = TILE) -> bool:
    """Whether this kernel takes the call: NVFP4 (or FP8 at 32-position trips), head_dim 128, up to 8 query heads
    per KV head, 16-bit q."""
    return (HAVE_GLUON and (fmt == "fp4" or (fmt == "fp8" and tile == TILE)) and head_dim == HEAD_DIM
            and group <= HEADS and q_dtype in (torch.bfloat16, torch.float16))


def q_order(fmt: str = "fp4") -> torch.Tensor:
    """Physical head_dim index of each logical K position of the score MMA (module docstring; FP8: lane t takes
    the 32 bytes of group t, word w per k16 slice: k = 16 w + 8 r + 2 t + e <-> d = 32 t + 4 w + 2 r + e)."""
    k = torch.arange(HEAD_DIM)
    if fmt == "fp8":
        e, gr, r, w = k & 1, (k >> 1) & 3, (k >> 3) & 1, k >> 4
        return 32 * gr + 4 * w + 2 * r + e
    j0, gr, j1, j2, j3, h = k & 1, (k >> 1) & 3, (k >> 3) & 1, (k >> 4) & 1, (k >> 5) & 1, k >> 6
    return 32 * gr + 16 * h + 8 * j3 + 4 * j2 + 2 * j1 + j0


def o_order(fmt: str = "fp4") -> torch.Tensor:
    """Physical head_dim index of each logical row of the output MMA (module docstring; FP8: lane g takes the
    16 bytes of group g: row = 32 j + 8 b + g <-> d = 16 g + 4 j + b)."""
    r = torch.arange(HEAD_DIM)
    if fmt == "fp8":
        g, b, j = r & 7, (r >> 3) & 3, r >> 5
        return 16 * g + 4 * j + b
    hg, j0, j1, w, h = r & 7, (r >> 3) & 1, (r >> 4) & 1, (r >> 5) & 1, r >> 6
    return 32 * (hg >> 1) + 16 * h + 8 * (hg & 1) + 4 * w + 2 * j1 + j0


def emulate_orders(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fmt: str = "fp4") -> torch.Tensor:
    """softmax(q k^T) v computed through the kernel's logical orders (q [H, D], k / v [S, D]): equal to the
    plain computation exactly when the orders are permutations that q, K and the output store agree on."""
    qo, oo = q_order(fmt), o_order(fmt)
    s_t = k[:, qo] @ q[:, qo].T                          # S^T [S, H], K in logical order
    p_t = torch.softmax(s_t, 0)
    o_t = v[:, oo].T @ p_t                               # O^T [D (logical rows), H]
    out = torch.empty(q.shape[1], q.shape[0], dtype=o_t.dtype)
    out[oo] = o_t                                        # the store: logical row -> physical d
    return out.T


if HAVE_GLUON:
    @gluon.constexpr_function
    def _rows_layout(tile, reg, lane, shape):
        """A [tile, ...] layout of one warp: the given register and lane bases, then rows + 16, + 32 ... in
        registers."""
        reg = list(reg)
        r = 16
        while r < tile:
            reg.append([r] + [0] * (len(shape) - 1))
            r *= 2
        return gl.DistributedLinearLayout(reg, lane, [], [], [tile] + list(shape[1:]))

    @gluon.constexpr_function
    def _k_layout(tile, kw):
        """[tile, 4 (group gr), kw (word w)] int32 K code words (kw = 4 NVFP4, 8 FP8): lane (g, t) -> rows g,
        group t; registers: the kw words of the group (16 / 32 contiguous bytes), row + 8, row + 16 ..."""
        words = [[0, 0, 1 << i] for i in range(kw.bit_length() - 1)]
        return _rows_layout(tile, words + [[8, 0, 0]],
                            [[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]], [tile, 4, kw])

    @gluon.constexpr_function
    def _v_layout(tile, vw):
        """[tile, 8 (half group hg / group g), vw (word w)] int32 V code words (vw = 2 NVFP4, 4 FP8): lane (g, t)
        -> half group (NVFP4) or 16-byte group (FP8) g, positions 2t (lane bits 0-1 are position bits 1-2);
        registers: the vw words (8 / 16 contiguous bytes), position + 1, + 8, + 16 ..."""
        words = [[0, 0, 1 << i] for i in range(vw.bit_length() - 1)]
        return _rows_layout(tile, words + [[1, 0, 0], [8, 0, 0]],
                            [[2, 0, 0], [4, 0, 0], [0, 1, 0], [0, 2, 0], [0, 4, 0]], [tile, 8, vw])

    @gluon.jit
    def _decode(words, sp):
        """words [R, X, W] int32 code words, sp [R, X] int16 scale pairs -> fp16 [R, X, W, j0, j1, h]:
        code * 2^-14 * s * 2^5 (exact), byte 4 w + 2 j1 + j0 of the words' 16-byte group, low (h = 0) or high
        element (w4a16_gluon_gemm's word decode)."""
        return _decode_pairs(words, sp, _SCALE_ASM, _DECODE_WORD_ASM).to(gl.float16, bitcast=True)

    @gluon.jit
    def _decode_k_fp8(kw, TILE: gl.constexpr):
        """K words [TILE, 4 gr, 8 w] of E4M3 bytes -> fp16 [TILE, 128] in the score MMA's logical K order
        k = 16 w + 8 r + 2 gr + e (byte 2 r + e of word w; `q_order("fp8")`); the values exactly."""
        c0, c1 = gl.inline_asm_elementwise(FP8_WORD_ASM, "=r,=r,r", [kw], dtype=(gl.int32, gl.int32),
                                           is_pure=True, pack=1)
        b0, b1 = _halves(c0)
        b2, b3 = _halves(c1)
        k = gl.join(gl.join(b0, b1), gl.join(b2, b3))                    # [TILE, gr, w, e, r]
        k = gl.permute(k, [0, 2, 4, 1, 3])                                # [TILE, w, r, gr, e]
        return gl.reshape(k, [TILE, 128]).to(gl.float16, bitcast=True)

    @gluon.jit
    def _decode_v_fp8(vw, TILE: gl.constexpr):
        """V words [TILE, 8 g, 4 j] of E4M3 bytes -> fp16 V^T [128, TILE], head_dim rows in the logical order
        32 j + 8 b + g (byte b of word j of group g; `o_order("fp8")`): two positions' bytes interleaved by one
        prmt, so each register holds a position pair of one head_dim element, as the P.V MMA's A wants."""
        pairs = gl.permute(gl.reshape(vw, [TILE // 2, 2, 8, 4]), [0, 2, 3, 1])   # [T/2, g, j, position bit 0]
        even, odd = gl.split(pairs)
        d0, d1, d2, d3 = gl.inline_asm_elementwise(_FP8_PAIR_ASM, "=r,=r,=r,=r,r,r", [even, odd],
                                                   dtype=(gl.int32, gl.int32, gl.int32, gl.int32),
                                                   is_pure=True, pack=1)
        v = _joined_halves(d0, d1, d2, d3)                                # [T/2, g, j, pair, b0, b1]
        v = gl.permute(v, [2, 5, 4, 1, 0, 3])                             # [j, b1, b0, g, T/2, pair]
        return gl.reshape(v, [128, TILE]).to(gl.float16, bitcast=True)

    @gluon.jit
    def _q_operand(q_ptr, q_row0, GROUP, N: gl.constexpr, b_op: gl.constexpr):
        """Q^T [128 (logical k), N heads] in the score MMA's B fragment layout, loaded as 16-byte vectors: lane
        (g, t) holds head g's 32 contiguous values of group t (d = 32 t + e), which are exactly its B fragment
        registers in q_order for both formats (k = 64 e4 + 32 e3 + 16 e2 + 8 e1 + 2 t + e0), so the reshape +
        permute to logical k moves no data (the convert_layout asserts it)."""
        ql: gl.constexpr = gl.DistributedLinearLayout([[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 0, 16]],
                                                      [[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
                                                      [], [], [N, 4, 32])
        hq = gl.arange(0, N, gl.SliceLayout(1, gl.SliceLayout(2, ql)))
        gq = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(2, ql)))
        eq = gl.arange(0, 32, gl.SliceLayout(0, gl.SliceLayout(1, ql)))
        offs = (gl.expand_dims(gl.expand_dims((q_row0 + hq).to(gl.int64) * 128, 1), 2)
                + gl.expand_dims(gl.expand_dims(gq * 32, 0), 2) + gl.expand_dims(gl.expand_dims(eq, 0), 1))
        mask = gl.expand_dims(gl.expand_dims(hq < GROUP, 1), 2)
        q3 = gl.load(q_ptr + offs, mask=mask, other=0.0)                 # [N, gr, e]
        q = gl.permute(gl.reshape(q3, [N, 4, 2, 2, 2, 2, 2]), [2, 3, 4, 5, 1, 6, 0])
        return gl.convert_layout(gl.reshape(q, [128, N]), b_op, assert_trivial=True)

    @gluon.jit
    def _q_pow2(amax):
        """Per head: f = 2^(141 - e) with amax in [2^(e-127), 2^(e-126)) (amax * f in [2^14, 2^15): fp16 holds
        the bf16 values of the head exactly); 1 / f. Zero heads (padding) get f = 2^-14."""
        e = (amax.to(gl.int32, bitcast=True) >> 23) & 0xFF
        fe = gl.minimum(gl.maximum(268 - e, 1), 254)
        return (fe << 23).to(gl.float32, bitcast=True), ((254 - fe) << 23).to(gl.float32, bitcast=True)

    @gluon.jit
    def _word_ptrs(s0, s_end, stream, kw_ptr, vw_ptr, k_rows, k_grw, v_rows, v_hgw, ROW_WORDS: gl.constexpr):
        """Addresses of one trip's K / V code words (positions s0 .. s0 + TILE) for the register loads (PREFETCH 0
        / 1). Rows past the split reread its last row (no masks; the caller masks the scores), so a prefetch past
        the end is harmless."""
        last = s_end - 1
        rk = stream + gl.minimum(s0 + k_rows, last)
        rv = stream + gl.minimum(s0 + v_rows, last)
        return (kw_ptr + gl.expand_dims(gl.expand_dims(rk * ROW_WORDS, 1), 2) + k_grw,
                vw_ptr + gl.expand_dims(gl.expand_dims(rv * ROW_WORDS, 1), 2) + v_hgw)

    @gluon.jit
    def _load_scales(s0, s_end, stream, ks16, vs16, kr_ptr, vr_ptr, k_rows, k_gr, v_rows, v_hg, c_rows):
        """One trip's K / V scale pairs and row scales (rows clamped like _word_ptrs)."""
        last = s_end - 1
        rk = stream + gl.minimum(s0 + k_rows, last)
        rv = stream + gl.minimum(s0 + v_rows, last)
        rc = stream + gl.minimum(s0 + c_rows, last)
        return (gl.load(ks16 + gl.expand_dims(rk * 4, 1) + gl.expand_dims(k_gr, 0)),
                gl.load(vs16 + gl.expand_dims(rv * 4, 1) + gl.expand_dims(v_hg // 2, 0)),
                gl.load(kr_ptr + rc), gl.load(vr_ptr + rc))

    @gluon.jit
    def _copy_words(s0, s_end, stream, kw_ptr, vw_ptr, k_rows, k_grw, v_rows, v_hgw, kw_s, vw_s,
                    ROW_WORDS: gl.constexpr, MASKED: gl.constexpr):
        """The ring's copy of one trip's K / V code words (positions s0 .. s0 + TILE) into slots kw_s / vw_s.
        Unmasked (the default), rows past the split reread its last row (_word_ptrs), so the look-ahead copies
        past the end of every split still move bytes (a quarter of an 8-trip split's) and the program drains
        them at exit. MASKED (RING_MASKS; compiled, not yet timed on a GPU): rows at or past s_end are not read
        (cp.async zero-fills them: code 0 decodes to 0, the caller masks the scores), so a trip wholly past the
        end moves no bytes."""
        if MASKED:
            lim = s_end - s0                    # rows of this trip that exist: per-row compares with one scalar
            k_ok = gl.expand_dims(gl.expand_dims(k_rows < lim, 1), 2)
            v_ok = gl.expand_dims(gl.expand_dims(v_rows < lim, 1), 2)
            row0 = (stream + s0) * ROW_WORDS      # the trip's first word: one scalar, loop-invariant offsets after it
            async_copy.async_copy_global_to_shared(
                kw_s, (kw_ptr + row0) + (gl.expand_dims(gl.expand_dims(k_rows * ROW_WORDS, 1), 2) + k_grw), mask=k_ok)
            async_copy.async_copy_global_to_shared(
                vw_s, (vw_ptr + row0) + (gl.expand_dims(gl.expand_dims(v_rows * ROW_WORDS, 1), 2) + v_hgw), mask=v_ok)
        else:
            kwp, vwp = _word_ptrs(s0, s_end, stream, kw_ptr, vw_ptr, k_rows, k_grw, v_rows, v_hgw, ROW_WORDS)
            async_copy.async_copy_global_to_shared(kw_s, kwp)
            async_copy.async_copy_global_to_shared(vw_s, vwp)

    @gluon.jit
    def _copy_scales(s0, s_end, stream, ks16, vs16, kr_ptr, vr_ptr, ks_s, vs_s, kr_s, vr_s, TILE: gl.constexpr,
                     PAIRS: gl.constexpr, MASKED: gl.constexpr):
        """PREFETCH 3: one trip's scale pairs (NVFP4: PAIRS) and row scales into ring slots by cp.async, a row per
        lane (8 bytes of K pairs, 8 of V pairs, 4 + 4 of row scales; rows past the split clamped like _word_ptrs,
        or MASKED as in _copy_words: zero-filled, and a zero row scale zeroes the row's probability). Other lanes
        read them back: the ring's wait is followed by a barrier (one warp: cheap)."""
        pair_cp: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [1, 1], [1, 0])
        row_cp: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        if MASKED:
            lim = s_end - s0
            if PAIRS:
                rows = gl.arange(0, TILE, gl.SliceLayout(1, pair_cp))
                off = gl.expand_dims(rows * 4, 1) + gl.expand_dims(gl.arange(0, 4, gl.SliceLayout(0, pair_cp)), 0)
                ok = gl.expand_dims(rows < lim, 1)
                async_copy.async_copy_global_to_shared(ks_s, (ks16 + (stream + s0) * 4) + off, mask=ok)
                async_copy.async_copy_global_to_shared(vs_s, (vs16 + (stream + s0) * 4) + off, mask=ok)
            rr = gl.arange(0, TILE, row_cp)
            async_copy.async_copy_global_to_shared(kr_s, (kr_ptr + (stream + s0)) + rr, mask=rr < lim)
            async_copy.async_copy_global_to_shared(vr_s, (vr_ptr + (stream + s0)) + rr, mask=rr < lim)
        else:
            if PAIRS:
                rows = gl.arange(0, TILE, gl.SliceLayout(1, pair_cp))
                r = stream + gl.minimum(s0 + rows, s_end - 1)
                off = gl.expand_dims(r * 4, 1) + gl.expand_dims(gl.arange(0, 4, gl.SliceLayout(0, pair_cp)), 0)
                async_copy.async_copy_global_to_shared(ks_s, ks16 + off)
                async_copy.async_copy_global_to_shared(vs_s, vs16 + off)
            rr = stream + gl.minimum(s0 + gl.arange(0, TILE, row_cp), s_end - 1)
            async_copy.async_copy_global_to_shared(kr_s, kr_ptr + rr)
            async_copy.async_copy_global_to_shared(vr_s, vr_ptr + rr)

    @gluon.jit
    def _slot_k(kw_s, ks_s, kr_s, j, kl: gl.constexpr, rows_c: gl.constexpr, FP8: gl.constexpr):
        """A trip's K words, scale pairs and row scales from ring slot j (PREFETCH 3; FP8 has no scale pairs: the
        row scales stand in for them)."""
        kw = kw_s.index(j).load(kl)
        kr = kr_s.index(j).load(rows_c)
        if FP8:
            ks = kr
        else:
            ks = ks_s.index(j).load(gl.SliceLayout(2, kl))
        return kw, ks, kr

    @gluon.jit
    def _slot_v(vw_s, vs_s, vr_s, j, vl: gl.constexpr, rows_c: gl.constexpr, TILE: gl.constexpr,
                FP8: gl.constexpr):
        """A trip's V words, scale pairs and row scales from ring slot j (PREFETCH 3). NVFP4's V scale pair of half
        group hg is pair hg // 2: the words come back as [TILE, pair, 4], whose slice drops the lane bit of
        hg % 2 (lanes that share a pair read the same bytes)."""
        vw = vw_s.index(j).load(vl)
        vr = vr_s.index(j).load(rows_c)
        if FP8:
            vs = vr
        else:
            vw = gl.reshape(vw, [TILE, 4, 4])
            vs = vs_s.index(j).load(gl.SliceLayout(2, vw.type.layout))
        return vw, vs, vr

    @gluon.jit
    def _trip_scores(kw, ks, kr, q_b, row_f, valid, mma: gl.constexpr, a_op: gl.constexpr, TILE: gl.constexpr,
                     FP8: gl.constexpr):
        """One trip's S^T [TILE, 8 heads] in log2 units (the exp2 softmax's), rows at or past the split's end at
        -inf: the K words (and NVFP4 scale pairs ks) decoded straight into the score MMA's A fragment, times the
        row scales kr and the per-head factor row_f."""
        if FP8:
            k = _decode_k_fp8(kw, TILE)
        else:
            k = gl.permute(gl.reshape(_decode(kw, ks), [TILE, 4, 2, 2, 2, 2, 2]), [0, 6, 2, 3, 5, 1, 4])
            k = gl.reshape(k, [TILE, 128])
        k = gl.convert_layout(k, a_op, assert_trivial=True)
        s_t = mma_v2(k, q_b, gl.zeros([TILE, 8], gl.float32, mma))
        s_t = s_t * gl.expand_dims(kr, 1) * gl.expand_dims(row_f, 0)
        return gl.where(gl.expand_dims(valid, 1), s_t, -float("inf"))

    @gluon.jit
    def _trip_softmax_pv(s_t, valid, vw, vs, vr, m_i, l_i, acc, mma: gl.constexpr, a_op: gl.constexpr,
                         b_op: gl.constexpr, TILE: gl.constexpr, FP8: gl.constexpr, SCALES_RING: gl.constexpr,
                         CODE_F: gl.constexpr):
        """The online softmax of one trip's scores and its P.V into acc: P scaled by the V row scales over their
        trip maximum (fp16 range), the V words (and NVFP4 scale pairs vs, as [TILE, pair, 4] words when they came
        through the ring) decoded into the output MMA's A fragment. Returns the new (m, l, acc)."""
        vr = gl.where(valid, vr, 0.0)
        m_new = gl.maximum(m_i, gl.max(s_t, 0))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s_t - gl.expand_dims(m_new, 0))
        l_i = l_i * alpha + gl.sum(p, 0)
        v_top = gl.max(vr, 0)
        v_top = gl.where(v_top > 0.0, v_top, 1.0)        # an unwritten tile (zeros) must not divide by 0
        p = p * gl.expand_dims(vr * (1.0 / v_top), 1)
        p_b = gl.convert_layout(p.to(gl.float16), b_op)
        if FP8:
            v = _decode_v_fp8(vw, TILE)
        else:
            v = _decode(vw, vs)
            if SCALES_RING:
                v = gl.reshape(v, [TILE, 8, 2, 2, 2, 2])
            v = gl.reshape(gl.permute(v, [5, 2, 4, 3, 1, 0]), [128, TILE])    # [h, w, j1, j0, hg, T]
        v = gl.convert_layout(v, a_op)
        o = mma_v2(v, p_b, gl.zeros([128, 8], gl.float32, mma))
        acc = acc * gl.expand_dims(alpha, 0) + o * (v_top * CODE_F)
        return m_new, l_i, acc

    @gluon.jit
    def _physical_rows(acc, FP8: gl.constexpr):
        """O^T [128 logical rows, 8] -> [128 physical head_dim, 8]: o_order as a permutation of the row index's bits
        (NVFP4: r = hg + 8 j0 + 16 j1 + 32 w + 64 h, d = 32 (hg >> 1) + 16 h + 8 (hg & 1) + 4 w + 2 j1 + j0; FP8:
        r = g + 8 b + 32 j, d = 16 g + 4 j + b), a relabelling of registers and lanes, no data movement."""
        a = gl.reshape(acc, [2, 2, 2, 2, 2, 2, 2, 8])       # row bits, most significant first
        if FP8:
            a = gl.permute(a, [4, 5, 6, 0, 1, 2, 3, 7])     # j1 j0 b1 b0 g2 g1 g0 -> g2 g1 g0 j1 j0 b1 b0
        else:
            a = gl.permute(a, [4, 5, 0, 6, 1, 2, 3, 7])     # h w j1 j0 hg2 hg1 hg0 -> hg2 hg1 h hg0 w j1 j0
        return gl.reshape(a, [128, 8])

    @gluon.jit
    def _count_finished(cnt_ptr):
        """How many programs of this (row, KV head) had counted before this one. Each lane fences its own partial
        stores, the warp joins, then one acq_rel atomic counts the program: the program that counts last sees
        every earlier program's partials."""
        lanes = gl.arange(0, 32, gl.BlockedLayout([1], [32], [1], [0]))
        gl.inline_asm_elementwise("fence.acq_rel.gpu;\nmov.b32 $0, $1;", "=r,r", [lanes], dtype=gl.int32,
                                  is_pure=False, pack=1)
        gl.thread_barrier()
        return gl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")

    @gluon.jit
    def _merge_splits(acc_ptr, ml_ptr, o_ptr, q_row0, GROUP, SPLITS: gl.constexpr, ROUND: gl.constexpr):
        """attention_combine._combine_kernel's merge for the GROUP query heads from q_row0, online over rounds of
        ROUND splits: a round's partials load in one go (4 KB a split, ROUND x 32 floats a lane in flight; one
        load per split kept the warp waiting for L2 once per split: 8 splits merged cost more than
        the combine launch), then weights exp(m - running max) rescale what came before. Partials read through
        L2 (.cg: other SMs wrote them)."""
        D: gl.constexpr = 128
        N: gl.constexpr = 8
        R: gl.constexpr = SPLITS if SPLITS < ROUND else ROUND
        lay: gl.constexpr = gl.BlockedLayout([R, 1, 4], [1, 1, 32], [1, 1, 1], [2, 1, 0])   # [split, head, d]
        sh: gl.constexpr = gl.SliceLayout(2, lay)                                        # [split, head]
        hl: gl.constexpr = gl.SliceLayout(0, sh)                                         # [head]
        out_l: gl.constexpr = gl.SliceLayout(0, lay)                                     # [head, d]
        heads = gl.arange(0, N, gl.SliceLayout(0, sh))
        splits = gl.arange(0, R, gl.SliceLayout(1, sh))
        d = gl.arange(0, D, gl.SliceLayout(0, out_l))
        h_ok = gl.expand_dims(heads < GROUP, 0) & gl.expand_dims(splits >= 0, 1)          # [R, N]
        base = gl.expand_dims((q_row0 + heads).to(gl.int64) * SPLITS, 0) + gl.expand_dims(splits, 1)   # [R, N] rows
        m_run = gl.full([N], -float("inf"), gl.float32, hl)
        denom = gl.zeros([N], gl.float32, hl)
        out = gl.zeros([N, D], gl.float32, out_l)
        for r0 in range(0, SPLITS, R):        # not unrolled: ptxas would hoist every round's loads (spills)
            rows = base + r0
            m = gl.load(ml_ptr + rows * 2, mask=h_ok, other=-float("inf"), cache_modifier=".cg")
            l = gl.load(ml_ptr + rows * 2 + 1, mask=h_ok, other=0.0, cache_modifier=".cg")
            a = gl.load(acc_ptr + gl.expand_dims(rows * D, 2) + gl.expand_dims(gl.expand_dims(d, 0), 0),
                        mask=gl.expand_dims(h_ok, 2), other=0.0, cache_modifier=".cg")
            m_new = gl.maximum(m_run, gl.max(m, 0))
            m_ref = gl.where(m_new > -float("inf"), m_new, 0.0)       # no split with positions yet: weights 0
            scale = gl.exp(m_run - m_ref)
            w = gl.exp(m - gl.expand_dims(m_ref, 0))                  # [R, N]; splits without positions: 0
            denom = denom * scale + gl.sum(w * l, 0)
            out = (out * gl.expand_dims(gl.convert_layout(scale, gl.SliceLayout(1, out_l)), 1)
                   + gl.sum(a * gl.expand_dims(w, 2), 0))
            m_run = m_new
        out = out / gl.expand_dims(gl.convert_layout(denom, gl.SliceLayout(1, out_l)), 1)
        hh = gl.arange(0, N, gl.SliceLayout(1, out_l))
        gl.store(o_ptr + gl.expand_dims((q_row0 + hh).to(gl.int64) * D, 1) + gl.expand_dims(d, 0),
                 out.to(o_ptr.dtype.element_ty), mask=gl.expand_dims(hh < GROUP, 1))

    @gluon.jit(do_not_specialize=["HQ", "HKV", "L", "GROUP", "NUM_SPLITS"])
    def _gluon_decode_kernel(q_ptr, kc_ptr, ks_ptr, kr_ptr, vc_ptr, vs_ptr, vr_ptr, slots_ptr, lens_ptr, acc_ptr,
                             ml_ptr, o_ptr, cnt_ptr, HQ, HKV, L, GROUP, NUM_SPLITS, qk_scale, TILE: gl.constexpr,
                             PREFETCH: gl.constexpr, STAGES: gl.constexpr, MERGE_SPLITS: gl.constexpr,
                             MERGE_ROUND: gl.constexpr, FP8: gl.constexpr, RING_MASKS: gl.constexpr,
                             VECTOR_STORES: gl.constexpr, Q_VECTOR_LOADS: gl.constexpr):
        """Grid (row, KV head, split), one warp. Writes the split's partial (acc, m, l) like
        kv_decode_attention._packed_decode_kernel; attention_combine merges the splits, or (MERGE_SPLITS =
        NUM_SPLITS > 0) the split that finishes last merges them into o_ptr (_merge_splits). FP8: E4M3 codes
        and row scales (no block scales; prefetch 3 only), else NVFP4."""
        D: gl.constexpr = 128
        N: gl.constexpr = 8
        ROW_WORDS: gl.constexpr = 32 if FP8 else 16       # 32-bit code words per cached row
        KW: gl.constexpr = 8 if FP8 else 4                 # K words a lane takes per row (its 32-element group)
        VW: gl.constexpr = 4 if FP8 else 2                 # V words a lane takes per position
        CODE_F: gl.constexpr = 1.0 if FP8 else 512.0       # FP8 decodes to the value, NVFP4 to value * 2^-9
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
        a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        kl: gl.constexpr = _k_layout(TILE, KW)
        vl: gl.constexpr = _v_layout(TILE, VW)
        rows_c: gl.constexpr = gl.SliceLayout(1, mma)       # positions of S^T, head_dim rows of O^T
        cols_c: gl.constexpr = gl.SliceLayout(0, mma)       # heads

        b = gl.program_id(0)
        hk = gl.program_id(1)
        sp = gl.program_id(2)
        slot = gl.load(slots_ptr + b).to(gl.int64)
        seq_len = gl.load(lens_ptr + b).to(gl.int32)
        per = gl.cdiv(gl.cdiv(seq_len, NUM_SPLITS), TILE) * TILE
        s_begin = sp * per
        s_end = gl.minimum(s_begin + per, seq_len)
        q_row0 = b * HQ + hk * GROUP

        stream = (slot * HKV + hk) * L                       # first row of this (slot, KV head) stream
        kw_ptr = kc_ptr.to(gl.pointer_type(gl.int32))       # ROW_WORDS words per row
        vw_ptr = vc_ptr.to(gl.pointer_type(gl.int32))
        ks16 = ks_ptr.to(gl.pointer_type(gl.int16))         # 4 scale pairs per row
        vs16 = vs_ptr.to(gl.pointer_type(gl.int16))
        k_rows = gl.arange(0, TILE, gl.SliceLayout(1, gl.SliceLayout(2, kl)))
        k_gr = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(2, kl)))
        k_w = gl.arange(0, KW, gl.SliceLayout(0, gl.SliceLayout(1, kl)))
        k_grw = gl.expand_dims(gl.expand_dims(k_gr * KW, 0), 2) + gl.expand_dims(gl.expand_dims(k_w, 0), 1)
        v_rows = gl.arange(0, TILE, gl.SliceLayout(1, gl.SliceLayout(2, vl)))
        v_hg = gl.arange(0, 8, gl.SliceLayout(0, gl.SliceLayout(2, vl)))
        v_w = gl.arange(0, VW, gl.SliceLayout(0, gl.SliceLayout(1, vl)))
        v_hgw = gl.expand_dims(gl.expand_dims(v_hg * VW, 0), 2) + gl.expand_dims(gl.expand_dims(v_w, 0), 1)
        c_rows = gl.arange(0, TILE, rows_c)

        m_i = gl.full([N], -float("inf"), gl.float32, cols_c)
        l_i = gl.zeros([N], gl.float32, cols_c)
        acc = gl.zeros([D, N], gl.float32, mma)
        # PREFETCH 1: the next trip's bytes load into registers at the end of this one (ptxas keeps them late).
        # PREFETCH 2: the code words go through a ring of STAGES shared-memory slots by cp.async, issued
        # STAGES - 1 trips ahead (each lane reads back the bytes it copied: no barrier); scales as in 1.
        # PREFETCH 3: as 2, and the scales through the ring too (ptxas sinks 1's scale loads to the end of the
        # trip, so the next trip's first decode waits for DRAM: tools/inspect_attention_sm90.py shows where).
        RING_SCALES: gl.constexpr = PREFETCH == 3
        REG_SCALES: gl.constexpr = PREFETCH == 1 or PREFETCH == 2
        if PREFETCH >= 2:
            ring: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
            kw_s = gl.allocate_shared_memory(gl.int32, [STAGES, TILE, 4, KW], ring)
            vw_s = gl.allocate_shared_memory(gl.int32, [STAGES, TILE, 8, VW], ring)
            if RING_SCALES:
                pairs_ring: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])   # (a slot's rank)
                rows_ring: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
                ks_s = gl.allocate_shared_memory(gl.int16, [STAGES, 1 if FP8 else TILE, 4], pairs_ring)
                vs_s = gl.allocate_shared_memory(gl.int16, [STAGES, 1 if FP8 else TILE, 4], pairs_ring)
                kr_s = gl.allocate_shared_memory(gl.float32, [STAGES, TILE], rows_ring)
                vr_s = gl.allocate_shared_memory(gl.float32, [STAGES, TILE], rows_ring)
            for st in gl.static_range(STAGES - 1):
                _copy_words(s_begin + st * TILE, s_end, stream, kw_ptr, vw_ptr, k_rows, k_grw, v_rows, v_hgw,
                            kw_s.index(st), vw_s.index(st), ROW_WORDS, RING_MASKS)
                if RING_SCALES:
                    _copy_scales(s_begin + st * TILE, s_end, stream, ks16, vs16, kr_ptr, vr_ptr, ks_s.index(st),
                                 vs_s.index(st), kr_s.index(st), vr_s.index(st), TILE, not FP8,
                                 RING_MASKS)
                async_copy.commit_group()
        # Q^T [128 (logical k), 8 heads] in the B fragment layout, gathered in q_order, scaled per head (after the
        # ring's first copies are issued: its latency overlaps theirs)
        if Q_VECTOR_LOADS:
            q = _q_operand(q_ptr, q_row0, GROUP, N, b_op).to(gl.float32)
        else:
            kk = gl.arange(0, D, gl.SliceLayout(1, b_op))
            if FP8:
                d_q = 32 * ((kk >> 1) & 3) + 4 * (kk >> 4) + 2 * ((kk >> 3) & 1) + (kk & 1)
            else:
                d_q = (32 * ((kk >> 1) & 3) + 16 * (kk >> 6) + 8 * ((kk >> 5) & 1) + 4 * ((kk >> 4) & 1)
                       + 2 * ((kk >> 3) & 1) + (kk & 1))
            nn = gl.arange(0, N, gl.SliceLayout(0, b_op))
            q = gl.load(q_ptr + gl.expand_dims((q_row0 + nn).to(gl.int64) * D, 0) + gl.expand_dims(d_q, 1),
                        mask=gl.expand_dims(nn < GROUP, 0), other=0.0).to(gl.float32)
        f, inv_f = _q_pow2(gl.max(gl.abs(q), 0))
        q_b = (q * gl.expand_dims(f, 0)).to(gl.float16)
        # per head: sm_scale * log2(e) (exp2 softmax) * 2^9 (NVFP4's code offset) / f
        row_f = gl.convert_layout(inv_f, cols_c) * (qk_scale * CODE_F)

        if REG_SCALES:     # this trip's bytes were loaded during the previous one
            ks, vs, kr, vr = _load_scales(s_begin, s_end, stream, ks16, vs16, kr_ptr, vr_ptr, k_rows, k_gr, v_rows,
                                          v_hg, c_rows)
        if PREFETCH == 1:
            kwp, vwp = _word_ptrs(s_begin, s_end, stream, kw_ptr, vw_ptr, k_rows, k_grw, v_rows, v_hgw, ROW_WORDS)
            kw = gl.load(kwp)
            vw = gl.load(vwp)
        for s0 in range(s_begin, s_end, TILE):
            if PREFETCH == 0:
                kwp, vwp = _word_ptrs(s0, s_end, stream, kw_ptr, vw_ptr, k_rows, k_grw, v_rows, v_hgw,
                                      ROW_WORDS)
                kw = gl.load(kwp)
                vw = gl.load(vwp)
                ks, vs, kr, vr = _load_scales(s0, s_end, stream, ks16, vs16, kr_ptr, vr_ptr, k_rows, k_gr,
                                              v_rows, v_hg, c_rows)
            if PREFETCH >= 2:
                i = (s0 - s_begin) // TILE
                ahead = (i + STAGES - 1) % STAGES
                _copy_words(s0 + (STAGES - 1) * TILE, s_end, stream, kw_ptr, vw_ptr, k_rows, k_grw, v_rows, v_hgw,
                            kw_s.index(ahead), vw_s.index(ahead), ROW_WORDS, RING_MASKS)
                if RING_SCALES:
                    _copy_scales(s0 + (STAGES - 1) * TILE, s_end, stream, ks16, vs16, kr_ptr, vr_ptr,
                                 ks_s.index(ahead), vs_s.index(ahead), kr_s.index(ahead), vr_s.index(ahead), TILE,
                                 not FP8, RING_MASKS)
                async_copy.commit_group()
                async_copy.wait_group(STAGES - 1)
                if RING_SCALES:
                    gl.thread_barrier()     # the scale rows of this slot were copied by other lanes
                    kw, ks, kr = _slot_k(kw_s, ks_s, kr_s, i % STAGES, kl, rows_c, FP8)
                    vw, vs, vr = _slot_v(vw_s, vs_s, vr_s, i % STAGES, vl, rows_c, TILE, FP8)
                else:
                    kw = kw_s.index(i % STAGES).load(kl)
                    vw = vw_s.index(i % STAGES).load(vl)
            valid = s0 + c_rows < s_end
            s_t = _trip_scores(kw, ks, kr, q_b, row_f, valid, mma, a_op, TILE, FP8)
            m_i, l_i, acc = _trip_softmax_pv(s_t, valid, vw, vs, vr, m_i, l_i, acc, mma, a_op, b_op, TILE, FP8,
                                             RING_SCALES, CODE_F)
            if REG_SCALES:
                ks, vs, kr, vr = _load_scales(s0 + TILE, s_end, stream, ks16, vs16, kr_ptr, vr_ptr, k_rows, k_gr,
                                              v_rows, v_hg, c_rows)
            if PREFETCH == 1:
                kwp, vwp = _word_ptrs(s0 + TILE, s_end, stream, kw_ptr, vw_ptr, k_rows, k_grw, v_rows, v_hgw,
                                      ROW_WORDS)
                kw = gl.load(kwp)
                vw = gl.load(vwp)

        if PREFETCH >= 2:
            # the look-ahead copies past the last trip must land before anything reuses shared memory: the
            # epilogue's layout changes may get scratch that aliases the ring (an H100 run caught VECTOR_STORES
            # with RING_MASKS off, whose late copies read DRAM, writing into the partials' staging)
            async_copy.wait_group(0)
            gl.thread_barrier()
        heads = gl.arange(0, N, cols_c)
        out_row = (q_row0 + heads) * NUM_SPLITS + sp
        r = gl.arange(0, D, rows_c)
        if FP8:
            d_o = 16 * (r & 7) + 4 * (r >> 5) + ((r >> 3) & 3)
        else:
            d_o = (32 * ((r & 7) >> 1) + 16 * (r >> 6) + 8 * (r & 1) + 4 * ((r >> 5) & 1) + 2 * ((r >> 4) & 1)
                   + ((r >> 3) & 1))
        h_mask = heads < GROUP
        if VECTOR_STORES:
            st_l: gl.constexpr = gl.BlockedLayout([4, N], [32, 1], [1, 1], [0, 1])   # 4 contiguous d x 8 heads a lane
            acc_d = gl.convert_layout(_physical_rows(acc, FP8), st_l)
            d_st = gl.arange(0, D, gl.SliceLayout(1, st_l))
            h_st = gl.arange(0, N, gl.SliceLayout(0, st_l))
            gl.store(acc_ptr + gl.expand_dims(((q_row0 + h_st) * NUM_SPLITS + sp).to(gl.int64) * D, 0)
                     + gl.expand_dims(d_st, 1), acc_d, mask=gl.expand_dims(h_st < GROUP, 0))
        else:
            gl.store(acc_ptr + gl.expand_dims(out_row.to(gl.int64) * D, 0) + gl.expand_dims(d_o, 1), acc,
                     mask=gl.expand_dims(h_mask, 0))
        gl.store(ml_ptr + out_row * 2, m_i * 0.6931471805599453, mask=h_mask)   # natural-log units
        gl.store(ml_ptr + out_row * 2 + 1, l_i, mask=h_mask)
        if MERGE_SPLITS == 1:
            _merge_splits(acc_ptr, ml_ptr, o_ptr, q_row0, GROUP, MERGE_SPLITS, MERGE_ROUND)
        elif MERGE_SPLITS > 1:
            if _count_finished(cnt_ptr + b * HKV + hk) == MERGE_SPLITS - 1:     # the last split of this row
                gl.store(cnt_ptr + b * HKV + hk, 0)                               # ready for the next call
                _merge_splits(acc_ptr, ml_ptr, o_ptr, q_row0, GROUP, MERGE_SPLITS, MERGE_ROUND)


# Fused merge (the last split's program merges, no combine launch) up to this many splits: one warp reads them,
# 4 KB each, ~1,000 instructions a round; from 8 splits the combine launch is faster (H200, 32/4 heads, batch 16,
# 8 splits: 35.2 us merged against 30.0; batch 1, 64 splits: 55.8 against 13.3), so batch 1 at long context
# keeps attention_combine's parallel merge.
MERGE_MAX_SPLITS = 4
_COUNTERS: dict = {}          # device -> int32 split counters, zero between calls (the merging program resets)
_OLD_COUNTERS: list = []      # outgrown buffers stay alive: a captured graph may still point at one


def split_counters(device: torch.device, n: int) -> torch.Tensor | None:
    """The fused merge's counters for n (row, KV head) pairs; None inside a graph capture that would have to
    allocate them (the caller then merges unfused; the engine's warm-up runs before capture). One decode stream
    at a time uses them: two concurrent launches would count into the same slots."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if buf is not None:
            _OLD_COUNTERS.append(buf)
        buf = _COUNTERS[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return buf


def kernel_args(q: torch.Tensor, keys: PackedKV, values: PackedKV, slots: torch.Tensor, lens: torch.Tensor,
                acc: torch.Tensor, ml: torch.Tensor, sm_scale: float, tile: int = TILE, prefetch: int = 1,
                out: torch.Tensor | None = None, counters: torch.Tensor | None = None) -> dict:
    """The kernel's arguments by name (the launch and tools/inspect_attention_sm90.py). With out (and counters
    for more than one split) the kernel merges the splits itself."""
    bsz, hq, d = q.shape
    _, hkv, max_len, _ = keys.codes.shape
    splits = acc.shape[2]
    merge = out is not None and (splits == 1 or counters is not None)
    fp8 = keys.fmt == "fp8"
    return dict(q_ptr=q, kc_ptr=keys.codes, ks_ptr=keys.codes if fp8 else keys.scales, kr_ptr=keys.row_scale,
                vc_ptr=values.codes, vs_ptr=values.codes if fp8 else values.scales, vr_ptr=values.row_scale,
                slots_ptr=slots, lens_ptr=lens, acc_ptr=acc,
                ml_ptr=ml, o_ptr=out if merge else q, cnt_ptr=counters if merge and splits > 1 else lens,
                HQ=hq, HKV=hkv, L=max_len, GROUP=hq // hkv, NUM_SPLITS=splits, qk_scale=sm_scale * LOG2E,
                TILE=tile, PREFETCH=int(prefetch), STAGES=RING_STAGES, MERGE_SPLITS=splits if merge else 0,
                MERGE_ROUND=MERGE_ROUND, FP8=fp8, RING_MASKS=RING_MASKS,
                VECTOR_STORES=VECTOR_STORES, Q_VECTOR_LOADS=Q_VECTOR_LOADS)


def gluon_decode_attention(q: torch.Tensor, keys: PackedKV, values: PackedKV, slots: torch.Tensor,
                           lens: torch.Tensor, sm_scale: float, out: torch.Tensor, num_splits: int,
                           tile: int = TILE, prefetch: int = 1, fused_merge: bool | None = None) -> torch.Tensor:
    """packed_decode_attention's contract (it validates and picks the split count) on this kernel. fused_merge
    (default: up to MERGE_MAX_SPLITS splits) merges in the kernel instead of a combine launch."""
    if prefetch not in (0, 1, 2, 3) or (prefetch == 3 and tile < 32):
        raise ValueError(f"prefetch must be 0, 1, 2 or 3 (3 needs trips of >= 32 positions: a scale row per lane), "
                         f"got prefetch={prefetch} with {tile}-position trips")
    if keys.fmt == "fp8" and prefetch != 3:
        raise ValueError(f"the FP8 path runs with prefetch 3 (codes and row scales through the ring), got "
                         f"prefetch={prefetch}: leave prefetch unset, or pass kernel='triton'")
    bsz, hq, d = q.shape
    hkv = keys.codes.shape[1]
    qc = q.contiguous()
    acc = torch.empty((bsz, hq, num_splits, d), device=q.device, dtype=torch.float32)
    ml = torch.empty((bsz, hq, num_splits, 2), device=q.device, dtype=torch.float32)
    fused = num_splits <= MERGE_MAX_SPLITS if fused_merge is None else fused_merge
    counters = split_counters(q.device, bsz * hkv) if fused and num_splits > 1 else None
    fused = fused and (num_splits == 1 or counters is not None)
    _gluon_decode_kernel[(bsz, hkv, num_splits)](
        **kernel_args(qc, keys, values, slots, lens, acc, ml, sm_scale, tile, prefetch, out if fused else None,
                      counters), num_warps=1)
    if not fused:
        _combine_kernel[(bsz * hq,)](acc, ml, out, D=d, NUM_SPLITS=num_splits, RNE=False, num_warps=4)
    return out
