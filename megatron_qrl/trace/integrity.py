"""Integrity: a cache guides a batch only if it is intact, current and shaped like the model.

`validate` raises a typed error (CorruptCacheError / StaleCacheError / MisshapenCacheError, all
TraceCacheError); `accept` is the caller's one-liner: it returns the cache, or None after counting
trace/rejected and logging why, so the batch falls back to nearest rounding instead of being guided by
misaligned bits.
"""
from __future__ import annotations

import hashlib
import json
import logging
from typing import Mapping, Optional

import torch

from .cache import BLOCK, TraceCache
from .errors import CorruptCacheError, MisshapenCacheError, StaleCacheError, TraceCacheError
from .packing import index_width, packed_index_bytes

log = logging.getLogger(__name__)


def config_fingerprint(cfg) -> str:
    """Hash of what fixes the cache's meaning: the model, the FP4 format/targets and the cached layers."""
    payload = {"model": cfg.model.model_dump(), "format": cfg.quant.format, "targets": cfg.quant.targets,
               "scheme": cfg.quant.scheme, "cached_layers": cfg.cached_layers(), "trace_format": 1}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def expected_site_widths(cfg) -> dict[str, int]:
    """Full K of every site that a cache of this config may hold, keyed like EntryKey.shape_key."""
    m = cfg.model
    widths = {"expert.fc1": m.hidden_size, "expert.fc2": m.moe_ffn_hidden_size,
              "qkv": m.hidden_size, "proj": m.num_attention_heads * m.head_dim,
              "fc1": m.hidden_size, "fc2": m.ffn_hidden_size}
    if m.moe_shared_expert_ffn_hidden_size:
        widths.update({"shared_fc1": m.hidden_size, "shared_fc2": m.moe_shared_expert_ffn_hidden_size})
    return widths


def check_checksum(cache: TraceCache) -> None:
    """CorruptCacheError unless the content still hashes to the checksum recorded at build/decoding."""
    if cache.checksum is None:
        raise CorruptCacheError("TRACE cache carries no checksum (not sealed by TraceCacheBuilder)")
    if cache.verified:
        return
    actual = cache.compute_checksum()
    if actual != cache.checksum:
        raise CorruptCacheError(f"TRACE cache checksum mismatch: recorded {cache.checksum:08x}, content "
                                f"{actual:08x}")
    cache.verified = True


def check_structure(cache: TraceCache) -> None:
    """MisshapenCacheError unless every entry agrees with its row set, K and scale table."""
    n = cache.n_tokens
    if cache.rowsets.dim() != 2 or cache.rowsets.shape[1] != (n + 7) // 8:
        raise MisshapenCacheError(f"row sets {tuple(cache.rowsets.shape)} do not cover {n} tokens")
    for key, e in cache.entries.items():
        where = key.site_name
        if not 0 <= e.rowset < cache.rowsets.shape[0]:
            raise MisshapenCacheError(f"{where}: row set {e.rowset} of {cache.rowsets.shape[0]}")
        rows = int(cache.rowset_mask(e.rowset).sum())
        if e.rows != rows:
            raise MisshapenCacheError(f"{where}: {e.rows} rows of bits but its row set has {rows} tokens")
        kw = e.k_width
        if kw % BLOCK or e.k_start % BLOCK or e.k_start + kw > e.k_full:
            raise MisshapenCacheError(f"{where}: columns [{e.k_start}, {e.k_start + kw}) of K={e.k_full} are not "
                                      f"{BLOCK}-element blocks inside K")
        if tuple(e.scales.shape) != (e.rows, kw // BLOCK):
            raise MisshapenCacheError(f"{where}: scales {tuple(e.scales.shape)}, expected {(e.rows, kw // BLOCK)}")
        u = int(e.gs_table.numel())
        if e.rows and (u == 0 or e.gs_index.numel() != packed_index_bytes(e.rows, index_width(u))):
            raise MisshapenCacheError(f"{where}: {u} global scales / {e.gs_index.numel()} index bytes for "
                                      f"{e.rows} rows")
        if u and not bool(torch.isfinite(e.gs_table).all() and (e.gs_table > 0).all()):
            raise MisshapenCacheError(f"{where}: non-finite or non-positive global scales")


def validate(cache: TraceCache, expected_version: int, expected_step: int,
             expected_shapes: Optional[Mapping[str, int]] = None, expected_fingerprint: Optional[str] = None,
             expected_layers=None) -> TraceCache:
    """Reject a cache that is corrupt, stale (version/step/fingerprint) or misshapen; return it otherwise.

    expected_shapes maps EntryKey.shape_key ('expert.fc1', 'qkv', ...) to the site's full K (see
    expected_site_widths); expected_layers, if given, are the layers the cache may hold.
    """
    check_checksum(cache)
    if cache.weight_version != expected_version or cache.step != expected_step:
        raise StaleCacheError(f"TRACE cache is for weight version {cache.weight_version} step {cache.step}; "
                              f"this batch needs version {expected_version} step {expected_step}")
    if expected_fingerprint is not None and cache.fingerprint != expected_fingerprint:
        raise StaleCacheError(f"TRACE cache fingerprint {cache.fingerprint!r} is not this run's "
                              f"{expected_fingerprint!r} (other model or quantization config)")
    check_structure(cache)
    layers = None if expected_layers is None else set(expected_layers)
    for key, e in cache.entries.items():
        if layers is not None and key.layer not in layers:
            raise MisshapenCacheError(f"{key.site_name}: layer {key.layer} is not a cached layer {sorted(layers)}")
        if expected_shapes is not None:
            if key.shape_key not in expected_shapes:
                raise MisshapenCacheError(f"{key.site_name}: site '{key.shape_key}' is not one of "
                                          f"{sorted(expected_shapes)}")
            if e.k_full != expected_shapes[key.shape_key]:
                raise MisshapenCacheError(f"{key.site_name}: K={e.k_full}, the model's '{key.shape_key}' has "
                                          f"K={expected_shapes[key.shape_key]}")
    return cache


def accept(cache: Optional[TraceCache], expected_version: int, expected_step: int, metrics=None,
           **expected) -> Optional[TraceCache]:
    """validate(); on a TraceCacheError count trace/rejected, log the reason and return None (-> nearest)."""
    if cache is None:
        return None
    try:
        return validate(cache, expected_version, expected_step, **expected)
    except TraceCacheError as err:
        if metrics is not None:
            metrics.count("rejected")
        log.warning("TRACE cache rejected, this batch uses nearest rounding: %s: %s", type(err).__name__, err)
        return None
