"""Building TRACE caches: from the engine's captures, and by slicing or merging caches.

The engine side calls `add_sample` once per generated sample with the sample's TRACE capture
(`RolloutSample.trace`: layer -> site -> ActivationCapture, see megatron_qrl.rollout.protocol) and its
routed expert ids (R3), or `add_rows` for anything else; `build()` sorts rows into the canonical order
(tokens by (sample, position); per entry ascending token), deduplicates row sets and global scales
and seals the cache with its checksum. Slicing (transport) and merging reuse the same path, so there is
one definition of the canonical layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence

import torch

from .cache import BLOCK, FORMAT, EntryCut, EntryKey, TraceCache, TraceEntry, token_keys
from .errors import MisshapenCacheError, StaleCacheError, TraceError
from .packing import index_width, pack_indices, pack_mask


@dataclass
class _Chunk:
    experts: torch.Tensor   # int64 [n] (CPU)
    keys: torch.Tensor      # int64 [n] token keys (CPU)
    bits: torch.Tensor      # uint8 [n, Kw/8]
    scales: torch.Tensor    # uint8 [n, Kw/16]
    gs: torch.Tensor        # fp32 [n]


def _rows_vector(value, n: int, name: str) -> torch.Tensor:
    t = torch.as_tensor(value).to("cpu", torch.int64).reshape(-1)
    if t.numel() == 1:
        return t.expand(n).clone()
    if t.numel() != n:
        raise MisshapenCacheError(f"{name} has {t.numel()} values for {n} rows")
    return t


class TraceCacheBuilder:
    """Accumulates captured rows; `build()` returns a sealed TraceCache.

    `layers`: if given, rows of other layers are ignored (the engine may feed every capture).
    """

    def __init__(self, weight_version: int, step: int, fingerprint: str = "",
                 layers: Optional[Iterable[int]] = None):
        self.weight_version, self.step, self.fingerprint = int(weight_version), int(step), str(fingerprint)
        self.layers = None if layers is None else set(int(x) for x in layers)
        self._chunks: dict[tuple[int, str], list[_Chunk]] = {}
        self._k: dict[tuple[int, str], tuple[int, int, int]] = {}

    def add_rows(self, layer: int, site: str, experts, samples, positions, bits: torch.Tensor,
                 scales: torch.Tensor, global_scales, *, k_start: int = 0, k_full: Optional[int] = None) -> None:
        """Rows of one site: experts/samples int or [n]; positions [n]; bits uint8 [n, Kw/8];
        scales float8_e4m3fn or uint8 [n, Kw/16]; global_scales fp32 scalar or [n] (per row: the scale of
        the engine tensor the row was quantized in). k_start/k_full place a K-slice in the full K."""
        if self.layers is not None and int(layer) not in self.layers:
            return
        bits = bits.reshape(-1, bits.shape[-1]) if bits.dim() != 2 else bits
        scales = scales.reshape(-1, scales.shape[-1]) if scales.dim() != 2 else scales
        n, kw = bits.shape[0], bits.shape[1] * 8
        where = f"layer {layer} site '{site}'"
        if bits.dtype != torch.uint8:
            raise MisshapenCacheError(f"{where}: bits must be uint8 (8 mantissa bits per byte), got {bits.dtype}")
        if scales.dtype == torch.float8_e4m3fn:
            scales = scales.view(torch.uint8)
        if scales.dtype != torch.uint8 or tuple(scales.shape) != (n, kw // BLOCK) or kw % BLOCK:
            raise MisshapenCacheError(f"{where}: scales must be float8_e4m3fn [{n}, {kw // BLOCK}] for bits "
                                      f"[{n}, {kw // 8}] (K={kw} a multiple of {BLOCK}), got {scales.dtype} "
                                      f"{tuple(scales.shape)}")
        gs = torch.as_tensor(global_scales, dtype=torch.float32).to(bits.device).reshape(-1)
        gs = gs.expand(n).clone() if gs.numel() == 1 else gs
        if gs.numel() != n:
            raise MisshapenCacheError(f"{where}: {gs.numel()} global scales for {n} rows")
        k_full = kw if k_full is None else int(k_full)
        if k_start % BLOCK or k_start < 0 or k_start + kw > k_full:
            raise MisshapenCacheError(f"{where}: columns [{k_start}, {k_start + kw}) do not fit K={k_full} "
                                      f"on {BLOCK}-element block boundaries")
        group = (int(layer), str(site))
        if self._k.setdefault(group, (k_start, kw, k_full)) != (k_start, kw, k_full):
            raise MisshapenCacheError(f"{where}: rows with columns {(k_start, kw, k_full)} after "
                                      f"{self._k[group]} (k_start, k_width, k_full); one K range per site")
        samples_v = _rows_vector(samples, n, "samples")
        positions_v = _rows_vector(positions, n, "positions")
        keys = token_keys(samples_v, positions_v)
        if bool((keys < 0).any()):
            raise MisshapenCacheError(f"{where}: sample ids and positions must be >= 0 (and positions < 2^31)")
        experts_v = _rows_vector(experts, n, "experts").clamp(min=-1)
        self._chunks.setdefault(group, []).append(
            _Chunk(experts_v, keys, bits.contiguous(), scales.contiguous(), gs))

    def add_sample(self, sample_index: int, trace: Mapping, routed_experts: Optional[torch.Tensor] = None,
                   moe_layers: Optional[Sequence[int]] = None) -> None:
        """One generated sample's capture: {layer: {site: ActivationCapture}} (rollout.protocol).

        Routed-expert captures have bits [N, k, K/8], scales [N, k, K/16], global_scale [N, k]; slot j of
        row i is the input of expert routed_experts[i, m, j] (R3 ids, [N, num_moe_layers, k]) where m is
        the layer's position in `moe_layers` (the engine's MoE layer list; default: every layer is MoE,
        m = layer). Dense captures have bits [N, K/8] and global_scale [N] or a scalar. Row i = position i.
        """
        self.add_samples([sample_index], [trace], [routed_experts], moe_layers)

    def add_samples(self, sample_indices: Sequence[int], traces: Sequence[Mapping],
                    routed_experts: Sequence[Optional[torch.Tensor]], moe_layers: Optional[Sequence[int]] = None
                    ) -> None:
        """add_sample for many samples at once: their rows of one site are concatenated and added in one
        add_rows (a loop batch of 256 samples x 6 layers x 2 sites is 12 row sets, not 3,072)."""
        moe_pos = None if moe_layers is None else {int(layer): i for i, layer in enumerate(moe_layers)}
        groups: dict[tuple[int, str], list[tuple]] = {}
        for sample_index, trace, routed in zip(sample_indices, traces, routed_experts):
            for layer, sites in trace.items():
                if self.layers is not None and int(layer) not in self.layers:
                    continue
                for site, cap in sites.items():
                    groups.setdefault((int(layer), str(site)), []).append(
                        _sample_rows(int(sample_index), int(layer), site, cap, routed, moe_pos))
        for (layer, site), parts in groups.items():
            if len(parts) == 1:
                self.add_rows(layer, site, *parts[0])
                continue
            experts, samples, positions, bits, scales, gs = zip(*parts)
            self.add_rows(layer, site, torch.cat(experts), torch.cat(samples), torch.cat(positions), torch.cat(bits),
                          torch.cat(scales), torch.cat(gs))

    def build(self) -> TraceCache:
        """Canonical order, deduplicated row sets and global-scale tables, sealed with the checksum.

        Per site, the payload moves once where it lives (one gather into canonical order; each entry is a
        slice of it) and the per-entry global-scale tables come from one unique over (entry, scale) pairs:
        a handful of device operations and one host read per site, not per entry (a 4-layer batch-64 cache
        has 1,024 entries)."""
        all_keys = [c.keys for chunks in self._chunks.values() for c in chunks]
        table = torch.unique(torch.cat(all_keys)) if all_keys else torch.zeros(0, dtype=torch.int64)
        n_tokens = table.numel()
        rowset_ids: dict[bytes, int] = {}
        rowsets: list[torch.Tensor] = []
        entries: dict[EntryKey, TraceEntry] = {}
        for (layer, site), chunks in sorted(self._chunks.items()):
            experts = torch.cat([c.experts for c in chunks])
            tok = torch.searchsorted(table, torch.cat([c.keys for c in chunks]))
            bits = torch.cat([c.bits for c in chunks])
            scales = torch.cat([c.scales for c in chunks])
            gs = torch.cat([c.gs for c in chunks])
            if gs.numel() and not bool(torch.isfinite(gs).all() and (gs > 0).all()):
                raise MisshapenCacheError(f"layer {layer} site '{site}': global scales must be finite and > 0")
            composite = (experts + 1) * max(1, n_tokens) + tok
            sorted_comp, order = torch.sort(composite)     # (torch.argsort is ~40x slower on the CPU)
            dup = torch.nonzero(sorted_comp[1:] == sorted_comp[:-1]).reshape(-1)
            if dup.numel():
                t = int(tok[order[dup[0]]])
                raise MisshapenCacheError(
                    f"layer {layer} site '{site}' expert {int(experts[order[dup[0]]])}: token (sample "
                    f"{int(table[t] >> 32)}, position {int(table[t] & 0xFFFFFFFF)}) was recorded twice")
            uniq, counts = torch.unique_consecutive(experts[order], return_counts=True)
            dev_order = order.to(bits.device)
            bits, scales, gs = bits.index_select(0, dev_order), scales.index_select(0, dev_order), gs.index_select(0, dev_order)
            gs_values, gs_local, table_sizes = _scale_tables(gs, counts)
            k_start, _, k_full = self._k[(layer, site)]
            row0, table0 = 0, 0
            for expert, n_rows, n_scales in zip(uniq.tolist(), counts.tolist(), table_sizes):
                rows = slice(row0, row0 + n_rows)
                mask = torch.zeros(n_tokens, dtype=torch.bool)
                mask[tok[order[rows]]] = True
                packed = pack_mask(mask)
                rid = rowset_ids.setdefault(packed.numpy().tobytes(), len(rowsets))
                if rid == len(rowsets):
                    rowsets.append(packed)
                entries[EntryKey(layer, site, expert)] = TraceEntry(
                    rowset=rid, bits=bits[rows], scales=scales[rows], gs_table=gs_values[table0:table0 + n_scales],
                    gs_index=pack_indices(gs_local[rows], index_width(n_scales)), k_start=k_start, k_full=k_full)
                row0, table0 = row0 + n_rows, table0 + n_scales
        rowset_bytes = (n_tokens + 7) // 8
        stacked = torch.stack(rowsets) if rowsets else torch.zeros(0, rowset_bytes, dtype=torch.uint8)
        return TraceCache(weight_version=self.weight_version, step=self.step, fingerprint=self.fingerprint,
                          token_runs=runs_from_keys(table), rowsets=stacked, entries=entries).seal()


def _sample_rows(sample_index: int, layer: int, site: str, cap, routed: Optional[torch.Tensor],
                 moe_pos: Optional[dict]) -> tuple:
    """One sample's capture of one site as add_rows arguments (experts, samples, positions, bits, scales,
    global scales; one row per (position, slot)), checked against its R3 ids."""
    fmt = getattr(cap, "format", FORMAT)
    if fmt != FORMAT:
        raise TraceError(f"TRACE caches hold NVFP4 captures only, got format '{fmt}' at layer {layer} "
                         f"site '{site}'; set quant.format=nvfp4 or trace.enabled=false")
    bits = cap.bits
    scales = cap.scales.view(torch.uint8) if cap.scales.dtype == torch.float8_e4m3fn else cap.scales
    n = bits.shape[0]
    if bits.dim() != 3:
        gs = torch.as_tensor(cap.global_scale, dtype=torch.float32).reshape(-1).to(bits.device)
        return (torch.full((n,), -1, dtype=torch.int64), torch.full((n,), sample_index, dtype=torch.int64),
                torch.arange(n), bits, scales, gs.expand(n) if gs.numel() == 1 else gs)
    if routed is None:
        raise MisshapenCacheError(f"layer {layer} site '{site}' is a routed-expert capture "
                                  "([N, k, K/8]); pass routed_experts (R3 ids) to add_sample")
    ids = routed[:, layer if moe_pos is None else moe_pos[layer], :]
    if ids.shape != bits.shape[:2]:
        raise MisshapenCacheError(f"layer {layer} site '{site}': routed_experts has "
                                  f"{tuple(ids.shape)} ids for captures {tuple(bits.shape[:2])}")
    k = bits.shape[1]
    return (ids.reshape(-1).to("cpu", torch.int64), torch.full((n * k,), sample_index, dtype=torch.int64),
            torch.arange(n).repeat_interleave(k), bits.reshape(n * k, -1), scales.reshape(n * k, -1),
            torch.as_tensor(cap.global_scale, dtype=torch.float32).reshape(-1))


def _scale_tables(gs: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Per-entry distinct global scales of rows grouped by entry (counts rows each, in order): (the tables
    concatenated, each ascending; per row its index in its entry's table; table sizes, on the host). Positive
    finite floats order like their bit patterns, so one sorted unique over (entry << 32 | scale bits) gives
    every entry's ascending table at once."""
    entry = torch.repeat_interleave(torch.arange(counts.numel()), counts).to(gs.device)
    key = (entry << 32) | (gs.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF)
    pairs, inverse = torch.unique(key, return_inverse=True)
    sizes = torch.bincount(pairs >> 32, minlength=counts.numel())
    starts = torch.cumsum(sizes, 0) - sizes
    values = (pairs & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
    return values, inverse - starts[entry], sizes.tolist()


def runs_from_keys(keys: torch.Tensor) -> torch.Tensor:
    """Sorted token keys -> int32 [R, 3] runs (sample, first position, count) of consecutive positions."""
    if keys.numel() == 0:
        return torch.zeros(0, 3, dtype=torch.int32)
    samples, positions = keys >> 32, keys & 0xFFFFFFFF
    starts = torch.ones_like(keys, dtype=torch.bool)
    starts[1:] = (samples[1:] != samples[:-1]) | (positions[1:] != positions[:-1] + 1)
    first = torch.nonzero(starts).reshape(-1)
    counts = torch.diff(torch.cat([first, torch.tensor([keys.numel()])]))
    return torch.stack([samples[first], positions[first], counts], dim=1).to(torch.int32)


def subset_cache(cache: TraceCache, cut_for) -> TraceCache:
    """Rows/columns of `cache` chosen per entry by cut_for(key, entry) -> EntryCut | None (see TraceCache)."""
    out = TraceCacheBuilder(cache.weight_version, cache.step, cache.fingerprint)
    samples, positions = cache.tokens()
    for key, entry in cache.entries.items():
        cut = cut_for(key, entry)
        if cut is None:
            continue
        toks = cache.rowset_tokens(entry.rowset)
        bits, scales, gs = entry.bits, entry.scales, entry.row_global_scales()
        if cut.token_mask is not None:
            keep = cut.token_mask.to("cpu", torch.bool)[toks]
            toks = toks[keep]
            keep = torch.nonzero(keep).reshape(-1).to(bits.device)
            bits, scales, gs = bits.index_select(0, keep), scales.index_select(0, keep), gs.index_select(0, keep)
        if toks.numel() == 0:
            continue
        k_start = entry.k_start
        if cut.k_range is not None:
            k0, k1 = cut.k_range
            if k0 % BLOCK or k1 % BLOCK or not entry.k_start <= k0 < k1 <= entry.k_start + entry.k_width:
                raise MisshapenCacheError(f"{key.site_name}: columns [{k0}, {k1}) are not block-aligned or lie "
                                          f"outside the stored [{entry.k_start}, {entry.k_start + entry.k_width})")
            a, b = k0 - entry.k_start, k1 - entry.k_start
            bits, scales, k_start = bits[:, a // 8:b // 8], scales[:, a // BLOCK:b // BLOCK], k0
        out.add_rows(key.layer, key.site, key.expert, samples[toks], positions[toks], bits, scales, gs,
                     k_start=k_start, k_full=entry.k_full)
    return out.build()


def merge_caches(caches: list[TraceCache]) -> TraceCache:
    """Concatenate pieces (e.g. from several engines); rows must not repeat, metadata must agree."""
    if not caches:
        raise ValueError("merge needs at least one TRACE cache")
    head = caches[0]
    for c in caches[1:]:
        if (c.weight_version, c.step, c.fingerprint) != (head.weight_version, head.step, head.fingerprint):
            raise StaleCacheError(f"cannot merge TRACE caches of (version, step, fingerprint) "
                                  f"{(head.weight_version, head.step, head.fingerprint)} and "
                                  f"{(c.weight_version, c.step, c.fingerprint)}")
    if len(caches) == 1:
        return caches[0]
    return _concat(head, caches)


def _concat(head: TraceCache, caches: list[TraceCache]) -> TraceCache:
    out = TraceCacheBuilder(head.weight_version, head.step, head.fingerprint)
    for c in caches:
        samples, positions = c.tokens()
        for key, e in c.entries.items():
            toks = c.rowset_tokens(e.rowset)
            out.add_rows(key.layer, key.site, key.expert, samples[toks], positions[toks], e.bits, e.scales,
                         e.row_global_scales(), k_start=e.k_start, k_full=e.k_full)
    return out.build()


__all__ = ["EntryCut", "TraceCacheBuilder", "merge_caches", "runs_from_keys", "subset_cache"]
