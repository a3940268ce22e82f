"""DAPO's dynamic-sampling filter: which prompt groups carry a learning signal.

A group whose rewards are all equal gets advantage exactly 0 for every response (rl/advantages.py), so its
policy-gradient terms vanish and its tokens only dilute the token mean. `informative_groups` marks the
groups with at least two different rewards; the batch builder (pipeline/batch_sampling.py) drops the rest
and generates more prompts. Equality is exact (max == min), as for the advantages.
"""
from __future__ import annotations

from typing import Sequence

import torch


def informative_groups(rewards: torch.Tensor | Sequence[float], group_size: int) -> torch.Tensor:
    """bool [num_groups]: True where a group's rewards are not all equal (group-contiguous rewards [B])."""
    r = torch.as_tensor(rewards, dtype=torch.float64).reshape(-1)
    if group_size < 1 or r.numel() % group_size:
        raise ValueError(f"{r.numel()} rewards do not split into groups of group_size={group_size}")
    g = r.reshape(-1, group_size)
    return g.amax(-1) != g.amin(-1)   # a NaN reward makes its group "informative": the guard skips the step
