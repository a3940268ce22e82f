"""qh128 lane sums in one Triton launch per batch of tensors (quant/digest.py defines the hash).

The torch formulation in quant/digest.py runs ~30 elementwise int64 ops per lane over the whole payload,
each a full-size temporary, then an index_add_ whose atomics all land on a few addresses: on an H200 that
is ~0.16 s for a 463 MB weight-sync payload, most of the sync. Here each program hashes BLOCK words of one
tensor in registers (uint64 wrapping arithmetic, the same as the torch int64 ops bit for bit) and writes
the two lane sums of its block; blocks never straddle tensors, so the per-tensor sums are a small
index_add_ over blocks. The sum is order-free (mod 2^64), so the digests equal the torch path's exactly.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _fmix64(k):
    k = k ^ (k >> 33)
    k = k * 0xFF51AFD7ED558CCD
    k = k ^ (k >> 33)
    k = k * 0xC4CEB9FE1A85EC53
    return k ^ (k >> 33)


@triton.jit
def _qh128_blocks_kernel(words_ptr, block_start_ptr, block_end_ptr, seg_start_ptr, out_ptr,
                         C0, S0, C1, S1, BLOCK: tl.constexpr):
    """Program b: the lane sums over words [block_start[b], block_end[b]) of the flat buffer, each word's
    index taken relative to its tensor's first word seg_start[b]."""
    b = tl.program_id(0)
    start = tl.load(block_start_ptr + b)
    end = tl.load(block_end_ptr + b)
    seg0 = tl.load(seg_start_ptr + b)
    offs = start + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < end
    w = tl.load(words_ptr + offs, mask=mask, other=0).to(tl.uint32, bitcast=True).to(tl.uint64)
    local = (offs - seg0).to(tl.uint64)
    c0, s0 = C0.to(tl.uint64, bitcast=True), S0.to(tl.uint64, bitcast=True)
    c1, s1 = C1.to(tl.uint64, bitcast=True), S1.to(tl.uint64, bitcast=True)
    zero = tl.zeros([BLOCK], dtype=tl.uint64)
    t0 = tl.where(mask, _fmix64((local * c0) ^ w ^ s0), zero)
    t1 = tl.where(mask, _fmix64((local * c1) ^ w ^ s1), zero)
    tl.store(out_ptr + 2 * b, tl.sum(t0, axis=0).to(tl.int64, bitcast=True))
    tl.store(out_ptr + 2 * b + 1, tl.sum(t1, axis=0).to(tl.int64, bitcast=True))


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


def qh128_lane_sums(words: torch.Tensor, words_per: list[int], lanes) -> torch.Tensor:
    """int64 [len(words_per), 2]: qh128's two lane sums (mod 2^64, as int64 bits) of each of the tensors laid
    end to end in `words` (int32, on a CUDA device or under the Triton interpreter); lanes = ((C, S), (C, S))."""
    starts, blocks_start, blocks_end, blocks_seg, seg_ids = 0, [], [], [], []
    for i, n in enumerate(words_per):
        for b0 in range(starts, starts + n, BLOCK):
            blocks_start.append(b0)
            blocks_end.append(min(b0 + BLOCK, starts + n))
            blocks_seg.append(starts)
            seg_ids.append(i)
        starts += n
    dev = words.device
    sums = torch.zeros(len(words_per), 2, dtype=torch.int64, device=dev)
    if not blocks_start:
        return sums
    table = torch.tensor([blocks_start, blocks_end, blocks_seg, seg_ids], dtype=torch.int64).to(dev, non_blocking=True)
    partial = torch.empty(len(blocks_start), 2, dtype=torch.int64, device=dev)
    (c0, s0), (c1, s1) = (tuple(_signed(v) for v in lane) for lane in lanes)   # int64 args, bitcast inside
    _qh128_blocks_kernel[(len(blocks_start),)](words, table[0], table[1], table[2], partial, c0, s0, c1, s1,
                                               BLOCK=BLOCK, num_warps=8)
    return sums.index_add_(0, table[3], partial)
