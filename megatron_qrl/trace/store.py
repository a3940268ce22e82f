"""Where caches live between the engine's generate() and the trainer's use: device -> host -> disk.

Tiers:
- device: the engine builds a cache where its captures are (GPU memory on GPU; on a CPU-only machine
  this "GPU buffer" is ordinary CPU memory and the next tier is a copy into another CPU buffer);
- host: `put` serializes the cache into one contiguous host buffer, pinned when CUDA is available (so
  the copy back to the GPU, and NCCL staging, run at full PCIe speed), while the host bytes held stay
  within trace.memory_budget_mb;
- disk: beyond the budget, caches spill to trace.spill_dir as one file each (written atomically, read
  back with checksum verification); without spill_dir, exceeding the budget is a TraceBudgetError.

`plan(cfg, tokens_per_step)` checks before the run that one step's cache fits, naming the fix.
"""
from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from megatron_qrl.errors import free_bytes

from .cache import BITS_PER_ELEMENT, TraceCache
from .errors import TraceBudgetError
from .serialize import from_bytes, to_bytes

MiB = 1024 * 1024
_HEADER_BYTES_PER_ENTRY = 48      # JSON entry record
_TOKEN_BYTES = 12 / 16            # a token run (12 bytes) per ~16 tokens; exact count depends on rollouts


@dataclass(frozen=True)
class SiteSpec:
    """One cached site kind of a layer: its K, rows per token, and how many entries it splits into."""

    name: str
    k: int
    rows_per_token: int
    entries: int


def cached_sites(cfg) -> list[SiteSpec]:
    """The quantized activation sites TRACE caches in each cached layer, by quant.targets."""
    m = cfg.model
    sites: list[SiteSpec] = []
    if m.num_experts:
        sites += [SiteSpec("expert.fc1", m.hidden_size, m.moe_router_topk, m.num_experts),
                  SiteSpec("expert.fc2", m.moe_ffn_hidden_size, m.moe_router_topk, m.num_experts)]
    if cfg.quant.targets == "all_linears":
        sites += [SiteSpec("qkv", m.hidden_size, 1, 1), SiteSpec("proj", m.num_attention_heads * m.head_dim, 1, 1)]
        if not m.num_experts:
            sites += [SiteSpec("fc1", m.hidden_size, 1, 1), SiteSpec("fc2", m.ffn_hidden_size, 1, 1)]
        elif m.moe_shared_expert_ffn_hidden_size:
            sites += [SiteSpec("shared_fc1", m.hidden_size, 1, 1),
                      SiteSpec("shared_fc2", m.moe_shared_expert_ffn_hidden_size, 1, 1)]
    return sites


@dataclass(frozen=True)
class TracePlan:
    tokens_per_step: int
    cached_layers: int
    bytes_per_layer: int
    fixed_bytes: int
    bytes_per_step: int
    budget_bytes: int
    layers_that_fit: int
    tier: str              # "host" or "disk"

    def describe(self) -> str:
        return (f"TRACE cache: {self.bytes_per_step / MiB:.1f} MiB per step for {self.cached_layers} cached layers "
                f"({self.bytes_per_layer / MiB:.2f} MiB per layer, {self.tokens_per_step} tokens), budget "
                f"{self.budget_bytes / MiB:.0f} MiB, tier {self.tier}")


def estimate_layer_bytes(cfg, tokens: int, engine_calls: Optional[int] = None) -> int:
    """Estimated serialized bytes of one cached layer for `tokens` forwarded tokens.

    Payload 1.5 bits per element, plus per entry a global-scale table (one fp32 per engine call that
    routed rows there; default rollout.max_new_tokens + 1 calls) with a per-row index into it, the row-set
    masks (one bit per token per expert) and the entry's header record.
    """
    calls = (cfg.rollout.max_new_tokens + 1) if engine_calls is None else engine_calls
    total = 0.0
    for s in cached_sites(cfg):
        rows = tokens * s.rows_per_token
        rows_per_entry = rows / s.entries
        u = max(1, min(calls, math.ceil(rows_per_entry)))
        total += rows * s.k * BITS_PER_ELEMENT / 8
        total += s.entries * (4 * u + _HEADER_BYTES_PER_ENTRY + 4 * 8)  # table, header, section padding
        total += rows * max(0, (u - 1).bit_length()) / 8
    experts = cfg.model.num_experts if cfg.model.num_experts else 1
    if cached_sites(cfg):
        total += experts * math.ceil(tokens / 8)                      # row sets (fc1/fc2 share one)
    return int(math.ceil(total))


def plan(cfg, tokens_per_step: int, engine_calls: Optional[int] = None) -> TracePlan:
    """Bytes one step's cache needs on this process; TraceBudgetError (naming the fix) if it cannot fit.

    tokens_per_step: forwarded tokens whose rows this process holds (engine: its rollouts; trainer rank:
    its data-parallel share, or all of it under EP for the expert sites). With trace.spill_dir set, a
    cache beyond trace.memory_budget_mb spills to disk instead (checked against the free space there).
    """
    t = cfg.trace
    n_layers = len(cfg.cached_layers())
    per_layer = estimate_layer_bytes(cfg, tokens_per_step, engine_calls)
    fixed = int(512 + tokens_per_step * _TOKEN_BYTES)
    needed = fixed + n_layers * per_layer
    budget = int(t.memory_budget_mb * MiB)
    fit = 0 if per_layer == 0 else max(0, min(cfg.model.num_layers, (budget - fixed) // per_layer))
    if per_layer == 0:
        fit = cfg.model.num_layers
    tier = "host"
    if needed > budget:
        if t.spill_dir is None:
            fix_layers = (f"trace.num_cached_layers={fit} (the most that fit)" if fit > 0 else
                          "(not even one layer fits)")
            raise TraceBudgetError(
                f"TRACE cache needs {needed / MiB:.1f} MiB per step ({n_layers} cached layers x "
                f"{per_layer / MiB:.2f} MiB + {fixed / MiB:.2f} MiB, {tokens_per_step} tokens) but "
                f"trace.memory_budget_mb={t.memory_budget_mb:g}. Fix one of: {fix_layers}, "
                f"trace.memory_budget_mb={math.ceil(needed / MiB)}, or trace.spill_dir=/path/on/local/disk")
        tier = "disk"
        free = free_bytes(t.spill_dir)
        if free is not None and free < needed:
            raise TraceBudgetError(f"TRACE cache spills {needed / MiB:.1f} MiB per step to trace.spill_dir="
                                   f"{t.spill_dir} which has {free / MiB:.1f} MiB free; free space, point "
                                   f"spill_dir elsewhere or set trace.num_cached_layers={fit}")
    return TracePlan(tokens_per_step, n_layers, per_layer, fixed, needed, budget, fit, tier)


class TraceStore:
    """Named caches held as host buffers within a byte budget, spilling to disk beyond it."""

    def __init__(self, memory_budget_mb: float, spill_dir: Optional[str] = None,
                 pin_memory: Optional[bool] = None):
        self.budget = int(memory_budget_mb * MiB)
        self.spill_dir = Path(spill_dir) if spill_dir else None
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._host: dict[str, torch.Tensor] = {}
        self._disk: dict[str, Path] = {}

    @classmethod
    def from_config(cls, cfg) -> "TraceStore":
        return cls(cfg.trace.memory_budget_mb, cfg.trace.spill_dir)

    @property
    def host_bytes(self) -> int:
        return sum(b.numel() for b in self._host.values())

    @property
    def disk_bytes(self) -> int:
        return sum(p.stat().st_size for p in self._disk.values())

    def __contains__(self, name: str) -> bool:
        return name in self._host or name in self._disk

    def names(self) -> list[str]:
        return sorted(set(self._host) | set(self._disk))

    def tier(self, name: str) -> str:
        return "host" if name in self._host else "disk" if name in self._disk else "absent"

    def put(self, name: str, cache: TraceCache) -> str:
        """Offload a cache (from any device) under `name`; returns the tier it landed in."""
        self.drop(name)
        size = cache.nbytes
        if self.host_bytes + size <= self.budget:
            self._host[name] = to_bytes(cache, pin_memory=self.pin_memory)
            return "host"
        if self.spill_dir is None:
            raise TraceBudgetError(
                f"TRACE store: cache '{name}' ({size / MiB:.1f} MiB) does not fit the host budget "
                f"trace.memory_budget_mb={self.budget / MiB:g} ({self.host_bytes / MiB:.1f} MiB held); set "
                "trace.spill_dir, raise trace.memory_budget_mb or lower trace.num_cached_layers")
        self.spill_dir.mkdir(parents=True, exist_ok=True)
        path = self.spill_dir / f"{_safe(name)}.qrltrace"
        blob = to_bytes(cache)
        fd, tmp = tempfile.mkstemp(dir=self.spill_dir, suffix=".partial")
        with os.fdopen(fd, "wb") as f:
            f.write(memoryview(blob.numpy()))
        os.replace(tmp, path)
        self._disk[name] = path
        return "disk"

    def get(self, name: str, device=None) -> TraceCache:
        """The cache (views into the host buffer, or read back and checksum-verified from disk)."""
        if name in self._host:
            cache = from_bytes(self._host[name], verify=False)
            cache.verified = True     # written by this process from a sealed cache
        elif name in self._disk:
            cache = from_bytes(torch.from_file(str(self._disk[name]), size=self._disk[name].stat().st_size,
                                               dtype=torch.uint8), verify=True)
        else:
            raise KeyError(f"TRACE store holds no cache named '{name}' (it has {self.names()})")
        return cache if device is None else cache.to(device)

    def pop(self, name: str, device=None) -> TraceCache:
        cache = self.get(name, device)
        if device is not None or name in self._disk:
            self.drop(name)
        else:
            self._host.pop(name)  # the views keep the buffer alive; the budget no longer counts it
        return cache

    def drop(self, name: str) -> None:
        self._host.pop(name, None)
        path = self._disk.pop(name, None)
        if path is not None:
            path.unlink(missing_ok=True)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
