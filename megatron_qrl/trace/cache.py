"""The TRACE cache: a rollout's FP4 rounding decisions for the cached layers, ~1.5 bits per element.

Per cached element the rollout's NVFP4 encoding is kept as its code's mantissa bit (1 bit) and its
block's E4M3 scale (8 bits per 16 elements); the FP32 global scale is per quantized tensor, i.e. per
engine call, so each entry keeps a small table of distinct global scales and a narrow per-row index
into it. That is what guided rounding (METHODS.md section 3) needs to replay the rollout's codes.

Structure (docs/trace.md has the byte layout):
- tokens: the (sample, position) pairs that appear anywhere, sorted, stored as runs
  (sample, first position, count); `position` is the forwarded input position (row i of the engine's
  capture = input position i of the sample's prompt + response).
- entries keyed by `EntryKey(layer, site, expert)` (expert -1 for dense / attention sites); an entry's
  rows are the tokens of its row set in token order. Row sets are bit masks over the tokens, shared by
  entries with the same rows (fc1/fc2 of one expert), so row identity costs num_experts/top_k bits per
  routed row instead of two integers.
- header: weight version, step, model/config fingerprint; a checksum over the header and every section
  (hashed where the bytes live: on the GPU for a GPU cache, serialize.compute_checksum).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch

from megatron_qrl.quant.nvfp4 import BLOCK
from megatron_qrl.quant.sites import parse_site_name, site_name

from .errors import TraceLookupError
from .packing import index_width, unpack_indices, unpack_mask

FORMAT = "nvfp4"
BITS_PER_ELEMENT = 1.0 + 8.0 / BLOCK   # mantissa bit + block scale share


@dataclass(frozen=True, order=True)
class EntryKey:
    """Which quantized input an entry records: layer (global, 0-based), site role, expert (-1: dense)."""

    layer: int
    site: str
    expert: int = -1

    @property
    def routed(self) -> bool:
        return self.expert >= 0

    @property
    def shape_key(self) -> str:
        """Key of `expected_shapes` (integrity.validate): 'expert.fc1' for routed experts, else the site."""
        return f"expert.{self.site}" if self.routed else self.site

    @property
    def site_name(self) -> str:
        """The model's site name (megatron_qrl.models.fp4_linear.site_name): 'L3.fc1.E17', 'L0.qkv'."""
        return site_name(self.layer, self.site, self.expert if self.routed else None)

    @classmethod
    def from_site_name(cls, name: str) -> "EntryKey":
        layer, role, expert = parse_site_name(name)
        return cls(layer, role, -1 if expert is None else expert)

    @classmethod
    def from_site(cls, site) -> "EntryKey":
        """From a models.fp4_linear.QuantSite (layer, role, expert or None)."""
        return cls(int(site.layer), str(site.role), -1 if site.expert is None else int(site.expert))


@dataclass
class TraceEntry:
    """One site's rows: packed mantissa bits, E4M3 scale bytes and per-row global scales (as a table)."""

    rowset: int                # index into TraceCache.rowsets
    bits: torch.Tensor         # uint8 [rows, k_width/8], element 8j+i = bit i of byte j
    scales: torch.Tensor       # uint8 [rows, k_width/16], E4M3 bit patterns
    gs_table: torch.Tensor     # fp32 [U], the distinct global scales, ascending
    gs_index: torch.Tensor     # uint8, per row an index into gs_table, index_width(U) bits each
    k_start: int = 0           # first column of the full K this entry holds (TP shards hold a slice)
    k_full: int = 0            # the full (unsharded) K of the site

    @property
    def rows(self) -> int:
        return int(self.bits.shape[0])

    @property
    def k_width(self) -> int:
        return int(self.bits.shape[1]) * 8

    @property
    def index_width(self) -> int:
        return index_width(int(self.gs_table.numel()))

    def row_global_scales(self) -> torch.Tensor:
        """fp32 [rows]: the global scale of the engine tensor each row was quantized in."""
        idx = unpack_indices(self.gs_index, self.rows, self.index_width)
        return self.gs_table[idx.to(self.gs_table.device)]

    def scales_e4m3(self) -> torch.Tensor:
        return self.scales.view(torch.float8_e4m3fn)

    def tensors(self) -> list[torch.Tensor]:
        return [self.bits, self.scales, self.gs_table, self.gs_index]


@dataclass(frozen=True)
class EntryCut:
    """How `TraceCache.subset` trims one entry: keep rows whose token is in token_mask, columns k_range."""

    token_mask: Optional[torch.Tensor] = None          # bool [n_tokens] over the cache's tokens; None = all
    k_range: Optional[tuple[int, int]] = None          # (k0, k1) in full-K columns; None = all stored


def token_keys(samples: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """int64 key ordering tokens by (sample, position); negative ids map to -1 (never stored)."""
    s = torch.as_tensor(samples, dtype=torch.int64).reshape(-1)
    p = torch.as_tensor(positions, dtype=torch.int64).reshape(-1)
    if s.numel() == 1 and p.numel() > 1:
        s = s.expand(p.numel())
    keys = (s << 32) | p
    return torch.where((s < 0) | (p < 0) | (p >= 2 ** 31), torch.full_like(keys, -1), keys)


class TraceCache:
    """A sealed, immutable TRACE cache (build it with TraceCacheBuilder; transport it with to_bytes)."""

    def __init__(self, *, weight_version: int, step: int, fingerprint: str, token_runs: torch.Tensor,
                 rowsets: torch.Tensor, entries: dict[EntryKey, TraceEntry], checksum: Optional[int] = None):
        self.weight_version = int(weight_version)
        self.step = int(step)
        self.fingerprint = str(fingerprint)
        self.token_runs = token_runs          # int32 [R, 3]: sample, first position, count
        self.rowsets = rowsets                # uint8 [S, ceil(n_tokens/8)]
        self.entries = dict(sorted(entries.items()))
        self.checksum = checksum              # u32 checksum of the serialized form (serialize.compute_checksum)
        self.verified = False                 # set when the checksum was checked against the content
        self._derived: dict = {}

    # ---- tokens and rows ------------------------------------------------------------------------
    @property
    def n_tokens(self) -> int:
        return int(self.token_runs[:, 2].sum()) if self.token_runs.numel() else 0

    def tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(samples int64 [n_tokens], positions int64 [n_tokens]) in token order."""
        if "tokens" not in self._derived:
            runs = self.token_runs.to("cpu", torch.int64)
            counts = runs[:, 2]
            samples = torch.repeat_interleave(runs[:, 0], counts)
            starts = torch.repeat_interleave(runs[:, 1] - torch.cumsum(counts, 0) + counts, counts)
            positions = starts + torch.arange(int(counts.sum()), dtype=torch.int64)
            self._derived["tokens"] = (samples, positions)
        return self._derived["tokens"]

    def token_index(self, samples, positions) -> torch.Tensor:
        """int64 [m]: index of each (sample, position) among the cache's tokens, -1 where absent."""
        if "keys" not in self._derived:
            self._derived["keys"] = token_keys(*self.tokens())
        table = self._derived["keys"]
        q = token_keys(samples, positions)
        if table.numel() == 0:
            return torch.full_like(q, -1)
        at = torch.searchsorted(table, q).clamp(max=table.numel() - 1)
        return torch.where((table[at] == q) & (q >= 0), at, torch.full_like(at, -1))

    def rowset_mask(self, rowset: int) -> torch.Tensor:
        """bool [n_tokens]: the tokens that are rows of entries using this row set."""
        return unpack_mask(self.rowsets[rowset].cpu(), self.n_tokens)

    def rowset_tokens(self, rowset: int) -> torch.Tensor:
        """int64 [rows]: token index of each row (ascending)."""
        key = ("rows", rowset)
        if key not in self._derived:
            self._derived[key] = torch.nonzero(self.rowset_mask(rowset)).reshape(-1)
        return self._derived[key]

    def row_of_token(self, rowset: int) -> torch.Tensor:
        """int64 [n_tokens]: the row holding each token in entries of this row set, -1 if none."""
        key = ("row_of", rowset)
        if key not in self._derived:
            out = torch.full((self.n_tokens,), -1, dtype=torch.int64)
            rows = self.rowset_tokens(rowset)
            out[rows] = torch.arange(rows.numel())
            self._derived[key] = out
        return self._derived[key]

    # ---- entries --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: EntryKey) -> bool:
        return key in self.entries

    def keys(self) -> list[EntryKey]:
        return list(self.entries)

    def entry(self, key: EntryKey) -> TraceEntry:
        try:
            return self.entries[key]
        except KeyError:
            raise TraceLookupError(f"the TRACE cache has no entry for {key.site_name} (layer {key.layer}, "
                                   f"site '{key.site}', expert {key.expert}); it holds {len(self)} entries")

    # ---- size accounting --------------------------------------------------------------------------
    @property
    def elements(self) -> int:
        """Number of cached activation elements (rows x K columns over all entries)."""
        return sum(e.rows * e.k_width for e in self.entries.values())

    @property
    def nbytes(self) -> int:
        """Size of the serialized cache (header, token runs, row sets, payload, alignment)."""
        from .serialize import serialized_size
        return serialized_size(self)

    def bits_per_element(self) -> float:
        """Serialized bits per cached element; the format's floor is 1.5 (1 mantissa bit + 8/16)."""
        return 8.0 * self.nbytes / max(1, self.elements)

    # ---- integrity and transport ------------------------------------------------------------------
    def compute_checksum(self) -> int:
        from .serialize import compute_checksum
        return compute_checksum(self)

    def seal(self) -> "TraceCache":
        """Record the checksum of the current content (done by the builder)."""
        self.checksum = self.compute_checksum()
        self.verified = True
        return self

    def to_bytes(self, device=None, pin_memory: bool = False) -> torch.Tensor:
        from .serialize import to_bytes
        return to_bytes(self, device=device, pin_memory=pin_memory)

    @staticmethod
    def from_bytes(blob, verify: bool = True) -> "TraceCache":
        from .serialize import from_bytes
        return from_bytes(blob, verify=verify)

    @property
    def device(self) -> torch.device:
        for e in self.entries.values():
            return e.bits.device
        return torch.device("cpu")

    def to(self, device) -> "TraceCache":
        """The same cache with its payload on `device` (token runs and row sets stay on the CPU)."""
        entries = {k: TraceEntry(e.rowset, *(t.to(device) for t in e.tensors()), e.k_start, e.k_full)
                   for k, e in self.entries.items()}
        out = TraceCache(weight_version=self.weight_version, step=self.step, fingerprint=self.fingerprint,
                         token_runs=self.token_runs.cpu(), rowsets=self.rowsets.cpu(), entries=entries,
                         checksum=self.checksum)
        out.verified = self.verified
        return out

    # ---- slicing and merging ------------------------------------------------------------------------
    def subset(self, cut_for: Callable[[EntryKey, TraceEntry], Optional[EntryCut]]) -> "TraceCache":
        """A new sealed cache with, per entry, `cut_for(key, entry)`'s rows/columns (None drops it)."""
        from .builder import subset_cache
        return subset_cache(self, cut_for)

    @staticmethod
    def merge(caches: Iterable["TraceCache"]) -> "TraceCache":
        """One cache from pieces with disjoint (sample, position, entry) rows and the same metadata."""
        from .builder import merge_caches
        return merge_caches(list(caches))

    def same_content(self, other: "TraceCache") -> bool:
        """Equal metadata, tokens and, per entry, rows, columns and bytes (row-set numbering aside)."""
        if (self.weight_version, self.step, self.fingerprint, self.keys()) != \
                (other.weight_version, other.step, other.fingerprint, other.keys()):
            return False
        if not torch.equal(self.token_runs.cpu(), other.token_runs.cpu()):
            return False
        for key, a in self.entries.items():
            b = other.entries[key]
            if (a.k_start, a.k_full, a.rows, a.k_width) != (b.k_start, b.k_full, b.rows, b.k_width):
                return False
            if not torch.equal(self.rowset_tokens(a.rowset), other.rowset_tokens(b.rowset)):
                return False
            if not (torch.equal(a.bits.cpu(), b.bits.cpu()) and torch.equal(a.scales.cpu(), b.scales.cpu())
                    and torch.equal(a.row_global_scales().cpu(), b.row_global_scales().cpu())):
                return False
        return True

    def __repr__(self) -> str:
        return (f"TraceCache(version={self.weight_version}, step={self.step}, entries={len(self)}, "
                f"tokens={self.n_tokens}, elements={self.elements}, bytes={self.nbytes})")
