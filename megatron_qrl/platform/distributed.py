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

from .cpu import install as install_cpu_runtime
from .placement import Placement


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


_PLACEMENT: Optional[Placement] = None
_TRAINER_GROUP = None
_WEIGHT_SYNC_GROUP = None


def job_placement() -> Placement:
    """This job's rank split (colocated over the whole world unless init_distributed said otherwise)."""
    return _PLACEMENT or Placement("colocated", world_size(), world_size())


def trainer_group():
    """The process group of the trainer ranks (None = the default group, when every rank trains)."""
    return _TRAINER_GROUP


def weight_sync_group():
    """Disaggregated: the group {trainer rank 0} + engine ranks that weight broadcasts use (None elsewhere)."""
    return _WEIGHT_SYNC_GROUP


def set_layout(layout: Layout, seed: int, cfg=None, place: Optional[Placement] = None) -> None:
    """(Re)create Megatron's model-parallel groups for `layout` and seed all RNGs.

    With a disaggregated placement the trainer ranks get `layout` over a world of their own and every
    engine rank a one-rank 1x1x1 world (see megatron_qrl.platform.placement); colocated with a sharded
    layout, every rank also gets a one-rank world for its engine (`engine_world`).
    """
    from megatron.core import parallel_state as ps

    global _PLACEMENT, _TRAINER_GROUP, _WEIGHT_SYNC_GROUP, _ENGINE_WORLD
    place = place or Placement("colocated", dist.get_world_size(), dist.get_world_size())
    world = place.num_trainers
    if cfg is not None:
        cfg.check_world_size(world)
    elif world % (layout.tp * layout.pp):
        raise ValueError(f"layout {layout} does not tile {world} ranks: tp*pp must divide the world size")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    me = dist.get_rank()
    _ENGINE_WORLD = None
    if not place.disaggregated:
        ps.initialize_model_parallel(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
                                     expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp)
        _TRAINER_GROUP = None
        if layout.tp * layout.pp * layout.ep * layout.etp != 1:
            _ENGINE_WORLD = _one_rank_world(ps, me)
    else:
        # torch names a locally synchronized group by its ranks *and the number of groups the calling
        # process has registered so far*, so every member must have created the same number of groups
        # before: each rank creates exactly one group here (the weight-sync group, or a one-rank
        # placeholder when it is not a member), before the two sides' Megatron worlds diverge.
        sync_ranks = [0, *place.engine_ranks]
        group = dist.new_group(sync_ranks if me in sync_ranks else [me], use_local_synchronization=True)
        _WEIGHT_SYNC_GROUP = group if me in sync_ranks else None
        trainers = list(range(world))   # the same: one group per rank (engines: a placeholder)
        group = dist.new_group(trainers if place.is_trainer(me) else [me], use_local_synchronization=True)
        _TRAINER_GROUP = group if place.is_trainer(me) else None
        own = layout if place.is_trainer(me) else Layout()
        with _local_group_creation(ps):   # only the members of each group take part in creating it
            ps.initialize_model_parallel(
                tensor_model_parallel_size=own.tp, pipeline_model_parallel_size=own.pp,
                expert_model_parallel_size=own.ep, expert_tensor_parallel_size=own.etp,
                local_world_size=world if place.is_trainer(me) else 1,
                rank_offset=0 if place.is_trainer(me) else me)
    _PLACEMENT = place
    seed_everything(seed)


_ENGINE_WORLD: Optional[dict] = None


def _megatron_state(ps) -> dict:
    """parallel_state's module-level state (its _UPPER_CASE globals: groups, ranks, sizes, buffers)."""
    return {k: v for k, v in vars(ps).items() if k.startswith("_") and k[1:2].isupper()}


def _one_rank_world(ps, me: int) -> dict:
    """A 1x1x1 Megatron world of this rank alone, created beside the trainer's; returns its state and leaves
    the trainer's in place. Every rank creates the same groups (its own), so the group counts agree."""
    trainer = _megatron_state(ps)
    ps.destroy_model_parallel()          # forgets the trainer's groups (they stay alive in `trainer`)
    with _local_group_creation(ps):
        ps.initialize_model_parallel(1, 1, expert_model_parallel_size=1, expert_tensor_parallel_size=1,
                                     local_world_size=1, rank_offset=me)
    engine = _megatron_state(ps)
    vars(ps).update(trainer)
    return engine


def engine_world_active() -> bool:
    """Whether this rank's colocated engine has a Megatron world of its own (a sharded colocated trainer)."""
    return _ENGINE_WORLD is not None


class engine_world:
    """Megatron's parallel state as the colocated engine must see it, for the duration of a with-block.

    A colocated engine runs the whole model on its rank. Beside a sharded trainer (TP/PP/EP > 1) it gets a
    one-rank world of its own (set_layout creates it), swapped in while the engine builds or runs and
    swapped back after; otherwise this does nothing. Not reentrant across threads (the loop is serial)."""

    def __enter__(self):
        if _ENGINE_WORLD is None:
            return self
        from megatron.core import parallel_state as ps

        self._saved = _megatron_state(ps)
        vars(ps).update(_ENGINE_WORLD)
        return self

    def __exit__(self, *exc):
        saved = getattr(self, "_saved", None)
        if saved is not None:
            from megatron.core import parallel_state as ps

            vars(ps).update(saved)
            self._saved = None


class _local_group_creation:
    """Megatron's create_group with use_local_synchronization=True for the duration of a with-block.

    Megatron calls create_group on every rank for every group; with local synchronization only members
    register a group, and torch names a locally synchronized group by the number of groups the process
    registered before. A rank outside a group therefore registers a one-rank placeholder instead, so that
    all ranks keep the same count (otherwise e.g. PP's first-stage-only position-embedding group would
    make the next shared group hang)."""

    def __init__(self, ps):
        self.ps, self.original = ps, ps.create_group

    def __enter__(self):
        original = self.original

        def create_group(ranks=None, *args, **kwargs):
            me = dist.get_rank()
            if ranks is not None and me not in ranks:
                dist.new_group([me], use_local_synchronization=True)
                return None
            kwargs["use_local_synchronization"] = True
            return original(ranks, *args, **kwargs)

        self.ps.create_group = create_group

    def __exit__(self, *exc):
        self.ps.create_group = self.original


def seed_everything(seed: int) -> None:
    """Python/torch seeds plus Megatron's tracker (per-TP/EP-rank streams for model-parallel init)."""
    import random

    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def init_distributed(cfg, layout: Optional[Layout] = None) -> Layout:
    """Start torch.distributed + Megatron groups for `cfg` (or an explicit layout); returns the layout."""
    install_cpu_runtime()
    init_process_group()
    layout = layout or Layout.from_config(cfg)
    place = Placement.from_config(cfg, dist.get_world_size())
    set_layout(layout, cfg.trainer.seed, cfg if layout == Layout.from_config(cfg) else None, place)
    return layout


def teardown() -> None:
    """Destroy Megatron's groups and the torch.distributed group (safe to call twice)."""
    try:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
    finally:
        global _PLACEMENT, _TRAINER_GROUP, _WEIGHT_SYNC_GROUP, _ENGINE_WORLD
        _PLACEMENT = _TRAINER_GROUP = _WEIGHT_SYNC_GROUP = _ENGINE_WORLD = None
        if dist.is_initialized():
            dist.destroy_process_group()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


class default_group_is_trainers:
    """Inside the block, collectives that Megatron issues on the default group (group=None) run on the
    trainer group instead. Needed where Megatron assumes every rank trains: get_megatron_optimizer aligns
    parameter groups with an all_gather_object over the default group, which in a disaggregated job also
    holds the engine ranks. No-op when every rank trains."""

    # function -> index of its positional `group` argument
    _PATCHED = {"all_gather_object": 2, "get_world_size": 0}

    def __enter__(self):
        group = trainer_group()
        self.saved = {name: getattr(dist, name) for name in self._PATCHED}
        if group is None:
            return self
        for name, fn in self.saved.items():
            def on_trainers(*args, _fn=fn, _pos=self._PATCHED[name], **kwargs):
                if len(args) <= _pos and kwargs.get("group") is None:
                    kwargs["group"] = group
                return _fn(*args, **kwargs)
            setattr(dist, name, on_trainers)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)
