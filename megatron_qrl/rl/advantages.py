"""GRPO group-relative advantages (METHODS.md section 7).

A_i = (r_i - mean(r_group)) / (std(r_group) + eps), std = population std (divide by G). Samples are laid out
group-contiguous: global sample j belongs to prompt j // group_size.

Normally a prompt's G responses live on one rank. When they do not (``group`` given and the batch split over
ranks in rank order, possibly unevenly), per-prompt sums are all-reduced, so every rank gets exactly the
advantages the single-process computation gives on the concatenated batch.
"""
from __future__ import annotations

from typing import Sequence

import torch

from megatron_qrl.rl.reduce import all_reduce_max, all_reduce_sum, rank_offset


def grpo_advantages(rewards: torch.Tensor | Sequence[float], group_size: int, normalize_std: bool = True,
                    eps: float = 1e-6, group=None) -> torch.Tensor:
    """Per-sample advantages [B] for group-contiguous rewards [B].

    Groups whose rewards are all equal get advantage exactly 0 (no learning signal, and no 0/eps noise).
    With ``normalize_std=False`` the advantage is r - mean (Dr. GRPO style).
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1 (got {group_size})")
    r = torch.as_tensor(rewards)
    out_dtype = r.dtype if r.is_floating_point() else torch.float32
    r64 = r.detach().to(torch.float64).reshape(-1)
    offset, total = rank_offset(r64.numel(), r64.device, group)
    if total % group_size:
        raise ValueError(f"the batch has {total} samples, not a multiple of group_size={group_size}: "
                         "every prompt needs exactly group_size responses")
    num_groups = total // group_size
    gid = (torch.arange(r64.numel(), device=r64.device) + offset) // group_size

    # pass 1: count, sum, max, -min per prompt
    sums = torch.zeros(2, num_groups, dtype=torch.float64, device=r64.device)
    sums[0].index_add_(0, gid, torch.ones_like(r64))
    sums[1].index_add_(0, gid, r64)
    all_reduce_sum(sums, group)
    ext = torch.full((2, num_groups), -torch.inf, dtype=torch.float64, device=r64.device)
    ext[0].scatter_reduce_(0, gid, r64, reduce="amax")
    ext[1].scatter_reduce_(0, gid, -r64, reduce="amax")
    all_reduce_max(ext, group)
    mean = sums[1] / sums[0]
    constant = ext[0] == -ext[1]

    centered = r64 - mean[gid]
    if normalize_std:
        # pass 2: centred sum of squares (two-pass is exact for constant groups and stable in float64)
        sq = torch.zeros(num_groups, dtype=torch.float64, device=r64.device)
        sq.index_add_(0, gid, centered * centered)
        all_reduce_sum(sq, group)
        std = torch.sqrt(sq / sums[0])
        adv = centered / (std[gid] + eps)
    else:
        adv = centered
    adv = torch.where(constant[gid], torch.zeros_like(adv), adv)
    return adv.to(out_dtype).reshape(r.shape)
