"""Trainer-side lookup: the rollout's rounding record for exactly the rows a quantizer sees.

Row order is the caller's: the trainer passes, for the tensor its quantizer will see at a site, the
(sample id, position) of every row in that tensor's row order, and gets back a guide whose row r is the
rollout's record for that token. Two helpers produce the orders Megatron uses:
- `sequence_major_rows`: dense/attention sites see [s, b, K] activations flattened seq-major
  (row = s_idx * b + b_idx), the local sequence shard under sequence parallelism;
- `routed_rows`: a local expert sees the tokens routed to it in ascending flattened-token order (the
  permutation of Megatron's token dispatcher, one source rank). Under EP>1 the alltoall dispatcher
  concatenates the sources in EP-rank order: call `routed_rows` per source and concatenate.
Rows the cache does not hold (the last sampled token is never forwarded by the engine; padding; a
sample another rank owns) come back with found=False; `complete_with_nearest` fills them with the
trainer's own nearest encoding so they round exactly as unguided QAT would, never misaligned.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megatron_qrl.quant import GuidedRounding
from megatron_qrl.quant.nvfp4 import nvfp4_block_scales, nvfp4_global_scale, nvfp4_quantize

from .cache import BLOCK, EntryKey, TraceCache
from .errors import MisshapenCacheError, TraceLookupError


@dataclass
class TraceGuide(GuidedRounding):
    """A GuidedRounding for a trainer tensor, plus where each row's record came from.

    global_scale is 0-dim when every row shares one (then `fake_quant(x, guide=g)` replays it), fp32
    [rows, 1] when rows come from several engine calls (use replay.guided_fake_quant, or a codec that
    broadcasts per-row scales), and None while some rows are missing: `complete_with_nearest(x)` first.
    """

    found: Optional[torch.Tensor] = None          # bool [rows]: the cache held this row
    row_global_scales: Optional[torch.Tensor] = None  # fp32 [rows] (0 where not found)
    # after complete_with_nearest every row is "found"; this keeps which rows the cache held (metrics count those)
    cached_rows: Optional[torch.Tensor] = None

    @property
    def all_found(self) -> bool:
        return self.found is None or bool(self.found.all())

    @property
    def num_found(self) -> int:
        return int(self.found.sum()) if self.found is not None else self.bits.shape[0]

    def to(self, device) -> "TraceGuide":
        mv = (lambda t: None if t is None else t.to(device))
        return TraceGuide(mv(self.bits), mv(self.scales), mv(self.global_scale), mv(self.found),
                          mv(self.row_global_scales), mv(self.cached_rows))

    def reshape_rows(self, *row_shape: int) -> "TraceGuide":
        """Rows laid out as row_shape (e.g. [s, b] for a [s, b, K] activation)."""
        gs = self.global_scale
        if gs is not None and gs.dim() > 0:
            gs = gs.reshape(*row_shape, 1)
        cached = self.cached_rows.reshape(row_shape) if self.cached_rows is not None else None
        return TraceGuide(self.bits.reshape(*row_shape, -1), self.scales.reshape(*row_shape, -1), gs,
                          self.found.reshape(row_shape), self.row_global_scales.reshape(row_shape), cached)

    def complete_with_nearest(self, x: torch.Tensor) -> "TraceGuide":
        """Fill rows the cache lacks with x's own nearest encoding (global scale from all of x, local:
        unlike unguided QAT it is not reduced over a TP group; these rows carry no rollout record)."""
        if self.all_found:
            return self if self.global_scale is not None else _assemble(
                self.bits, self.scales, self.row_global_scales, self.found)
        x2 = x.detach().reshape(-1, x.shape[-1])
        miss = torch.nonzero(~self.found.reshape(-1)).reshape(-1).to(x.device)
        gs_own = nvfp4_global_scale(x2)
        x_miss = x2.index_select(0, miss)
        scales = nvfp4_block_scales(x_miss, gs_own)
        _, _, _, bits = nvfp4_quantize(x_miss, gs_own, "nearest", scales=scales, capture=True)
        out_bits = self.bits.reshape(x2.shape[0], -1).index_copy(0, miss, bits)
        out_scales = self.scales.reshape(x2.shape[0], -1).view(torch.uint8)
        out_scales = out_scales.index_copy(0, miss, scales.view(torch.uint8))
        row_gs = self.row_global_scales.reshape(-1).to(x.device).index_fill(0, miss, float(gs_own))
        found = torch.ones_like(self.found).reshape(-1)
        guide = _assemble(out_bits, out_scales.view(torch.float8_e4m3fn), row_gs, found)
        guide.cached_rows = self.found.reshape(-1)
        return guide.reshape_rows(*x.shape[:-1])


def _assemble(bits, scales, row_gs, found) -> TraceGuide:
    if not bool(found.all()):
        gs = None      # incomplete: replaying it would divide by the zeros of missing rows
    elif row_gs.numel() > 0 and bool((row_gs == row_gs[0]).all()):
        gs = row_gs[0].clone()
    else:
        gs = row_gs.reshape(-1, 1)
    return TraceGuide(bits, scales, gs, found, row_gs)


def lookup(cache: TraceCache, key: EntryKey, samples, positions,
           k_range: Optional[tuple[int, int]] = None) -> TraceGuide:
    """The rollout's record for rows (samples[r], positions[r]) of site `key`, in that row order.

    k_range=(k0, k1) selects full-K columns (a row-parallel shard: k0 = tp_rank * K/tp); default: all
    columns the entry stores. Raises TraceLookupError for an unknown key or columns outside the entry.
    """
    entry = cache.entry(key)
    samples = torch.as_tensor(samples, dtype=torch.int64).reshape(-1)
    positions = torch.as_tensor(positions, dtype=torch.int64).reshape(-1)
    if samples.numel() != positions.numel() and samples.numel() != 1:
        raise MisshapenCacheError(f"lookup got {samples.numel()} sample ids for {positions.numel()} positions")
    token = cache.token_index(samples, positions)
    row_of = cache.row_of_token(entry.rowset)
    row = torch.where(token >= 0, row_of[token.clamp(min=0)] if row_of.numel() else token, token)
    found = row >= 0
    dev = entry.bits.device
    if entry.rows == 0:
        bits = torch.zeros(row.numel(), entry.k_width // 8, dtype=torch.uint8, device=dev)
        scales = torch.zeros(row.numel(), entry.k_width // BLOCK, dtype=torch.uint8, device=dev)
        row_gs = torch.zeros(row.numel(), device=dev)
    else:
        take = row.clamp(min=0).to(dev)
        bits, scales = entry.bits.index_select(0, take), entry.scales.index_select(0, take)
        row_gs = entry.row_global_scales().index_select(0, take)
        if not bool(found.all()):
            miss = (~found).to(dev)
            bits.masked_fill_(miss.unsqueeze(-1), 0)
            scales.masked_fill_(miss.unsqueeze(-1), 0)
            row_gs.masked_fill_(miss, 0.0)
    if k_range is not None:
        k0, k1 = k_range
        stop = entry.k_start + entry.k_width
        if k0 % BLOCK or k1 % BLOCK or not entry.k_start <= k0 < k1 <= stop:
            raise TraceLookupError(f"{key.site_name}: columns [{k0}, {k1}) are not on {BLOCK}-element blocks "
                                   f"inside the stored [{entry.k_start}, {stop}) of K={entry.k_full}")
        a, b = k0 - entry.k_start, k1 - entry.k_start
        bits, scales = bits[:, a // 8:b // 8], scales[:, a // BLOCK:b // BLOCK]
    return _assemble(bits.contiguous(), scales.contiguous().view(torch.float8_e4m3fn), row_gs, found.to(dev))


def sequence_major_rows(sample_ids, seq_len: int, seq_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(samples, positions) of a [seq_len, b] activation flattened seq-major (Megatron's [s, b, h]).

    seq_offset: first position of this rank's sequence shard (sequence parallelism: tp_rank * seq_len).
    """
    sample_ids = torch.as_tensor(sample_ids, dtype=torch.int64).reshape(-1)
    pos = torch.arange(seq_offset, seq_offset + seq_len, dtype=torch.int64)
    samples = sample_ids.repeat(seq_len)
    positions = pos.repeat_interleave(sample_ids.numel())
    return samples, positions


def routed_rows(samples: torch.Tensor, positions: torch.Tensor, topk_ids: torch.Tensor,
                expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows an expert sees: tokens t (ascending) with expert in topk_ids[t]; samples/positions/topk_ids
    are per token in the router's order ([s, b] flattened, e.g. from sequence_major_rows)."""
    hit = (torch.as_tensor(topk_ids).reshape(samples.numel(), -1) == expert).any(-1)
    return samples[hit], positions[hit]


RowsFn = Callable[[object, torch.Tensor], Optional[tuple[torch.Tensor, torch.Tensor]]]


class GuideProvider:
    """provider(site, x) for megatron_qrl.models.set_guide_provider: the rollout's guide or None.

    rows_for(site, x) returns the (samples, positions) of x's rows in x's row order (or None: no guide).
    Returns None (nearest rounding, counted in metrics) when the site is not cached, no row is found
    or the row count disagrees with x; rows missing from the cache get x's nearest encoding.
    """

    def __init__(self, cache: TraceCache, rows_for: RowsFn, metrics=None):
        self.cache, self.rows_for, self.metrics = cache, rows_for, metrics

    def __call__(self, site, x: torch.Tensor) -> Optional[GuidedRounding]:
        key = EntryKey.from_site(site)
        if key not in self.cache:
            return None
        rows = self.rows_for(site, x)
        if rows is None:
            return None
        samples, positions = rows
        n_rows = x[..., 0].numel()
        if positions.numel() != n_rows:
            if self.metrics is not None:
                self.metrics.count("misaligned_sites")
            return None
        k0 = int(getattr(site, "k_offset", 0) or 0)
        try:
            guide = lookup(self.cache, key, samples, positions, (k0, k0 + x.shape[-1]))
        except TraceLookupError:
            if self.metrics is not None:
                self.metrics.count("misaligned_sites")
            return None
        if self.metrics is not None:
            self.metrics.count("guided_rows", guide.num_found)
            self.metrics.count("missing_rows", n_rows - guide.num_found)
        if guide.num_found == 0:
            return None
        return guide.to(x.device).reshape_rows(*x.shape[:-1]).complete_with_nearest(x)


@dataclass(frozen=True)
class ExpertSources:
    """Where a local expert's tokens come from under expert parallelism (tensor parallel size 1).

    Megatron's alltoall dispatcher hands each local expert the tokens routed to it from every rank of the
    expert-parallel group, source by source in EP-rank order (ascending token order within a source).
    Those ranks are data-parallel ranks running the same micro-batch index at the same time, so the
    sample ids of every source follow from this rank's padded batch rows (trainer.batch.shard).
    """

    num_samples: int                       # B, before padding
    rows_per_rank: int                     # padded rows per data-parallel rank
    dp_rank: int
    group_dp_ranks: tuple[int, ...]        # DP ranks of this rank's EP group, in EP-rank order

    def sample_ids(self, batch_rows: torch.Tensor) -> list[torch.Tensor]:
        """Per source, the sample ids (-1: padding) of the micro-batch it runs beside batch_rows."""
        local = torch.as_tensor(batch_rows, dtype=torch.int64).reshape(-1).cpu() - self.dp_rank * self.rows_per_rank
        out = []
        for d in self.group_dp_ranks:
            rows = local + d * self.rows_per_rank
            out.append(torch.where(rows < self.num_samples, rows, torch.full_like(rows, -1)))
        return out


class GuideLayout:
    """What a guide hook knows of the trainer's batch and layout (shared by MicroBatchGuides and the device
    hook, device_guides.BatchGuides): the cache, T (padded as the trainer pads it), the R3 ids padded to T,
    the TP rank and size, sequence parallelism, metrics and, under expert parallelism, the EP sources."""

    def __init__(self, cache: TraceCache, seq_len: int, r3_expert_ids: Optional[torch.Tensor] = None,
                 tp_rank: int = 0, tp_size: int = 1, sequence_parallel: bool = False, metrics=None,
                 expert_sources: Optional[ExpertSources] = None):
        if expert_sources is not None and tp_size > 1:
            raise ValueError("TRACE under expert parallelism with tensor_parallel > 1 is not implemented "
                             "(each source rank holds a sequence shard); use tensor_parallel=1")
        self.cache, self.seq_len, self.metrics = cache, int(seq_len), metrics
        self.tp_rank, self.tp_size, self.sp = tp_rank, tp_size, sequence_parallel and tp_size > 1
        self.expert_sources = expert_sources
        ids = r3_expert_ids
        if ids is not None and ids.shape[1] < self.seq_len:   # trainer pads T by repeating the last ids
            ids = torch.cat([ids, ids[:, -1:].expand(-1, self.seq_len - ids.shape[1], -1, -1)], dim=1)
        self.r3 = ids


class MicroBatchGuides(GuideLayout):
    """A guide hook (trace.TraceReplay serves it): (sample_ids, batch_rows) [mb] -> GuideProvider.

    Rows follow Megatron: activations [s, b, K] flattened seq-major; under sequence parallelism
    column-parallel inputs are this rank's sequence shard (row-parallel inputs hold the full sequence);
    a routed expert sees the tokens of this rank's shard routed to it, ascending, and under expert
    parallelism (`expert_sources`) those of every rank of its EP group, concatenated in EP-rank order.
    r3_expert_ids: the batch's long [B, T, num_layers, k] (R3 ids, global layer index); padding samples
    (id -1) reuse sample 0's ids, as trainer.batch pads them, and are never found in the cache.
    """

    def __call__(self, sample_ids: torch.Tensor, batch_rows: Optional[torch.Tensor] = None) -> GuideProvider:
        sample_ids = torch.as_tensor(sample_ids, dtype=torch.int64).reshape(-1).cpu()
        if self.expert_sources is not None:
            if batch_rows is None:
                raise ValueError("TRACE under expert parallelism needs the micro-batch's batch_rows")
            sources = self.expert_sources.sample_ids(batch_rows)
        else:
            sources = [sample_ids]
        return GuideProvider(self.cache, lambda site, x: self.rows_for(sample_ids, site, x, sources), self.metrics)

    def _shard(self, s_local: int) -> Optional[int]:
        if s_local == self.seq_len:
            return 0
        if self.sp and s_local * self.tp_size == self.seq_len:
            return self.tp_rank * s_local
        return None

    def rows_for(self, sample_ids: torch.Tensor, site, x: torch.Tensor, sources: Optional[list] = None):
        b = sample_ids.numel()
        if site.expert is None:
            if x.dim() != 3 or x.shape[1] != b or self._shard(x.shape[0]) is None:
                return None
            return sequence_major_rows(sample_ids, x.shape[0], self._shard(x.shape[0]))
        if self.r3 is None:
            return None
        s_local = self.seq_len // self.tp_size if self.sp else self.seq_len
        offset = self.tp_rank * s_local if self.sp else 0
        samples, positions = [], []
        for src in (sources if sources is not None else [sample_ids]):
            ids = self.r3[src.clamp(min=0), offset:offset + s_local, site.layer]   # [b, s, k]
            rows = sequence_major_rows(src, s_local, offset)
            s, p = routed_rows(*rows, ids.transpose(0, 1).reshape(s_local * src.numel(), -1).cpu(), site.expert)
            samples.append(s)
            positions.append(p)
        if len(samples) == 1:
            return samples[0], positions[0]
        return torch.cat(samples), torch.cat(positions)
