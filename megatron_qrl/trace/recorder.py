"""The engine's TRACE port: it records the cached layers' FP4 rounding and seals it into compact caches.

Each embedded engine owns one `TraceRecorder` (`EmbeddedEngine.trace_recorder`):
- `recording()` owns the capture sink: during one forward, the FP4 linears of the cached sites append
  their CaptureRecords to the list it yields (the engine scatters them per sample, rollout/capture.py);
- `keep(samples, first_index)` (end of every generate call) keeps each sample's captures under its handle,
  `RolloutSample.trace_handle` = its global sample index. The samples travel without captures
  (`without_captures`): a handle is all that leaves the engine;
- `seal(handles, step)` builds the sealed cache of the batch: batch position i holds the sample whose handle
  is handles[i] (samples this engine did not generate are skipped). trace.exchange then hands every
  trainer rank its part, in colocated and disaggregated runs alike.
Records belong to one weight version: installing new weights (`reset`) and every seal drop them.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterable, Optional, Sequence

import torch

from .builder import TraceCacheBuilder
from .cache import TraceCache
from .integrity import config_fingerprint


def traced_sites(model: torch.nn.Module, layers: Iterable[int]) -> set[str]:
    """Names of the activation-quantized sites of `layers` (routed experts, plus dense sites under
    quant.targets=all_linears): what the engine captures for TRACE."""
    from megatron_qrl.models import fp4_linears

    layers = set(layers)
    return {lin.site.name for lin in fp4_linears(model)
            if lin.quant.enabled and lin.quant.activations and lin.site.layer in layers}


def seal_rollouts(cfg, rollouts: Sequence, step: int, version: int, first_index: int = 0) -> TraceCache:
    """The sealed cache of `rollouts` (their `trace` captures), sample ids first_index.., for `cfg`'s
    cached layers and fingerprint."""
    builder = TraceCacheBuilder(version, step, config_fingerprint(cfg), layers=cfg.cached_layers())
    builder.add_samples(range(first_index, first_index + len(rollouts)), [r.trace for r in rollouts],
                        [r.routed_experts for r in rollouts])
    return builder.build()


def without_captures(rollouts: Sequence) -> list:
    """The samples as they travel to the trainer: handle and R3 ids, no TRACE captures."""
    return [dataclasses.replace(r, trace={}) if r.trace else r for r in rollouts]


@dataclasses.dataclass
class _Kept:
    trace: dict
    routed_experts: Optional[torch.Tensor]


class TraceRecorder:
    """One engine's TRACE records (module docstring). `layers`: the cached layers the engine captures
    (empty: TRACE off, the recorder records and keeps nothing)."""

    def __init__(self, cfg, model: torch.nn.Module, layers: Iterable[int]):
        self.cfg = cfg
        self.layers = list(layers)
        self.sites = traced_sites(model, self.layers)
        self.model = model
        self.version = -1
        self._kept: dict[int, _Kept] = {}

    @property
    def enabled(self) -> bool:
        return bool(self.layers)

    @contextlib.contextmanager
    def recording(self):
        """Yields the list the cached sites' FP4 linears append CaptureRecords to during the block."""
        if not self.sites:
            yield []
            return
        from megatron_qrl.models import capture_activations

        with capture_activations(self.model, self.sites) as records:
            yield records

    def reset(self, version: int) -> None:
        """New weights installed: records of the old ones are dropped; new caches carry `version`."""
        self.clear()
        self.version = version

    def clear(self) -> None:
        """Drop every kept record (what each seal does): the (device) memory they hold goes back to the
        allocator (a benchmark that never seals calls this between calls, as the loop's per-step seal does)."""
        self._kept.clear()

    def keep(self, samples: list, first_index: int) -> list:
        """Give samples i = 0.. the handle first_index + i and keep their captures; returns the samples."""
        for i, s in enumerate(samples):
            s.trace_handle = first_index + i
            if self.enabled:
                self._kept[s.trace_handle] = _Kept(s.trace, s.routed_experts)
        return samples

    def seal(self, handles: Iterable[int], step: int, first_position: int = 0) -> TraceCache:
        """The sealed cache of the batch whose position first_position + i holds the sample with handle
        handles[i] (those kept here; the others come from other engines); then drops every record."""
        builder = TraceCacheBuilder(self.version, step, config_fingerprint(self.cfg), layers=self.cfg.cached_layers())
        mine = [(position, self._kept[int(h)]) for position, h in enumerate(handles, start=first_position)
                if int(h) in self._kept]
        builder.add_samples([p for p, _ in mine], [k.trace for _, k in mine], [k.routed_experts for _, k in mine])
        self.clear()
        return builder.build()

    def __len__(self) -> int:
        return len(self._kept)
