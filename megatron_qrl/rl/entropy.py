"""Per-token entropy of the policy, H(pi(. | prefix)) = logsumexp(z) - sum_v softmax(z)_v z_v, from logits
that may be split over the vocabulary (Megatron's vocab-parallel output layer): three reductions over the
tensor-parallel group (max, sum exp, sum exp*z), never a gather of the full [tokens, vocab] logits.

QeRL's exploration claim is about this quantity (quantization noise keeps the policy's entropy up); the loop
logs its token mean over the rollout tokens as `policy/entropy` (docs/metrics.md).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def vocab_parallel_entropy(logits: torch.Tensor, group=None) -> torch.Tensor:
    """logits [..., V_local] (this rank's vocabulary shard; the whole vocabulary without a group) -> the
    entropy [...] in nats of the softmax over the full vocabulary, in float32."""
    z = logits.float()
    m = z.max(dim=-1).values
    parallel = group is not None and dist.is_initialized() and dist.get_world_size(group) > 1
    if parallel:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    shifted = z - m.unsqueeze(-1)
    e = torch.exp(shifted)
    weighted = torch.where(e > 0, e * shifted, torch.zeros_like(e))     # a -inf logit adds 0, not 0 * -inf
    sums = torch.stack([e.sum(dim=-1), weighted.sum(dim=-1)])
    if parallel:
        dist.all_reduce(sums, group=group)
    s, t = sums[0], sums[1]
    return torch.log(s) - t / s   # shift-invariant form: log sum e^(z-m) - E_p[z - m]


def token_aligned(per_position: torch.Tensor) -> torch.Tensor:
    """[b, s] values of the distribution at position t (which predicts token t+1) -> aligned with the tokens
    like the trainer's log-probs: out[:, t] belongs to token t (t >= 1), out[:, 0] = 0."""
    return torch.cat([torch.zeros_like(per_position[:, :1]), per_position[:, :-1]], dim=1)


def masked_token_mean(values: torch.Tensor, mask: torch.Tensor, num_tokens: Optional[float] = None
                      ) -> torch.Tensor:
    """sum(values * mask) / num_tokens (default: mask.sum()); a global token mean when num_tokens is the global
    count and the caller sums the results over micro-batches and ranks."""
    mask = mask.to(values.dtype)
    denom = float(mask.sum()) if num_tokens is None else float(num_tokens)
    return (values * mask).sum() / max(denom, 1.0)
