"""MoE routing of a decode step in one or two launches: router top-k + probabilities + expert alignment.

Why: the torch routing of one MoE layer (topk, softmax, casts) plus `moe_align` (~15 small ops) is ~20
launches of tiny kernels, and at decode batch sizes a CUDA-graph step is bound by those launch gaps.

`route_and_align(logits [T, E], top_k, block_m)` returns what Megatron's `topk_routing_with_score_function`
(softmax score, dense output) and `moe_align(ids, E, block_m)` return together:
- top-k per row by iterative argmax (ties -> lower expert index), slots in descending score order;
- probabilities: softmax over the k selected logits in float32 (or, pre-softmax, the selected entries of
  the float32 softmax over all experts), times the optional scaling factor, cast to the logits' dtype;
- the alignment: a stable counting sort of the T*k assignments t*k + j by expert, identical to moe_align's
  sorted_ids / block_expert with the same static `max_blocks` bound.
Two launches, each over up to MAX_PROGRAMS programs of consecutive rows: (1) each program's top-k rows and
its per-expert assignment counts (hist[program, expert]); (2) each program reads all counts, takes the
block_m-padded prefix sums, and scatters its own assignments (its offset within an expert = that expert's
assignments in earlier programs, its rank inside = a one-hot cumsum), then writes its share of the blocks'
experts and pads. Until 2026-12-02 one program did all of it: its serial chunks cost 21 / 40 / 139 us per
layer at 16 / 64 / 256 rows on an H200 (docs/PERF.md). No host synchronisation, output shapes from input
shapes only (CUDA-graph capturable). `align_only(ids, E, block_m)` is the sort alone. The second launch can
also copy the ids in int16 into a column of the decode step's R3 record (`routed`), which then needs no
cast and no stack of its own (an integer-only kernel: nothing it computes can change).
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

# programs per launch at most (decode batches get one per BLOCK_T rows; prefill-sized ones loop inside)
MAX_PROGRAMS = 128
# launch shape of the two kernels on a GPU (tools/bench_routing.py sweeps them): warps per program of each
# launch, and rows per program (None: 2 up to 256 rows, then t / 8 up to 16). One warp for the top-k keeps its
# row reductions in registers and shuffles; 2-row programs spread a decode batch over many SMs (H200, 48 layers
# x E=128 top-8: 13.4 -> 7.1 us per layer at 64 rows, 19.6 -> 9.3 at 256 against 4 warps and t / 8 rows)
TUNING = {"count_warps": 1, "scatter_warps": 2, "rows_per_program": None}
SMALL_BATCH_ROWS = 256
# elements of the [rows, experts] register tiles (one-hot and logits tiles of one loop iteration); the CPU
# interpreter pays per operation, not per element, so it takes larger tiles (same code, fewer iterations)
_TILE = 32768 if INTERPRET else 4096


@triton.jit
def _topk_rows(logits_ptr, stride_l, probs_ptr, ids_ptr, row0, T, E, scaling,
               TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr, E_PAD: tl.constexpr,
               PRE_SOFTMAX: tl.constexpr, HAS_SCALE: tl.constexpr, RNE: tl.constexpr):
    """Top-k and probabilities of rows row0 .. row0 + BLOCK_T - 1 (rows >= T are skipped); returns the ids
    tile [BLOCK_T, K_PAD] (slots >= TOP_K hold 0)."""
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
    return ids


@triton.jit(do_not_specialize=["T", "rows_per_prog"])
def _route_count_kernel(logits_ptr, stride_l, probs_ptr, ids_ptr, hist_ptr, T, E, rows_per_prog, scaling,
                  TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr, E_PAD: tl.constexpr,
                  PRE_SOFTMAX: tl.constexpr, HAS_SCALE: tl.constexpr, RNE: tl.constexpr, TOPK: tl.constexpr):
    """Phase 1, program p over rows [p * rows_per_prog, (p + 1) * rows_per_prog): TOPK: the rows' top-k ids
    and probabilities from the logits (else the ids are given), and the rows' assignments counted per expert
    into hist[p, :]."""
    pid = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    slots = tl.arange(0, K_PAD)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for r in range(0, rows_per_prog, BLOCK_T):
        rows = pid * rows_per_prog + r + tl.arange(0, BLOCK_T)
        if TOPK:
            ids = _topk_rows(logits_ptr, stride_l, probs_ptr, ids_ptr, pid * rows_per_prog + r, T, E, scaling,
                             TOP_K, K_PAD, BLOCK_T, E_PAD, PRE_SOFTMAX, HAS_SCALE, RNE)
        else:
            ids = tl.load(ids_ptr + rows.to(tl.int64)[:, None] * TOP_K + slots[None, :],
                          mask=(rows < T)[:, None] & (slots < TOP_K)[None, :], other=0).to(tl.int32)
        for j in tl.static_range(TOP_K):                  # one [rows, experts] one-hot per slot
            e = tl.sum(tl.where(slots[None, :] == j, ids, 0), 1)
            e = tl.where(rows < T, e, -1)
            counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), 0)
    tl.store(hist_ptr + pid * E_PAD + experts, counts)


@triton.jit(do_not_specialize=["n", "num_blocks", "num_progs", "per_prog"])
def _route_scatter_kernel(ids_ptr, hist_ptr, n, E, sorted_ptr, block_expert_ptr, num_blocks, num_progs, per_prog,
                    routed_ptr, stride_r, top_k,
                    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr, P_CHUNK: tl.constexpr,
                    BLOCK_CHUNK: tl.constexpr, ROUTED: tl.constexpr):
    """Phase 2, program p: the stable counting sort of its assignments [p * per_prog, (p + 1) * per_prog)
    (position = the expert's padded start + the expert's assignments in programs < p + the rank in p), and
    its share of the blocks' experts and pad entries (value n). Real entries and pads land on disjoint
    positions, so the programs need no ordering among themselves. ROUTED: its assignments' ids also go to
    routed_ptr as int16 (assignment t * top_k + j at row t, slot j; row stride stride_r)."""
    pid = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    total = tl.zeros((E_PAD,), dtype=tl.int32)
    before = tl.zeros((E_PAD,), dtype=tl.int32)
    for p0 in range(0, num_progs, P_CHUNK):
        ps = p0 + tl.arange(0, P_CHUNK)
        h = tl.load(hist_ptr + ps[:, None] * E_PAD + experts[None, :], mask=(ps < num_progs)[:, None], other=0)
        total += tl.sum(h, 0)
        before += tl.sum(tl.where((ps < pid)[:, None], h, 0), 0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end_padded = tl.cumsum(padded, 0)
    start_padded = end_padded - padded
    cursor = start_padded + before
    lo = pid * per_prog
    hi = tl.minimum(lo + per_prog, n)
    for start in range(lo, hi, CHUNK):
        a = start + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + a, mask=a < hi, other=-1).to(tl.int32)
        if ROUTED:
            tl.store(routed_ptr + (a // top_k).to(tl.int64) * stride_r + a % top_k, e.to(tl.int16), mask=a < hi)
        onehot = (e[:, None] == experts[None, :]).to(tl.int32)
        rank = tl.cumsum(onehot, 0) - onehot                    # rank among this chunk's same-expert rows
        dest = tl.sum(onehot * (rank + cursor[None, :]), 1)
        tl.store(sorted_ptr + dest, a, mask=a < hi)
        cursor += tl.sum(onehot, 0)
    # blocks: expert = number of experts whose padded run ends at or before the block's start (moe_align's
    # searchsorted, right=True), -1 past the last run; positions past the expert's real rows are pads
    real_end = start_padded + total
    ends = tl.where(experts < E, end_padded, 2147483647)
    rows = tl.arange(0, BLOCK_M)
    blocks_per_prog = tl.cdiv(num_blocks, num_progs)
    b_lo = pid * blocks_per_prog
    b_hi = tl.minimum(b_lo + blocks_per_prog, num_blocks)
    for b0 in range(b_lo, b_hi, BLOCK_CHUNK):
        b = b0 + tl.arange(0, BLOCK_CHUNK)
        b_ok = b < b_hi
        first = b * BLOCK_M
        expert = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), 1)
        tl.store(block_expert_ptr + b, tl.where(expert < E, expert, -1), mask=b_ok)
        first_pad = tl.sum(tl.where(experts[None, :] == expert[:, None], real_end[None, :], 0), 1)
        pos = first[:, None] + rows[None, :]
        pad = tl.full((BLOCK_CHUNK, BLOCK_M), 0, tl.int32) + n
        tl.store(sorted_ptr + pos, pad, mask=b_ok[:, None] & (pos >= first_pad[:, None]))


def _tile_rows(e_pad: int, wanted: int) -> int:
    """Rows of a [rows, e_pad] tile: as many as `wanted` (a power of two >= 16 at most) within _TILE."""
    return max(1, min(_TILE // e_pad, max(16, triton.next_power_of_2(max(1, wanted)))))


def _route(logits, ids, probs, t: int, k: int, e: int, block_m: int, pre_softmax: bool = False,
           scaling_factor: Optional[float] = None, routed: Optional[torch.Tensor] = None) -> MoERouting:
    """The two launches: per-program top-k (when logits is given) and expert counts, then the sort (routed:
    and the int16 copy of the ids)."""
    dev = ids.device
    n = t * k
    e_pad, k_pad = triton.next_power_of_2(e), triton.next_power_of_2(k)
    nb = max_blocks(n, e, block_m)
    # rows per program on a GPU: TUNING (a decode batch spreads its top-k, sort and block table over many
    # programs; one program for 16 rows cost 8 + 21 us at 16 rows on an H200); the interpreter pays per
    # program, so it takes whole tiles
    block_t = (_tile_rows(e_pad, t) if INTERPRET else TUNING["rows_per_program"] or
               (2 if t <= SMALL_BATCH_ROWS else min(triton.next_power_of_2(triton.cdiv(t, 8)), 16,
                                                    max(2, _TILE // e_pad))))
    # rows per program: a multiple of block_t giving at most MAX_PROGRAMS programs
    rows_per_prog = block_t * triton.cdiv(triton.cdiv(t, MAX_PROGRAMS), block_t)
    progs = triton.cdiv(t, rows_per_prog)
    hist = torch.empty((progs, e_pad), dtype=torch.int32, device=dev)
    sorted_ids = torch.empty(nb * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(nb, dtype=torch.int32, device=dev)
    topk = logits is not None
    _route_count_kernel[(progs,)](
        logits if topk else ids, logits.stride(0) if topk else 0, probs if topk else ids, ids, hist, t, e,
        rows_per_prog, float(scaling_factor) if scaling_factor else 1.0,
        TOP_K=k, K_PAD=k_pad, BLOCK_T=block_t, E_PAD=e_pad, PRE_SOFTMAX=pre_softmax,
        HAS_SCALE=bool(scaling_factor), RNE=INTERPRET, TOPK=topk, num_warps=TUNING["count_warps"])
    per = rows_per_prog * k
    _route_scatter_kernel[(progs,)](
        ids, hist, n, e, sorted_ids, block_expert, nb, progs, per, routed if routed is not None else ids,
        routed.stride(0) if routed is not None else 0, k,
        BLOCK_M=block_m, E_PAD=e_pad, CHUNK=_tile_rows(e_pad, per), P_CHUNK=_tile_rows(e_pad, progs),
        BLOCK_CHUNK=_tile_rows(e_pad, triton.cdiv(nb, progs)), ROUTED=routed is not None,
        num_warps=TUNING["scatter_warps"])
    return MoERouting(sorted_ids, block_expert, nb, block_m, t, k)


def _check(num_experts: int, block_m: int) -> None:
    if num_experts < 1 or num_experts > 1024:
        raise ValueError(f"the routing kernels support 1..1024 experts, got {num_experts}")
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")


def align_only(topk_ids: torch.Tensor, num_experts: int, block_m: int = 16) -> MoERouting:
    """moe_align(topk_ids, num_experts, block_m) in two launches (same sorted_ids, block_expert, num_blocks)."""
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, k], got {tuple(topk_ids.shape)}")
    _check(num_experts, block_m)
    t, k = topk_ids.shape
    return _route(None, topk_ids.contiguous(), None, t, k, num_experts, block_m)


def route_and_align(logits: torch.Tensor, top_k: int, block_m: int, score: str = "softmax",
                    pre_softmax: bool = False, scaling_factor: Optional[float] = None,
                    routed: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, MoERouting]:
    """Router logits [T, E] -> (probs [T, k] in logits.dtype, ids [T, k] int64, the MoERouting of the ids
    for block_m), as Megatron's softmax top-k routing + moe_align compute them; two launches.
    routed: an int16 [T, k] tensor (any row stride, unit slot stride: e.g. one MoE layer's slice of a decode
    step's [T, layers, k] R3 record) that the second launch also writes the ids into."""
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
    if routed is not None and (routed.shape != (t, top_k) or routed.dtype != torch.int16 or routed.stride(1) != 1
                               or routed.device != logits.device):
        raise ValueError(f"routed must be int16 [{t}, {top_k}] with unit slot stride on {logits.device}, got "
                         f"{routed.dtype} {tuple(routed.shape)} stride {routed.stride()} on {routed.device}")
    probs = torch.empty((t, top_k), dtype=logits.dtype, device=logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    routing = _route(logits, ids, probs, t, top_k, e, block_m, pre_softmax, scaling_factor, routed)
    return probs, ids, routing
