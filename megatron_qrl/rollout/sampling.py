"""Token selection: temperature, top-k, top-p, greedy, batched over rows; per-sequence seeds; log-probs.

Each sequence draws one uniform per generated token from a counter-based stream keyed by
(SamplingParams.seed, the sequence's global index) (rng.py). So a sequence's tokens depend only on its own
logits and seed -- not on which other sequences share the batch or on the order the scheduler admits them
-- which is what makes seeded runs reproducible under continuous batching, and lets a CUDA graph sample
all rows on the device with no host state. The eager engine and the graph decode path call the same
`sample_and_logprob`, so they pick the same tokens from the same logits.

`sample_and_logprob` is the entry point: on CUDA tensors (or with QRL_KERNELS=triton under the Triton
interpreter) greedy and plain-temperature sampling plus the log-prob run as two Triton launches over the
vocabulary (kernels/decode_sampling.py; the uniforms are drawn inside them), top-k / top-p keep the torch
selection; `sample_rows` and `policy_logprobs` are the torch reference (and the CPU path).
"""
from __future__ import annotations

from typing import Optional

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


def sample_rows(logits: torch.Tensor, params: SamplingParams, u: Optional[torch.Tensor]) -> torch.Tensor:
    """One token per row of logits [B, V] given each row's uniform u [B] (float64; unused when greedy); long [B].

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


def sample_and_logprob(logits: torch.Tensor, params: SamplingParams, keys: torch.Tensor, counters: torch.Tensor,
                       logprobs: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Rows of logits [B, V], each row's stream key and token counter [B] -> (tokens long [B], policy
    log-probs float32 [B], or None with logprobs=False on the torch path). No host synchronisation; the
    uniforms are only drawn when sampling."""
    from megatron_qrl.kernels import use_triton

    from .rng import uniforms

    if use_triton(logits):
        from megatron_qrl.kernels.decode_sampling import greedy_token_logprob, sample_token_logprob, token_logprob

        if params.greedy:
            return greedy_token_logprob(logits)
        if not filters_tokens(params, logits.shape[-1]):
            return sample_token_logprob(logits, temperature=params.temperature, keys=keys, counters=counters)
        tokens = sample_rows(logits, params, uniforms(keys, counters))
        return tokens, token_logprob(logits, tokens)
    tokens = sample_rows(logits, params, None if params.greedy else uniforms(keys, counters))
    return tokens, policy_logprobs(logits, tokens) if logprobs else None


def filters_tokens(params: SamplingParams, vocab: int) -> bool:
    """Whether top-k or top-p removes tokens (filter_logits does more than the temperature)."""
    return bool(params.top_k and params.top_k < vocab) or params.top_p < 1.0


def sample_step(logits: torch.Tensor, params: SamplingParams, keys: list[torch.Tensor], counters: list[int]
                ) -> tuple[list[int], list]:
    """The eager engine's sampling of one step: rows of logits [n, V], each sequence's stream key and token
    counter -> (tokens, log-probs or Nones), one device->host copy."""
    dev = logits.device
    tokens, lp = sample_and_logprob(logits, params, torch.cat(keys).to(dev), torch.tensor(counters, device=dev),
                                    logprobs=params.return_logprobs)
    if not params.return_logprobs:
        return tokens.tolist(), [None] * len(counters)
    both = torch.stack([tokens.double(), lp.double()]).cpu()
    return [int(t) for t in both[0].tolist()], both[1].tolist()
