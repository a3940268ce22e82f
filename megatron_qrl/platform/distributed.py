"""Process groups for the trainer: torch.distributed from the torchrun environment, then Megatron's.

`init_distributed(cfg)` is the single entry point: it starts torch.distributed (gloo on CPU, nccl on
GPU) from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (a lone process without torchrun gets a one-rank
group on a free local port), validates the layout against the world size *before* Megatron creates
groups, calls `parallel_state.initialize_model_parallel(tp, pp, ep, etp)` and seeds every RNG
(Megatron's tracker included) from `trainer.seed`. `set_layout` re-creates Megatron's groups with
another layout in the same processes (tests compare layouts this way); `teardown` destroys both.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from . import cpu


@dataclass(frozen=True)
class Layout:
    """A Megatron parallel layout; data parallel is whatever remains of the world."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1

    @classmethod
    def from_config(cls, cfg) -> "Layout":
        t = cfg.trainer
        return cls(t.tensor_parallel, t.pipeline_parallel, t.expert_parallel, t.expert_tensor_parallel)

    def __str__(self) -> str:
        return f"TP{self.tp}xPP{self.pp}xEP{self.ep}xETP{self.etp}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device() -> torch.device:
    """The device this rank computes on: its local GPU, or the CPU when CUDA is absent."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_process_group(timeout_minutes: int = 10) -> None:
    """torch.distributed from the torchrun env; a single local rank when the env is absent."""
    if dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl"
    else:
        backend = "gloo"
    timeout = timedelta(minutes=timeout_minutes)
    if "RANK" not in os.environ:
        # a lone process: an in-memory store, so there is no TCP port to pick (and race other jobs for)
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    dist.init_process_group(backend=backend, timeout=timeout)


def set_layout(layout: Layout, seed: int, cfg=None) -> None:
    """(Re)create Megatron's model-parallel groups for `layout` and seed all RNGs."""
    from megatron.core import parallel_state as ps

    world = dist.get_world_size()
    if cfg is not None:
        cfg.check_world_size(world)
    elif world % (layout.tp * layout.pp):
        raise ValueError(f"layout {layout} does not tile {world} ranks: tp*pp must divide the world size")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
    )
    seed_everything(seed)


def seed_everything(seed: int) -> None:
    """Python/torch seeds plus Megatron's tracker (per-TP/EP-rank streams for model-parallel init)."""
    import random

    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def init_distributed(cfg, layout: Optional[Layout] = None) -> Layout:
    """Start torch.distributed + Megatron groups for `cfg` (or an explicit layout); returns the layout."""
    cpu.install()
    init_process_group()
    layout = layout or Layout.from_config(cfg)
    set_layout(layout, cfg.trainer.seed, cfg if layout == Layout.from_config(cfg) else None)
    return layout


def teardown() -> None:
    """Destroy Megatron's groups and the torch.distributed group (safe to call twice)."""
    try:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1
