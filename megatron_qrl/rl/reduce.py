"""Global reductions for batch statistics.

Every RL statistic (advantage group means, AIS factors, token counts) must equal the single-process value
when the batch is split over data-parallel ranks. We therefore reduce *sums* (and counts) in float64 with
one all_reduce per pass, never means of means. With ``group=None`` these are no-ops, so the single-process
path and the distributed path run the same arithmetic.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def _active(group) -> bool:
    return group is not None and dist.is_available() and dist.is_initialized()


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    """In-place SUM over `group` (no-op without one); returns `t` for chaining."""
    if _active(group):
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def all_reduce_max(t: torch.Tensor, group=None) -> torch.Tensor:
    """In-place MAX over `group` (no-op without one); returns `t`."""
    if _active(group):
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


def global_sums(values: list[torch.Tensor], group=None) -> torch.Tensor:
    """Sum each tensor (all elements) into one float64 vector and all-reduce it in a single call."""
    device = values[0].device if values else torch.device("cpu")
    out = torch.stack([v.detach().to(torch.float64).sum() for v in values]) if values else \
        torch.zeros(0, dtype=torch.float64, device=device)
    return all_reduce_sum(out, group)


def count_valid_tokens(mask: torch.Tensor, group=None) -> int:
    """Number of valid (mask != 0) tokens over the whole batch: pass it as `num_tokens_global`."""
    n = mask.detach().to(torch.float64).ne(0).sum().reshape(1)
    return int(all_reduce_sum(n, group).item())


def rank_offset(local_size: int, device: torch.device, group=None) -> tuple[int, int]:
    """(first global index of this rank's samples, global sample count), ranks in group-rank order."""
    if not _active(group):
        return 0, local_size
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([local_size], dtype=torch.int64, device=device), group=group)
    sizes_l = [int(s.item()) for s in sizes]
    me = dist.get_rank(group)
    return sum(sizes_l[:me]), sum(sizes_l)


def as_float(x: Optional[torch.Tensor | float]) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)
