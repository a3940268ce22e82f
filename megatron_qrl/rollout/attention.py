"""Attention over the KV cache for a packed step of many sequences (the only part of the forward we own).

The engine feeds one step as a *packed* token list [T] (Megatron's [seq=T, batch=1] layout): each running
sequence contributes a contiguous run of tokens -- its whole prompt (or a chunk of it) when it was just
admitted, its last sampled token when decoding. Every token carries its own position, so sequences of
different lengths and phases share one forward with no padding in the linears, norms, router and experts.

`CachedAttention` stands in for a layer's `core_attention` module (Megatron's DotProductAttention or
TEDotProductAttention) while the engine runs: Megatron's SelfAttention still computes Q/K/V with the
model's own linear_qkv, QK-norm and RoPE (at the positions we pass), and applies linear_proj after us.
We write K/V into the cache, then each sequence's queries attend to that sequence's slot with a causal
mask on positions. The attention math itself is padded per sequence ([B, Qmax, Lmax] scores, masked),
which is exact and simple on CPU; a GPU build replaces `attend` with a varlen / paged FlashAttention
kernel (Megatron's own flash_decode_and_prefill is the model) without touching anything else.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .kv_cache import KVCache


@dataclass
class StepBatch:
    """The packed tokens of one engine step and where each sequence's tokens and cache live."""

    token_ids: torch.Tensor    # long [T]
    positions: torch.Tensor    # long [T]   position of each token in its own sequence
    token_row: torch.Tensor    # long [T]   which sequence (row 0..B-1) the token belongs to
    token_col: torch.Tensor    # long [T]   index of the token within its row's run (0..q_len-1)
    slots: torch.Tensor        # long [B]   KV cache slot of each row
    kv_lens: torch.Tensor      # long [B]   cached length of each row after this step
    last_index: torch.Tensor   # long [T-index] of each row's last token (its logits sample the next token)
    row_starts: list[int]      # first packed index of each row
    row_lens: list[int]

    @classmethod
    def build(cls, runs: Sequence[tuple[int, Sequence[int], int]], device: torch.device | str) -> "StepBatch":
        """runs: (kv slot, token ids, position of the first token) per sequence, in row order."""
        if not runs:
            raise ValueError("an engine step needs at least one sequence")
        ids, pos, row, col, starts, lens = [], [], [], [], [], []
        for b, (_, tokens, start) in enumerate(runs):
            if not tokens:
                raise ValueError(f"row {b} feeds no tokens")
            starts.append(len(ids))
            lens.append(len(tokens))
            ids.extend(int(t) for t in tokens)
            pos.extend(range(start, start + len(tokens)))
            row.extend([b] * len(tokens))
            col.extend(range(len(tokens)))

        def t(x):
            return torch.tensor(x, dtype=torch.long, device=device)

        kv_lens = [start + len(tokens) for _, tokens, start in runs]
        return cls(token_ids=t(ids), positions=t(pos), token_row=t(row), token_col=t(col),
                   slots=t([s for s, _, _ in runs]), kv_lens=t(kv_lens),
                   last_index=t([s + n - 1 for s, n in zip(starts, lens)]), row_starts=starts, row_lens=lens)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.numel())

    @property
    def num_rows(self) -> int:
        return int(self.slots.numel())


class StepState:
    """Shared by the CachedAttention modules of one model: the batch of the step being run."""

    batch: Optional[StepBatch] = None


# fp32 scores attend() holds at once: a long prefill goes through its query columns in chunks under this (a
# 16 x 4096-token prefill of 32 heads would otherwise materialize 32 GiB of scores; measured OOM on an 80 GB GPU,
# docs/PERF.md "Session of 2026-12-06"). Each query row's softmax is its own, so chunking changes no math.
SCORE_BYTES = 1 << 30


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batch: StepBatch,
           softmax_scale: float) -> torch.Tensor:
    """query [T, H, D] packed; keys/values [B, L, G, D] per row -> [T, H*D].

    Query token t of row b sees cached positions j <= positions[t] (causal; later positions of the slot
    are stale or not yet written). Scores and softmax in float32, like Megatron's attention_softmax_in_fp32;
    query columns in chunks of at most SCORE_BYTES of scores.
    """
    T, H, D = query.shape
    B, L, G, _ = keys.shape
    q_max = max(batch.row_lens)
    q = query.new_zeros(B, q_max, H, D)
    q[batch.token_row, batch.token_col] = query
    if G != H:  # grouped-query attention: each KV group serves H/G consecutive query heads
        keys = keys.repeat_interleave(H // G, dim=2)
        values = values.repeat_interleave(H // G, dim=2)
    keys_f = keys.float()
    q_pos = torch.full((B, q_max), -1, dtype=torch.long, device=query.device)
    q_pos[batch.token_row, batch.token_col] = batch.positions
    k_pos = torch.arange(L, device=query.device)
    out = torch.empty(B, q_max, H, D, dtype=values.dtype, device=query.device)
    chunk = max(1, SCORE_BYTES // (B * H * L * 4))
    for c0 in range(0, q_max, chunk):
        c1 = min(q_max, c0 + chunk)
        scores = torch.einsum("bqhd,bkhd->bhqk", q[:, c0:c1].float(), keys_f) * softmax_scale
        allowed = k_pos.view(1, 1, L) <= q_pos[:, c0:c1].view(B, c1 - c0, 1)     # padded query rows see nothing
        scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)                  # all -inf rows (padding) -> 0
        out[:, c0:c1] = torch.einsum("bhqk,bkhd->bqhd", probs.to(values.dtype), values)
    return out[batch.token_row, batch.token_col].reshape(T, H * D)


class CachedAttention(torch.nn.Module):
    """Drop-in for a layer's core_attention: cache the step's K/V, attend over each sequence's slot."""

    def __init__(self, layer: int, cache: KVCache, state: StepState, softmax_scale: float):
        super().__init__()
        self.layer, self.cache, self.state, self.softmax_scale = layer, cache, state, softmax_scale

    def forward(self, query, key, value, attention_mask=None, **unused):
        batch = self.state.batch
        if batch is None:
            raise RuntimeError("CachedAttention ran outside an engine step (no StepBatch set)")
        # Megatron hands [sq, b, heads, dim] with our packed layout b == 1
        q, k, v = query[:, 0], key[:, 0], value[:, 0]
        self.cache.write(self.layer, batch.slots[batch.token_row], batch.positions, k, v)
        keys, values = self.cache.read(self.layer, batch.slots, int(batch.kv_lens.max()))
        out = attend(q, keys, values, batch, self.softmax_scale)
        return out.unsqueeze(1).to(query.dtype)


def softmax_scale_of(core_attention: torch.nn.Module, head_dim: int) -> float:
    """The scale Megatron's core attention uses: config.softmax_scale or 1/sqrt(head_dim)."""
    config = getattr(core_attention, "config", None)
    scale = getattr(config, "softmax_scale", None)
    if getattr(config, "apply_query_key_layer_scaling", False):
        raise NotImplementedError("apply_query_key_layer_scaling is not supported by the rollout engine")
    return float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)


@contextlib.contextmanager
def cached_attention(layers: Sequence[torch.nn.Module], modules: Sequence[CachedAttention]):
    """Swap each layer's core_attention for the engine's CachedAttention; restore on exit."""
    originals = [layer.self_attention.core_attention for layer in layers]
    try:
        for layer, module in zip(layers, modules):
            layer.self_attention.core_attention = module
        yield
    finally:
        for layer, original in zip(layers, originals):
            layer.self_attention.core_attention = original
