"""Objects between ranks: torch.save bytes as uint8 tensors (NCCL moves tensors only), a broadcast from
one rank and an all-gather of what a disaggregated job's engine ranks contribute."""
from __future__ import annotations

import io

import torch
import torch.distributed as dist

from megatron_qrl.trace.transport import comm_device


def to_bytes(obj) -> bytes:
    """torch.save, not pickle: pickle cannot serialize the float8 TRACE scales (torch 2.13)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def from_bytes(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


def broadcast_object(obj, src: int, group=None):
    """to_bytes(obj) from `src` to the group as a uint8 tensor (NCCL moves tensors only)."""
    device = comm_device(group)
    if dist.get_rank() == src:
        data = torch.frombuffer(bytearray(to_bytes(obj)), dtype=torch.uint8).to(device)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    else:
        size = torch.empty(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src, group=group)
    if dist.get_rank() != src:
        data = torch.empty(int(size), dtype=torch.uint8, device=device)
    dist.broadcast(data, src, group=group)
    return obj if dist.get_rank() == src else from_bytes(data.cpu().numpy().tobytes())


def gather_from_engines(payload, place):
    """all_gather_object over the default group: engines contribute `payload`, trainers None; returns the
    engines' payloads in engine order on every rank."""
    parts = all_gather_objects(payload)
    return [parts[r] for r in place.engine_ranks]


def all_gather_objects(obj) -> list:
    """Every rank's `obj` on every rank (default group), through to_bytes."""
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, to_bytes(obj))
    return [from_bytes(p) for p in parts]
