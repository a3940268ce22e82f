"""Decode attention over the embedded engine's KV cache, for CUDA-graph decode steps.

The engine's cache (megatron_qrl/rollout/kv_cache.py) holds per layer K and V as [slots, max_len, G, D]
in the model's dtype; row b of a decode step reads slot `slots[b]` up to its own length `lens[b]`. Both
live in device memory, so one launch with a grid fixed by the batch bucket serves every step: what varies
per step (lengths, slots) is read by the kernel, which a CUDA graph replays as captured.

Flash-decoding: the grid is (row, KV head, split of max_len); each program takes the GQA group of query
heads that share a KV head (padded to 16 rows for the tensor cores), walks its split up to the row's
length in BLOCK_S steps with an online softmax and writes a partial (acc, max, sum); splits past the
length do no work. `_combine_kernel` merges the splits in a fixed order (deterministic). Scores and softmax
in float32; probabilities are cast to the cache dtype for the P.V dot, as the eager engine's attention
casts them (`rollout/attention.py: attend`).
Reference: `cache_decode_attention_reference`.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .attention_combine import _combine_kernel
from .rounding import _cast_out
from .w4a16_gemm import INTERPRET

SPLIT_TOKENS = 256      # positions per split: short contexts touch one split, long ones spread out


@triton.jit(do_not_specialize=["s_per_split"])
def _cache_decode_kernel(q_ptr, k_ptr, v_ptr, slots_ptr, lens_ptr, acc_ptr, ml_ptr, o_ptr,
                         HQ, stride_slot, stride_pos, s_per_split, sm_scale,
                         GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, DOT_F32: tl.constexpr, RNE: tl.constexpr):
    """NUM_SPLITS == 1: the program holds the whole row and writes acc / sum (what _combine_kernel computes
    from one split) straight to o_ptr, saving the combine launch."""
    b = tl.program_id(0)
    hk = tl.program_id(1)
    sp = tl.program_id(2)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    seq_len = tl.load(lens_ptr + b)
    s_begin = sp * s_per_split
    s_end = tl.minimum(s_begin + s_per_split, seq_len)

    g = tl.arange(0, G_PAD)
    g_mask = g < GROUP
    heads = hk * GROUP + g
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (b * HQ + heads).to(tl.int64)[:, None] * D + d[None, :], mask=g_mask[:, None], other=0.0)
    base = slot * stride_slot + hk * D
    m_i = tl.full((G_PAD,), -float("inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, D), tl.float32)
    for s0 in range(s_begin, s_end, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        s_mask = offs_s < s_end
        rows = base + offs_s.to(tl.int64)[:, None] * stride_pos + d[None, :]
        k = tl.load(k_ptr + rows, mask=s_mask[:, None], other=0.0)
        if DOT_F32:
            sc = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
        else:
            sc = tl.dot(q, tl.trans(k))
        sc = tl.where(s_mask[None, :], sc * sm_scale, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + rows, mask=s_mask[:, None], other=0.0)
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32))
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if NUM_SPLITS == 1:
        o_rows = (b * HQ + heads).to(tl.int64)
        tl.store(o_ptr + o_rows[:, None] * D + d[None, :], _cast_out(acc / l_i[:, None], o_ptr, RNE),
                 mask=g_mask[:, None])
        return
    out_row = (b * HQ + heads).to(tl.int64) * NUM_SPLITS + sp
    tl.store(acc_ptr + out_row[:, None] * D + d[None, :], acc, mask=g_mask[:, None])
    tl.store(ml_ptr + out_row * 2, m_i, mask=g_mask)
    tl.store(ml_ptr + out_row * 2 + 1, l_i, mask=g_mask)


def split_plan(max_len: int, block_s: int = 64) -> tuple[int, int]:
    """(num_splits, positions per split) for a cache of max_len positions (static: fixed per cache)."""
    num_splits = triton.next_power_of_2(max(1, triton.cdiv(max_len, SPLIT_TOKENS)))
    per_split = triton.cdiv(triton.cdiv(max_len, num_splits), block_s) * block_s
    return num_splits, per_split


def cache_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                           lens: torch.Tensor, sm_scale: float, block_s: int = 64, num_warps: int = 4,
                           num_stages: int = 2) -> torch.Tensor:
    """softmax(q K^T * sm_scale) V for each row over the first lens[b] positions of cache slot slots[b].

    q [B, H, D]; keys / values [slots, max_len, G, D] (one layer of the engine's KVCache, same dtype as q);
    slots, lens int [B] device tensors (lens >= 1). Returns [B, H, D] in q's dtype. No host synchronisation.
    """
    bsz, hq, d = q.shape
    _, s_max, hkv, dk = keys.shape
    if dk != d or hq % hkv or d < 16 or d & (d - 1):
        raise ValueError(f"unsupported shapes: q {tuple(q.shape)}, cache {tuple(keys.shape)}")
    if keys.stride(-1) != 1 or keys.stride() != values.stride():
        raise ValueError("keys and values must be contiguous caches of one layout")
    group = hq // hkv
    num_splits, per_split = split_plan(s_max, block_s)
    qc = q.contiguous()
    out = torch.empty((bsz, hq, d), device=q.device, dtype=q.dtype)
    # one split (a short cache): the kernel writes the output itself; else partials + the combine launch
    acc = torch.empty((bsz, hq, num_splits, d) if num_splits > 1 else (1,), device=q.device, dtype=torch.float32)
    ml = torch.empty((bsz, hq, num_splits, 2) if num_splits > 1 else (1,), device=q.device, dtype=torch.float32)
    _cache_decode_kernel[(bsz, hkv, num_splits)](
        qc, keys, values, slots, lens, acc, ml, out, hq, keys.stride(0), keys.stride(1), per_split, sm_scale,
        GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)), D=d, BLOCK_S=block_s,
        NUM_SPLITS=num_splits, DOT_F32=INTERPRET or q.dtype == torch.float32, RNE=INTERPRET, num_warps=num_warps,
        num_stages=num_stages)
    if num_splits > 1:
        _combine_kernel[(bsz * hq,)](acc, ml, out, D=d, NUM_SPLITS=num_splits, RNE=INTERPRET, num_warps=4)
    return out


def cache_decode_attention_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                                     slots: torch.Tensor, lens: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """Per-row float32 softmax attention over the gathered cache rows (GQA by repetition)."""
    bsz, hq, d = q.shape
    group = hq // keys.shape[2]
    out = torch.empty(bsz, hq, d, dtype=torch.float32, device=q.device)
    for b in range(bsz):
        n = int(lens[b])
        kk = keys[int(slots[b]), :n].float().repeat_interleave(group, 1).transpose(0, 1)     # [H, n, D]
        vv = values[int(slots[b]), :n].float().repeat_interleave(group, 1).transpose(0, 1)
        p = torch.softmax((q[b].float()[:, None, :] @ kk.transpose(1, 2)).squeeze(1) * sm_scale, -1)
        out[b] = (p[:, None, :] @ vv).squeeze(1)
    return out.to(q.dtype)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
