"""Token selection: temperature, top-k, top-p, greedy; per-sequence generators; policy log-probs.

Each sequence owns a torch.Generator seeded from (SamplingParams.seed, the sequence's index in the
generate() call) and draws exactly one uniform per generated token. So a sequence's tokens depend only
on its own logits and seed -- not on which other sequences share the batch or on the order the
scheduler admits them -- which is what makes seeded runs reproducible under continuous batching.
"""
from __future__ import annotations

import torch

from .protocol import SamplingParams

_SEED_STRIDE = 1_000_003  # a prime: (seed, index) pairs map to distinct generator seeds


def sequence_generator(seed: int, index: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator of the `index`-th prompt of a generate() call with SamplingParams.seed `seed`."""
    g = torch.Generator(device=device)
    g.manual_seed((int(seed) * _SEED_STRIDE + int(index)) % (2 ** 63 - 1))
    return g


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled float32 logits of one sequence [V] with top-k then top-p applied (-inf outside)."""
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(-1)
        # drop a token when the mass strictly before it already reaches top_p (the top token always stays)
        drop_sorted = (cum - torch.softmax(sorted_x, dim=-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from one sequence's logits [V]; greedy (argmax, first index on ties) at temperature 0.

    The uniform draw happens even for greedy sequences so the generator stream is the same whatever the
    temperature (an observable simplification, not a requirement).
    """
    u = torch.rand((), generator=generator, device=generator.device)
    if params.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(filter_logits(logits, params), dim=-1)
    # inverse-CDF sampling with the sequence's single uniform: deterministic given (logits, u). The first
    # index whose cumulative mass exceeds u*total always has non-zero probability (never a filtered token).
    cdf = probs.double().cumsum(-1)
    idx = int(torch.searchsorted(cdf, (u.double() * cdf[-1]).reshape(1), right=True).item())
    return min(idx, int(torch.nonzero(probs).max()))


def policy_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log_softmax(raw logits [..., V] in float32)[token] for tokens [...]: the policy log-prob
    (temperature 1, no top-k/top-p), i.e. log pi_rollout of the sampled token."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
