"""The last step of split-K (flash-decoding) decode attention: merge each query head's per-split partials.

A decode-attention kernel that splits a row's cached positions over programs writes, per (row, query head,
split), the unnormalised output acc [D], the running max m and the softmax mass l of its split. The merge
weights each split by exp(m - max over splits) and divides by the weighted mass, in a fixed split order
(deterministic). Shared by the bf16-cache kernel (cache_attention.py) and the packed-cache one
(kv_decode_attention.py).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .rounding import _cast_out


@triton.jit
def _combine_kernel(acc_ptr, ml_ptr, o_ptr, D: tl.constexpr, NUM_SPLITS: tl.constexpr, RNE: tl.constexpr):
    """Merge the splits' (acc, max, sum) partials of one (row, query head) program in a fixed order; the
    output in o_ptr's dtype."""
    r = tl.program_id(0).to(tl.int64)                  # (batch, q head)
    sp = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, D)
    # the partials load first and all at once: one memory round trip per program, not two (the weights need m)
    acc = tl.load(acc_ptr + (r * NUM_SPLITS + sp)[:, None] * D + d[None, :])
    m = tl.load(ml_ptr + (r * NUM_SPLITS + sp) * 2)
    l = tl.load(ml_ptr + (r * NUM_SPLITS + sp) * 2 + 1)
    m_all = tl.max(m, 0)
    w = tl.where(m > -float("inf"), tl.exp(m - m_all), 0.0)
    denom = tl.sum(w * l, 0)
    out = tl.sum(acc * w[:, None], 0) / denom
    tl.store(o_ptr + r * D + d, _cast_out(out, o_ptr, RNE))
