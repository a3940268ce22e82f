"""DAPO's soft overlong punishment: a length-aware reward penalty near the generation limit.

With L_max = rollout.max_new_tokens and a buffer of L_cache = rl.overlong_buffer_len tokens, a response of
length n gets
    0                                        n <= L_max - L_cache
    factor * (L_max - L_cache - n) / L_cache  L_max - L_cache < n <= L_max   (linear, -factor at the limit)
    -factor                                   n > L_max
added to its reward. Truncated responses are usually wrong *because* they ran out of room; the ramp tells
the policy so without the cliff of a hard penalty. DAPO's other overlong option, filtering (masking
truncated responses out of the loss), is rl.mask_truncated (pipeline/rollout_batch.py).
"""
from __future__ import annotations

from typing import Sequence

import torch


def overlong_penalty(lengths: torch.Tensor | Sequence[int], max_len: int, buffer_len: int,
                     factor: float = 1.0) -> torch.Tensor:
    """float32 [B] penalties (<= 0) for response lengths [B]; zeros when buffer_len == 0 (off)."""
    n = torch.as_tensor(lengths, dtype=torch.float64).reshape(-1)
    if buffer_len <= 0:
        return torch.zeros_like(n, dtype=torch.float32)
    if buffer_len > max_len:
        raise ValueError(f"overlong buffer ({buffer_len}) longer than the length limit ({max_len}): "
                         "rl.overlong_buffer_len must be < rollout.max_new_tokens")
    expected = max_len - buffer_len
    ramp = ((expected - n) / buffer_len).clamp(min=-1.0, max=0.0)
    return (factor * ramp).to(torch.float32)
