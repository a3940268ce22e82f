"""A TRACE cache from the trainer's own W4A4 forward: a realistic guide without a rollout engine.

For tests and benchmarks of the trainer-side replay (tools/bench_trainer.py, tests/dist/grouped_experts.py):
the trainer runs `logprobs` on the batch one micro-batch at a time with activation capture on (the FP4
linears' capture sinks: the per-expert reference path records every expert site), and every record's rows
are mapped to (sample, position) with the host reference's row rules (lookup.MicroBatchGuides.rows_for),
so the cache holds exactly what an engine with the same forward would have captured. Replaying it
reproduces the trainer's own rounding: code mismatch after guidance 0 up to the differences between the
capture path and the replaying path (e.g. grouped vs per-expert GEMMs in bf16).
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Iterable, Optional

import torch

from .builder import TraceCacheBuilder
from .cache import EntryKey, TraceCache
from .lookup import MicroBatchGuides


def capture_cache(trainer, batch: dict, layers: Optional[Iterable[int]] = None, version: int = 0, step: int = 0,
                  fingerprint: str = "") -> TraceCache:
    """The sealed cache of `trainer`'s own quantized activations on `batch` (tokens, r3_expert_ids; one
    data-parallel rank, no sequence parallelism), restricted to `layers` (default: all)."""
    from megatron_qrl.models import capture_activations

    tokens = batch["tokens"]
    B, T = tokens.shape
    mb = trainer.cfg.trainer.micro_batch_size
    keep = None if layers is None else {int(x) for x in layers}
    builder = TraceCacheBuilder(version, step, fingerprint, layers=keep)
    for s0 in range(0, B, mb):
        sub = {k: (v[s0:s0 + mb] if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == B else v)
               for k, v in batch.items()}
        ids = sub.get("r3_expert_ids")
        rows = MicroBatchGuides(None, T, ids)
        n = sub["tokens"].shape[0]
        local = torch.where(torch.arange(mb) < n, torch.arange(mb), -1)   # the trainer pads to mb rows (id -1)
        with capture_activations(trainer.unwrapped) as records:
            trainer.logprobs(sub)
        for rec in records:
            key = EntryKey.from_site_name(rec.site)
            if keep is not None and key.layer not in keep:
                continue
            site = SimpleNamespace(layer=key.layer, expert=key.expert if key.routed else None)
            shape = (*rec.bits.shape[:-1], rec.bits.shape[-1] * 8)
            found = rows.rows_for(local, site, torch.empty(shape, device="meta"))
            if found is None:
                continue
            samples, positions = found
            real = torch.nonzero(samples >= 0).reshape(-1)                     # padding rows are never cached
            at = real.to(rec.bits.device)
            builder.add_rows(key.layer, key.site, key.expert, samples[real] + s0, positions[real],
                             rec.bits.reshape(-1, rec.bits.shape[-1]).index_select(0, at),
                             rec.scales.reshape(-1, rec.scales.shape[-1]).index_select(0, at), rec.global_scale)
    return builder.build()
