"""MoE routing of a decode step in one or two launches: router top-k + probabilities + expert alignment.

Why: the torch routing of one MoE layer (topk, softmax, casts) plus `moe_align` (~15 small ops) is ~20
launches of tiny kernels, and at decode batch sizes a CUDA-graph step is bound by those launch gaps.

`route_and_align(logits [T, E], top_k, block_m)` returns what Megatron's `topk_routing_with_score_function`
(softmax score, dense output) and `moe_align(ids, E, block_m)` return together:
- top-k per row by iterative argmax (ties -> lower expert index), slots in descending score order;
- probabilities: softmax over the k selected logits in float32 (or, pre-softmax, the selected entries of
  the float32 softmax over all experts), times the optional scaling factor, cast to the logits' dtype;
- the alignment: a counting sort of the T*k assignments t*k + j by expert in one program (histogram,
  prefix sum of the block_m-padded counts, per-chunk one-hot cumsum for the stable rank), identical to
  moe_align's sorted_ids / block_expert with the same static `max_blocks` bound.
Up to FUSED_MAX_TOKENS rows everything runs in one program (top-k rows, a CTA barrier, the sort); above it
the top-k runs over a grid of row blocks and the sort in a second launch. No host synchronisation, output
shapes from input shapes only (CUDA-graph capturable). `align_only(ids, E, block_m)` is the sort alone.
Reference: torch.topk + Megatron's function + moe_align (tests/test_kernels_decode_routing.py).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .moe_grouped_gemm import MoERouting, max_blocks
from .rounding import _cast_out
from .w4a16_gemm import INTERPRET

# rows routed by the single fused program; larger batches (prefill-sized) spread the top-k over a grid
FUSED_MAX_TOKENS = 256
# elements of the [rows, experts] register tiles (one-hot and logits tiles of one loop iteration); the CPU
# interpreter pays per operation, not per element, so it takes larger tiles (same code, fewer iterations)
_TILE = 32768 if INTERPRET else 4096


@triton.jit
def _topk_rows(logits_ptr, stride_l, probs_ptr, ids_ptr, row0, T, E, scaling,
               TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr, E_PAD: tl.constexpr,
               PRE_SOFTMAX: tl.constexpr, HAS_SCALE: tl.constexpr, RNE: tl.constexpr):
    """Top-k and probabilities of rows row0 .. row0 + BLOCK_T - 1 (rows >= T are skipped)."""
    rows = row0 + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_PAD)
    row_ok = rows < T
    col_ok = cols < E
    x = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_l + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :], other=float("-inf")).to(tl.float32)
    x = tl.where(row_ok[:, None], x, 0.0)          # padding rows: finite values, never stored
    if PRE_SOFTMAX:
        e = tl.exp(x - tl.max(x, 1)[:, None])
        e = tl.where(col_ok[None, :], e, 0.0)
        x = tl.where(col_ok[None, :], e / tl.sum(e, 1)[:, None], float("-inf"))
    slots = tl.arange(0, K_PAD)
    vals = tl.zeros((BLOCK_T, K_PAD), dtype=tl.float32)
    ids = tl.zeros((BLOCK_T, K_PAD), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        v = tl.max(x, 1)
        i = tl.min(tl.where(x == v[:, None], cols[None, :], E_PAD), 1)      # first index among ties
        x = tl.where(cols[None, :] == i[:, None], float("-inf"), x)
        vals = tl.where(slots[None, :] == j, v[:, None], vals)
        ids = tl.where(slots[None, :] == j, i[:, None], ids)
    slot_ok = slots < TOP_K
    if PRE_SOFTMAX:
        p = vals
    else:
        # vals[:, 0] is the row's largest selected logit: the softmax's max
        e = tl.where(slot_ok[None, :], tl.exp(vals - tl.max(vals, 1)[:, None]), 0.0)
        p = e / tl.sum(e, 1)[:, None]
    if HAS_SCALE:
        p = p * scaling
    out = rows.to(tl.int64)[:, None] * TOP_K + slots[None, :]
    mask = row_ok[:, None] & slot_ok[None, :]
    tl.store(probs_ptr + out, _cast_out(p, probs_ptr, RNE), mask=mask)
    tl.store(ids_ptr + out, ids.to(ids_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _align(ids_ptr, n, E, sorted_ptr, block_expert_ptr, num_blocks,
           BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr, BLOCK_CHUNK: tl.constexpr):
    """Counting sort of n assignments (ids_ptr: their experts) by expert, runs padded to BLOCK_M (pad
    value n), in one program: real entries and pads land on disjoint positions (no ordering needed)."""
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for start in range(0, n, CHUNK):
        a = start + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + a, mask=a < n, other=-1).to(tl.int32)
        counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end_padded = tl.cumsum(padded, 0)
    start_padded = end_padded - padded
    # stable scatter: an assignment's position = its expert's cursor + its rank among the chunk's same-expert
    # assignments (exclusive one-hot cumsum); chunks in ascending assignment order
    cursor = start_padded
    for start in range(0, n, CHUNK):
        a = start + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + a, mask=a < n, other=-1).to(tl.int32)
        onehot = (e[:, None] == experts[None, :]).to(tl.int32)
        rank = tl.cumsum(onehot, 0) - onehot
        dest = tl.sum(onehot * (rank + cursor[None, :]), 1)
        tl.store(sorted_ptr + dest, a, mask=a < n)
        cursor += tl.sum(onehot, 0)
    # blocks: expert = number of experts whose padded run ends at or before the block's start (moe_align's
    # searchsorted, right=True), -1 past the last run; positions past the expert's real rows are pads
    real_end = start_padded + counts
    ends = tl.where(experts < E, end_padded, 2147483647)
    rows = tl.arange(0, BLOCK_M)
    for b0 in range(0, num_blocks, BLOCK_CHUNK):
        b = b0 + tl.arange(0, BLOCK_CHUNK)
        b_ok = b < num_blocks
        first = b * BLOCK_M
        expert = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), 1)
        tl.store(block_expert_ptr + b, tl.where(expert < E, expert, -1), mask=b_ok)
        first_pad = tl.sum(tl.where(experts[None, :] == expert[:, None], real_end[None, :], 0), 1)
        pos = first[:, None] + rows[None, :]
        pad = tl.full((BLOCK_CHUNK, BLOCK_M), 0, tl.int32) + n
        tl.store(sorted_ptr + pos, pad, mask=b_ok[:, None] & (pos >= first_pad[:, None]))


@triton.jit(do_not_specialize=["T", "num_blocks"])
def _route_kernel(logits_ptr, stride_l, probs_ptr, ids_ptr, sorted_ptr, block_expert_ptr, T, E, num_blocks,
                  scaling,
                  TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr, E_PAD: tl.constexpr,
                  PRE_SOFTMAX: tl.constexpr, HAS_SCALE: tl.constexpr, RNE: tl.constexpr, FUSED: tl.constexpr,
                  BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, BLOCK_CHUNK: tl.constexpr):
    """FUSED: one program routes all T rows, then (after a CTA barrier: the sort reads the ids it wrote)
    aligns them. Otherwise program i routes row block i and the sort is `_align_kernel`."""
    if FUSED:
        for row0 in range(0, T, BLOCK_T):
            _topk_rows(logits_ptr, stride_l, probs_ptr, ids_ptr, row0, T, E, scaling, TOP_K, K_PAD, BLOCK_T,
                       E_PAD, PRE_SOFTMAX, HAS_SCALE, RNE)
        tl.debug_barrier()
        _align(ids_ptr, T * TOP_K, E, sorted_ptr, block_expert_ptr, num_blocks, BLOCK_M, E_PAD, CHUNK,
               BLOCK_CHUNK)
    else:
        _topk_rows(logits_ptr, stride_l, probs_ptr, ids_ptr, tl.program_id(0) * BLOCK_T, T, E, scaling, TOP_K,
                   K_PAD, BLOCK_T, E_PAD, PRE_SOFTMAX, HAS_SCALE, RNE)


@triton.jit(do_not_specialize=["n", "num_blocks"])
def _align_kernel(ids_ptr, n, E, sorted_ptr, block_expert_ptr, num_blocks,
                  BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr, BLOCK_CHUNK: tl.constexpr):
    _align(ids_ptr, n, E, sorted_ptr, block_expert_ptr, num_blocks, BLOCK_M, E_PAD, CHUNK, BLOCK_CHUNK)


def _tile_rows(e_pad: int, wanted: int) -> int:
    """Rows of a [rows, e_pad] tile: as many as `wanted` (a power of two >= 16 at most) within _TILE."""
    return max(1, min(_TILE // e_pad, max(16, triton.next_power_of_2(max(1, wanted)))))


def _align_args(n: int, num_experts: int, block_m: int, device):
    e_pad = triton.next_power_of_2(num_experts)
    nb = max_blocks(n, num_experts, block_m)
    sorted_ids = torch.empty(nb * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(nb, dtype=torch.int32, device=device)
    meta = dict(BLOCK_M=block_m, E_PAD=e_pad, CHUNK=_tile_rows(e_pad, n), BLOCK_CHUNK=_tile_rows(e_pad, nb))
    return sorted_ids, block_expert, nb, meta


def _check(num_experts: int, block_m: int) -> None:
    if num_experts < 1 or num_experts > 1024:
        raise ValueError(f"the routing kernels support 1..1024 experts, got {num_experts}")
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")


def align_only(topk_ids: torch.Tensor, num_experts: int, block_m: int = 16) -> MoERouting:
    """moe_align(topk_ids, num_experts, block_m) in one launch (same sorted_ids, block_expert, num_blocks)."""
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, k], got {tuple(topk_ids.shape)}")
    _check(num_experts, block_m)
    t, k = topk_ids.shape
    ids = topk_ids.contiguous()
    sorted_ids, block_expert, nb, meta = _align_args(t * k, num_experts, block_m, ids.device)
    _align_kernel[(1,)](ids, t * k, num_experts, sorted_ids, block_expert, nb, **meta, num_warps=4)
    return MoERouting(sorted_ids, block_expert, nb, block_m, t, k)


def route_and_align(logits: torch.Tensor, top_k: int, block_m: int, score: str = "softmax",
                    pre_softmax: bool = False, scaling_factor: Optional[float] = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, MoERouting]:
    """Router logits [T, E] -> (probs [T, k] in logits.dtype, ids [T, k] int64, the MoERouting of the ids
    for block_m), as Megatron's softmax top-k routing + moe_align compute them; 1 launch up to
    FUSED_MAX_TOKENS rows, else 2."""
    if score != "softmax":
        raise ValueError(f"route_and_align implements the softmax score function, got {score!r}")
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, E], got {tuple(logits.shape)}")
    t, e = logits.shape
    if not 1 <= top_k <= min(e, 64):
        raise ValueError(f"top_k must be in 1..min(E, 64), got {top_k} with E={e}")
    _check(e, block_m)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    dev = logits.device
    probs = torch.empty((t, top_k), dtype=logits.dtype, device=dev)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=dev)
    sorted_ids, block_expert, nb, meta = _align_args(t * top_k, e, block_m, dev)
    fused = t <= FUSED_MAX_TOKENS
    block_t = _tile_rows(meta["E_PAD"], t)
    args = (logits, logits.stride(0), probs, ids, sorted_ids, block_expert, t, e, nb,
            float(scaling_factor) if scaling_factor else 1.0)
    kw = dict(TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), BLOCK_T=block_t, PRE_SOFTMAX=pre_softmax,
              HAS_SCALE=bool(scaling_factor), RNE=INTERPRET, **meta)
    if fused:
        _route_kernel[(1,)](*args, FUSED=True, **kw, num_warps=4)
    else:
        _route_kernel[(triton.cdiv(t, block_t),)](*args, FUSED=False, **kw, num_warps=4)
        _align_kernel[(1,)](ids, t * top_k, e, sorted_ids, block_expert, nb, **meta, num_warps=4)
    return probs, ids, MoERouting(sorted_ids, block_expert, nb, block_m, t, top_k)
