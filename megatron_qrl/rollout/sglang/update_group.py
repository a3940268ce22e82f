"""The trainer's end of SGLang's weight-update process group (disaggregated placement).

`init_weights_update_group` makes every engine rank join a torch.distributed group of its own:
rendezvous at tcp://master_address:master_port, keys under a PrefixStore named after the group,
engine rank = rank_offset + its TP rank, and the trainer is rank 0, the source of every broadcast.
The trainer already lives in Megatron's default group, so this second, independent group is built with
torch's process-group helper from the same rendezvous (the only way torch offers; it is private API,
so `open_update_group` adapts to the helper's keyword name across torch versions).
"""
from __future__ import annotations

import inspect
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist


def open_update_group(master_address: str, master_port: int, world_size: int, rank: int = 0,
                      group_name: str = "weight_update_group", backend: str = "nccl",
                      timeout_s: float = 600.0):
    """Join (rank 0: host) the update group; returns the ProcessGroup. Blocks until all ranks joined."""
    from torch.distributed import distributed_c10d as c10d

    if world_size < 2:
        raise ValueError(f"an update group needs the trainer and at least one engine rank, got world_size={world_size}")
    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(c10d.rendezvous(f"tcp://{master_address}:{int(master_port)}", rank, world_size,
                                                   timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    helper = c10d._new_process_group_helper
    params = inspect.signature(helper).parameters
    options = {"backend_options" if "backend_options" in params else "pg_options": None}
    pg, _ = helper(world_size, rank, [], c10d.Backend(backend), store, group_name=group_name, timeout=timeout,
                   **options)
    # ranks of this group are its own global numbering (src=0 is the trainer), as on the engine side
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def close_update_group(pg) -> None:
    if pg is not None:
        dist.destroy_process_group(pg)


def broadcast_bucket(flat: torch.Tensor, pg, src: int = 0) -> None:
    """Send one flattened bucket from the trainer (rank `src`) to every engine rank of the group."""
    dist.broadcast(flat, src=src, group=pg)


def receive_bucket(nbytes: int, pg, device: Optional[torch.device] = None) -> torch.Tensor:
    """The engine side of broadcast_bucket (what the release's flattened-bucket receiver does); for tests."""
    flat = torch.empty(int(nbytes), dtype=torch.uint8, device=device)
    dist.broadcast(flat, src=0, group=pg)
    return flat
