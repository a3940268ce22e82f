"""Typed TRACE errors: callers catch `TraceCacheError`, count it (trace/rejected) and fall back to nearest."""
from __future__ import annotations


class TraceError(Exception):
    """Base of every TRACE error."""


class TraceCacheError(TraceError, ValueError):
    """A cache that must not guide this batch; the trainer falls back to nearest rounding for it."""


class CorruptCacheError(TraceCacheError):
    """Bytes that do not decode, or whose checksum disagrees with the content."""


class StaleCacheError(TraceCacheError):
    """A cache from another weight version, step or model configuration."""


class MisshapenCacheError(TraceCacheError):
    """A cache whose shapes disagree with themselves or with the model (K per site, rows, scales)."""


class TraceBudgetError(TraceError, ValueError):
    """The TRACE cache of one step does not fit the configured memory budget (message names the fix)."""


class TraceLookupError(TraceError, KeyError):
    """A lookup that cannot be answered (unknown site, K range outside the stored shard)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""
