"""TRACE guides on the device: index tensors built once per batch, guide rows gathered per call.

The host reference (trace/lookup.py: MicroBatchGuides -> GuideProvider -> lookup) finds the rollout's rows
for every (micro-batch, layer, expert, role) on the host when the quantizer asks, and completes and
measures them with several host reads each. Here the same rows are found once per batch, on the trainer's
device, for all micro-batches:
- the cache's rows of one (role, routed or dense) are stacked over all its layers and experts into one
  device table (bits, E4M3 scale bytes, per-row global scale; plus one zero row for "not in the cache"),
  keyed by (layer, expert, token) in ascending order;
- `prepare(micro_batches)` computes, with R3's expert ids, every micro-batch's rows in the order the
  quantizers see them (dense: [s, b] seq-major; routed: Megatron's permuted order, local expert by local
  expert, EP sources in EP-rank order, ascending tokens) and their table rows, by sorting and searchsorted
  on the device; one host read per batch fetches the per-slice row and missing counts;
- a micro-batch's provider (`__call__` per linear, `for_experts` for a grouped expert call) only slices the
  prepared index and gathers the table rows: three index_selects, no host synchronisation. The rows come as
  `GuidedRows`, which trace/replay.replay_rows replays (rows the cache lacks round to nearest) while
  counting code mismatches on the device when `measuring`.
Rows, their order and their contents are exactly the host reference's (tests/test_device_guides.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from megatron_qrl.quant import GuidedRounding

from .cache import BLOCK, EntryKey, TraceCache, token_keys
from .errors import MisshapenCacheError
from .lookup import ExpertSources, GuideLayout


@dataclass
class GuidedRows(GuidedRounding):
    """The rollout's records of a tensor's rows, gathered on the device.

    bits uint8 [rows, K/8], scales float8_e4m3fn [rows, K/16], global_scale fp32 [rows, 1] (0 where the
    cache lacks the row); found bool [rows] (None when every row was found); any_missing / n_found are host
    values (from the per-batch read); counters: a TraceMetrics that receives the device mismatch counts.
    """

    found: Optional[torch.Tensor] = None
    any_missing: bool = False
    n_found: int = 0
    counters: Optional[object] = None

    @property
    def device_rows(self) -> bool:
        return True


@dataclass
class _Table:
    """One (role, routed/dense) of the cache on the device: rows of every entry, one zero row at the end."""

    keys: torch.Tensor        # int64 [R] ascending: (layer * (E + 1) + expert + 1) * n_tokens + token
    bits: torch.Tensor        # uint8 [R + 1, Kw / 8]
    scales: torch.Tensor      # uint8 [R + 1, Kw / 16]
    gs: torch.Tensor          # fp32 [R + 1]
    k_start: int
    k_width: int
    sliced: dict = field(default_factory=dict)

    @property
    def missing_row(self) -> int:
        return int(self.keys.numel())

    def columns(self, k0: int, k1: int) -> Optional[tuple]:
        """(bits, scales) restricted to full-K columns [k0, k1), or None when they are not all stored."""
        if k0 % BLOCK or k1 % BLOCK or not self.k_start <= k0 < k1 <= self.k_start + self.k_width:
            return None
        if (k0, k1) not in self.sliced:
            a, b = k0 - self.k_start, k1 - self.k_start
            if (a, b) == (0, self.k_width):
                self.sliced[(k0, k1)] = (self.bits, self.scales)
            else:
                self.sliced[(k0, k1)] = (self.bits[:, a // 8:b // 8].contiguous(),
                                         self.scales[:, a // BLOCK:b // BLOCK].contiguous())
        return self.sliced[(k0, k1)]


@dataclass
class _Slice:
    """Rows of one quantizer call inside a prepared index: idx[start:stop], with host counts."""

    start: int
    stop: int
    missing: int


@dataclass
class _Prepared:
    micro_batch_size: int
    idx: dict             # table name -> int64 [N] device (rows of the table; shared by the batch's micro-batches)
    found: dict           # table name -> bool [N] device
    slices: dict          # (table name, layer, local expert or None, variant) -> _Slice


def _row_global_scales(entries: list) -> torch.Tensor:
    """fp32 [sum of rows]: TraceEntry.row_global_scales() of every entry, concatenated -- unpacked for all
    entries at once where they live (a few launches instead of a few per entry, no host read)."""
    from megatron_qrl.quant import unpack_bits

    dev = entries[0].bits.device
    as_dev = lambda values: torch.tensor(values, dtype=torch.int64).to(dev)  # noqa: E731
    rows = as_dev([e.rows for e in entries])
    widths = as_dev([e.index_width for e in entries])
    n_bytes = as_dev([e.gs_index.numel() for e in entries])
    n_table = as_dev([e.gs_table.numel() for e in entries])
    total = sum(e.rows for e in entries)
    wmax = max(e.index_width for e in entries)
    entry = torch.repeat_interleave(torch.arange(len(entries), device=dev), rows, output_size=total)
    local = torch.arange(total, device=dev) - (torch.cumsum(rows, 0) - rows).index_select(0, entry)
    idx = torch.zeros(total, dtype=torch.int64, device=dev)
    if wmax:
        bits = unpack_bits(torch.cat([e.gs_index.reshape(-1).to(dev) for e in entries])).to(torch.int64)
        j = torch.arange(wmax, device=dev)
        w = widths.index_select(0, entry)[:, None]
        first_bit = 8 * (torch.cumsum(n_bytes, 0) - n_bytes).index_select(0, entry)[:, None]
        valid = j[None, :] < w
        pos = torch.where(valid, first_bit + local[:, None] * w + j[None, :], torch.zeros_like(w))
        idx = ((bits.index_select(0, pos.reshape(-1)).reshape(total, wmax) * valid) << j).sum(-1)
    tables = torch.cat([e.gs_table.to(dev) for e in entries])
    return tables.index_select(0, (torch.cumsum(n_table, 0) - n_table).index_select(0, entry) + idx)


def _stack_tables(cache: TraceCache, device, n_experts: int) -> dict:
    """{(role, routed): _Table} over all entries of the cache."""
    n_tokens = max(1, cache.n_tokens)
    # the token indices of every row set at once (cache.rowset_tokens one by one is a host pass per set)
    from megatron_qrl.quant import unpack_bits

    masks = unpack_bits(cache.rowsets.cpu())[:, :cache.n_tokens].bool() if cache.rowsets.numel() else None
    if masks is not None:
        rowset_tok = torch.nonzero(masks)[:, 1]
        rowset_len = masks.sum(1).tolist()
        rowset_start = [0]
        for n in rowset_len[:-1]:
            rowset_start.append(rowset_start[-1] + n)
    groups: dict = {}
    for key in cache.keys():
        groups.setdefault((key.site, key.routed), []).append(key)
    tables = {}
    for name, keys in groups.items():
        entries = [cache.entry(k) for k in keys]
        geometry = {(e.k_start, e.k_width) for e in entries}
        if len(geometry) != 1:
            raise MisshapenCacheError(f"TRACE entries of site '{name[0]}' hold different column ranges "
                                      f"{sorted(geometry)}; the device guides need one per site")
        k_start, k_width = geometry.pop()
        row_keys = []
        for k, e in zip(keys, entries):
            tok = rowset_tok[rowset_start[e.rowset]:rowset_start[e.rowset] + rowset_len[e.rowset]]
            row_keys.append((k.layer * (n_experts + 1) + k.expert + 1) * n_tokens + tok)
        src = entries[0].bits.device            # stack where the cache lives, then one copy to `device`
        kw8, kw16 = k_width // 8, k_width // BLOCK
        bits = torch.cat([e.bits for e in entries] + [torch.zeros(1, kw8, dtype=torch.uint8, device=src)])
        scales = torch.cat([e.scales for e in entries] + [torch.zeros(1, kw16, dtype=torch.uint8, device=src)])
        gs = torch.cat([_row_global_scales(entries), torch.zeros(1, device=src)])
        tables[name] = _Table(torch.cat(row_keys).to(device), bits.to(device), scales.to(device), gs.to(device),
                              k_start, k_width)
    return tables


class BatchGuides(GuideLayout):
    """The trainer's guide hook (trace.TraceReplay serves it) for one batch, on `device`.

    The same constructor arguments and row conventions as lookup.MicroBatchGuides (its host reference), plus
    local_experts = (first global expert, number of local experts) of this rank and the model's
    num_experts. Call `prepare` with every micro-batch's (sample_ids, batch_rows) before the passes (the
    trainer does); `measuring` (on at first) makes replays count code mismatches into `metrics`.
    """

    def __init__(self, cache: TraceCache, seq_len: int, r3_expert_ids: Optional[torch.Tensor] = None,
                 tp_rank: int = 0, tp_size: int = 1, sequence_parallel: bool = False, metrics=None,
                 expert_sources: Optional[ExpertSources] = None, local_experts: tuple[int, int] = (0, 0),
                 num_experts: int = 0, device=None):
        super().__init__(cache, seq_len, r3_expert_ids, tp_rank, tp_size, sequence_parallel, metrics, expert_sources)
        self.first_expert, self.n_local = int(local_experts[0]), int(local_experts[1])
        self.device = torch.device(device) if device is not None else cache.device
        self.n_experts = max(int(num_experts), 1 + max([k.expert for k in cache.keys()] + [0]))
        self.tables = _stack_tables(cache, self.device, self.n_experts)
        self.token_table = token_keys(*cache.tokens()).to(self.device)
        self.r3 = self.r3.to(self.device, torch.int64) if self.r3 is not None else None
        self.measuring = True
        self._prepared: dict[int, _Prepared] = {}      # first batch row of a micro-batch -> its index
        self._mb_of: dict[int, int] = {}

    # ------------------------------------------------------------------ per batch
    def _sources(self, sample_ids: torch.Tensor, batch_rows) -> list[torch.Tensor]:
        if self.expert_sources is None:
            return [sample_ids]
        if batch_rows is None:
            raise ValueError("TRACE under expert parallelism needs the micro-batch's batch_rows")
        return self.expert_sources.sample_ids(batch_rows)

    def _token_index(self, samples: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q = token_keys(samples, positions)
        table = self.token_table
        if table.numel() == 0:
            return torch.full_like(q, -1)
        at = torch.searchsorted(table, q).clamp(max=table.numel() - 1)
        return torch.where((table[at] == q) & (q >= 0), at, torch.full_like(at, -1))

    def _rows(self, name, layers: torch.Tensor, experts: torch.Tensor, tokens: torch.Tensor):
        """(table rows, found) of (layer, expert or -1, token index) triples in table `name`."""
        t = self.tables[name]
        n_tokens = max(1, self.cache.n_tokens)
        q = (layers * (self.n_experts + 1) + experts + 1) * n_tokens + tokens
        if t.keys.numel() == 0:
            return torch.full_like(q, t.missing_row), torch.zeros_like(q, dtype=torch.bool)
        at = torch.searchsorted(t.keys, q).clamp(max=t.keys.numel() - 1)
        found = (tokens >= 0) & (t.keys[at] == q)
        return torch.where(found, at, torch.full_like(at, t.missing_row)), found

    def prepare(self, micro_batches: Sequence[tuple]) -> None:
        """Index every micro-batch's rows: micro_batches = [(sample_ids [mb], batch_rows [mb]), ...]."""
        dev = self.device
        todo = [(sid, rows) for sid, rows in micro_batches if int(torch.as_tensor(rows).reshape(-1)[0]) not in
                self._prepared]
        if not todo:
            return
        sample_ids = [torch.as_tensor(s, dtype=torch.int64).reshape(-1).cpu() for s, _ in todo]
        srcs = torch.stack([torch.stack(self._sources(s, r)) for s, (_, r) in zip(sample_ids, todo)])  # [M, S, b]
        srcs = srcs.to(dev)
        own = torch.stack(sample_ids).to(dev)                                                     # [M, b]
        M = srcs.shape[0]
        pieces, reads = {}, []       # table name -> (idx, found, counts, slice labels); host counts to read
        for name in self.tables:
            pieces[name] = self._routed_index(name, srcs) if name[1] else self._dense_index(name, own)
            reads.append(pieces[name][2])
        counts = torch.cat(reads).tolist() if reads else []      # the batch's one host read
        at = 0
        prepared = [_Prepared(own.shape[1], {}, {}, {}) for _ in range(M)]
        for name in self.tables:
            idx, found, cnt, labels = pieces[name]
            n = len(labels)
            host = counts[at:at + 2 * n]
            at += 2 * n
            start = 0
            for (m, layer, expert, variant), rows, miss in zip(labels, host[:n], host[n:]):
                prepared[m].slices[(name, layer, expert, variant)] = _Slice(start, start + int(rows), int(miss))
                start += int(rows)
            for m in range(M):
                prepared[m].idx[name], prepared[m].found[name] = idx, found
        for (_, rows), p in zip(todo, prepared):
            self._prepared[int(torch.as_tensor(rows).reshape(-1)[0])] = p

    def _layers_of(self, name) -> list[int]:
        return sorted({k.layer for k in self.cache.keys() if (k.site, k.routed) == name})

    def _dense_index(self, name, sample_ids: torch.Tensor):
        """Dense sites: rows seq-major [s, b], the full sequence and (sequence parallel) this rank's shard."""
        dev = self.device
        layer_list = self._layers_of(name)
        layers = torch.tensor(layer_list, dtype=torch.int64, device=dev)
        variants = [("full", self.seq_len, 0)]
        if self.sp:
            s_local = self.seq_len // self.tp_size
            variants.append(("shard", s_local, self.tp_rank * s_local))
        M, b = sample_ids.shape
        idx_parts, found_parts, rows_n, miss_n, labels = [], [], [], [], []
        for variant, s_len, offset in variants:
            pos = torch.arange(offset, offset + s_len, device=dev)
            samples = sample_ids[:, None, :].expand(M, s_len, b)                    # [M, s, b] seq-major
            positions = pos[None, :, None].expand(M, s_len, b)
            tok = self._token_index(samples.reshape(-1), positions.reshape(-1)).reshape(M, 1, s_len * b)
            lay = layers[None, :, None].expand(M, layers.numel(), s_len * b)
            rows, found = self._rows(name, lay, torch.full_like(lay, -1), tok.expand_as(lay))
            idx_parts.append(rows.reshape(-1))
            found_parts.append(found.reshape(-1))
            rows_n.append(torch.full((M * layers.numel(),), s_len * b, dtype=torch.int64, device=dev))
            miss_n.append((~found).sum(-1).reshape(-1))
            labels += [(m, layer, None, variant) for m in range(M) for layer in layer_list]
        cnt = torch.cat([torch.cat(rows_n), torch.cat(miss_n)])
        return torch.cat(idx_parts), torch.cat(found_parts), cnt, labels

    def _routed_index(self, name, srcs: torch.Tensor):
        """Routed experts: every micro-batch's rows in Megatron's permuted order, per layer and local expert."""
        dev = self.device
        layer_list = self._layers_of(name)
        M, S, b = srcs.shape
        labels = [(m, layer, e, "experts") for m in range(M) for layer in layer_list for e in range(self.n_local)]
        if self.r3 is None or not layer_list or self.n_local == 0:
            empty = torch.zeros(0, dtype=torch.int64, device=dev)
            return empty, empty.bool(), torch.zeros(2 * len(labels), dtype=torch.int64, device=dev), labels
        L = len(layer_list)
        layers = torch.tensor(layer_list, dtype=torch.int64, device=dev)
        s_local = self.seq_len // self.tp_size if self.sp else self.seq_len
        offset = self.tp_rank * s_local if self.sp else 0
        ids = self.r3[srcs.clamp(min=0)][:, :, :, offset:offset + s_local]           # [M, S, b, s, Lall, k]
        ids = ids.index_select(4, layers)                                             # [M, S, b, s, L, k]
        k = ids.shape[-1]
        ids = ids.permute(0, 4, 1, 3, 2, 5)                                           # [M, L, S, s, b, k]
        ntok = s_local * b
        e_local = ids - self.first_expert
        local = (e_local >= 0) & (e_local < self.n_local)
        shape = ids.shape
        m_i = torch.arange(M, device=dev).view(M, 1, 1, 1, 1, 1).expand(shape)
        l_i = torch.arange(L, device=dev).view(1, L, 1, 1, 1, 1).expand(shape)
        s_i = torch.arange(S, device=dev).view(1, 1, S, 1, 1, 1).expand(shape)
        t_i = (torch.arange(s_local, device=dev).view(1, 1, 1, s_local, 1, 1) * b
               + torch.arange(b, device=dev).view(1, 1, 1, 1, b, 1)).expand(shape)
        group = (m_i * L + l_i) * self.n_local + e_local.clamp(0, max(self.n_local - 1, 0))
        big = M * L * self.n_local
        sort_key = torch.where(local, (group * S + s_i) * ntok + t_i, torch.full_like(group, big * S * ntok))
        order = torch.sort(sort_key.reshape(-1)).indices
        flat = lambda t: t.reshape(-1).index_select(0, order)  # noqa: E731
        group_s, valid = flat(group), flat(local)
        src_s, t_s, layer_s, expert_s = flat(s_i), flat(t_i), layers.index_select(0, flat(l_i)), flat(ids)
        m_s = flat(m_i)
        sample = srcs[m_s, src_s, t_s % b]
        position = offset + t_s // b
        tok = self._token_index(sample, position)
        rows, found = self._rows(name, layer_s, expert_s, tok)
        ones = valid.to(torch.int64)
        n_rows = torch.zeros(big, dtype=torch.int64, device=dev).index_add_(0, group_s, ones)
        n_miss = torch.zeros(big, dtype=torch.int64, device=dev).index_add_(0, group_s, ones * (~found).to(torch.int64))
        # invalid (non-local) pairs were sorted behind every valid one: the index keeps them, slices never reach them
        return rows, found, torch.cat([n_rows, n_miss]), labels

    # ------------------------------------------------------------------ per micro-batch
    def __call__(self, sample_ids, batch_rows=None) -> "MicroBatchGuide":
        rows = batch_rows if batch_rows is not None else sample_ids
        key = int(torch.as_tensor(rows).reshape(-1)[0])
        if key not in self._prepared:       # not prepared by the trainer: index this micro-batch alone
            self.prepare([(sample_ids, batch_rows if batch_rows is not None else sample_ids)])
        return MicroBatchGuide(self, self._prepared[key])


class MicroBatchGuide:
    """The guide provider of one micro-batch (models.fp4_linear.set_guide_provider)."""

    def __init__(self, batch: BatchGuides, prepared: _Prepared):
        self.batch, self.p = batch, prepared

    def _count(self, name: str, value: float = 1) -> None:
        if self.batch.metrics is not None:
            self.batch.metrics.count(name, value)

    def _gather(self, name, sl: _Slice, x: torch.Tensor, k0: int) -> Optional[GuidedRows]:
        n_rows = x[..., 0].numel()
        if sl.stop - sl.start != n_rows:
            self._count("misaligned_sites")
            return None
        table = self.batch.tables[name]
        cols = table.columns(k0, k0 + x.shape[-1])
        if cols is None:
            self._count("misaligned_sites")
            return None
        n_found = n_rows - sl.missing
        self._count("guided_rows", n_found)
        self._count("missing_rows", sl.missing)
        if n_found == 0:
            return None
        idx = self.p.idx[name][sl.start:sl.stop]
        bits, scales = cols
        found = self.p.found[name][sl.start:sl.stop] if sl.missing else None
        lead = tuple(x.shape[:-1])
        return GuidedRows(bits.index_select(0, idx).reshape(*lead, -1),
                          scales.index_select(0, idx).view(torch.float8_e4m3fn).reshape(*lead, -1),
                          table.gs.index_select(0, idx).reshape(*lead, 1),
                          found=found, any_missing=sl.missing > 0, n_found=n_found,
                          counters=self.batch.metrics if self.batch.measuring else None)

    def _variant(self, x: torch.Tensor) -> Optional[str]:
        b = self.batch
        if x.dim() != 3 or x.shape[1] != self.p.micro_batch_size:
            return None
        if x.shape[0] == b.seq_len:
            return "full"
        if b.sp and x.shape[0] * b.tp_size == b.seq_len:
            return "shard"
        return None

    def __call__(self, site, x: torch.Tensor) -> Optional[GuidedRows]:
        """One linear's guide: a dense site, or one expert of the per-expert path."""
        key = EntryKey.from_site(site)
        name = (key.site, key.routed)
        if name not in self.batch.tables or key not in self.batch.cache:
            return None
        if key.routed:
            sl = self.p.slices.get((name, key.layer, key.expert - self.batch.first_expert, "experts"))
            return None if sl is None else self._gather(name, sl, x, int(site.k_offset or 0))
        variant = self._variant(x)
        sl = self.p.slices.get((name, key.layer, None, variant)) if variant is not None else None
        if sl is None:
            return None
        return self._gather(name, sl, x, int(site.k_offset or 0))

    def for_experts(self, site, n_local: int, x: torch.Tensor) -> Optional[GuidedRows]:
        """The guide of a grouped expert call: rows of all local experts of site's layer and role, in
        Megatron's permuted order (x is [rows, K]); None when the layer is not cached or rows disagree."""
        key = EntryKey.from_site(site)
        name = (key.site, True)
        if name not in self.batch.tables or n_local != self.batch.n_local:
            return None
        first = self.p.slices.get((name, key.layer, 0, "experts"))
        if first is None:
            return None
        last = self.p.slices[(name, key.layer, n_local - 1, "experts")]
        missing = sum(self.p.slices[(name, key.layer, e, "experts")].missing for e in range(n_local))
        return self._gather(name, _Slice(first.start, last.stop, missing), x, int(site.k_offset or 0))
