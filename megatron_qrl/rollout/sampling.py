"""Token selection: temperature, top-k, top-p, greedy, batched over rows; per-sequence seeds; log-probs.

Each sequence draws one uniform per generated token from a counter-based stream keyed by
(SamplingParams.seed, the sequence's global index) (rng.py). So a sequence's tokens depend only on its own
logits and seed -- not on which other sequences share the batch or on the order the scheduler admits them
-- which is what makes seeded runs reproducible under continuous batching, and lets a CUDA graph sample
all rows on the device with no host state. The eager engine and the graph decode path call the same
`sample_rows`, so they pick the same tokens from the same logits.
"""
from __future__ import annotations

import torch

from .protocol import SamplingParams
from .rng import SequenceRandom


def sequence_generator(seed: int, index: int, device: torch.device | str = "cpu") -> SequenceRandom:
    """The random stream of the `index`-th prompt of a generate() call with SamplingParams.seed `seed`."""
    return SequenceRandom(seed, index)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled float32 logits [..., V] with top-k then top-p applied (-inf outside)."""
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        p_sorted = torch.softmax(sorted_x, dim=-1)
        # drop a token when the mass strictly before it already reaches top_p (the top token always stays)
        drop_sorted = (p_sorted.cumsum(-1) - p_sorted) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def sample_rows(logits: torch.Tensor, params: SamplingParams, u: torch.Tensor) -> torch.Tensor:
    """One token per row of logits [B, V] given each row's uniform u [B] (float64); long [B].

    Greedy (temperature 0): argmax, first index on ties. Otherwise inverse-CDF sampling with the row's
    uniform: deterministic given (logits, u), and the chosen index always has non-zero probability (never
    a filtered token). Host-sync free: the CUDA-graph decode step runs it as it is.
    """
    if params.greedy:
        return torch.argmax(logits, dim=-1)
    probs = torch.softmax(filter_logits(logits, params), dim=-1)
    cdf = probs.double().cumsum(-1)
    target = (u.to(torch.float64) * cdf[:, -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    positions = torch.arange(probs.shape[-1], device=probs.device)
    last_nonzero = torch.where(probs > 0, positions, torch.zeros_like(positions)).amax(-1)
    return torch.minimum(idx, last_nonzero)


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: SequenceRandom) -> int:
    """One token from one sequence's logits [V]; draws the sequence's next uniform (also when greedy, so
    the stream position always equals the number of generated tokens)."""
    u = generator.next().reshape(1).to(logits.device)
    return int(sample_rows(logits.reshape(1, -1), params, u)[0])


def policy_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log_softmax(raw logits [..., V] in float32)[token] for tokens [...]: the policy log-prob
    (temperature 1, no top-k/top-p), i.e. log pi_rollout of the sampled token."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def sample_step(logits: torch.Tensor, params: SamplingParams, keys: list[torch.Tensor], counters: list[int]
                ) -> tuple[list[int], list]:
    """The eager engine's sampling of one step: rows of logits [n, V], each sequence's stream key and token
    counter -> (tokens, log-probs or Nones), one device->host copy."""
    from .rng import uniforms

    u = uniforms(torch.cat(keys), torch.tensor(counters)).to(logits.device)
    tokens = sample_rows(logits, params, u)
    if not params.return_logprobs:
        return tokens.tolist(), [None] * len(counters)
    lp = policy_logprobs(logits, tokens)
    both = torch.stack([tokens.double(), lp.double()]).cpu()
    return [int(t) for t in both[0].tolist()], both[1].tolist()
