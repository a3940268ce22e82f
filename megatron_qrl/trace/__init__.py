"""TRACE rollout-guided rounding: the cache of a rollout's FP4 rounding decisions and its delivery.

Two ports: the engine's `TraceRecorder` (recorder.py: owns the capture sink, keeps each sample's captures under
its handle, seals the batch's cache) and the trainer's `TraceReplay` (guidance.py: given to the Trainer once,
loaded per step with what `exchange` delivered, serves `for_micro_batch`). Below them:
Engine side: `TraceCacheBuilder.add_samples(indices, traces, routed_experts)` for a batch (or `add_sample`
for one), then `build()` (sealed, checksummed where the captures live). Transport: `exchange` (or `local_shard` when
colocated) with one `ShardSpec` per trainer rank; storage: `TraceStore` / `plan`. Trainer side:
`accept` (validate, count rejections), then `BatchGuides` (index once per batch, gather guide rows on the
device, `replay_rows`) -- or its host reference `GuideProvider` / `lookup` per micro-batch and
`guided_fake_quant` to replay with per-row global scales. docs/trace.md describes the format.
"""
from .builder import TraceCacheBuilder
from .device_guides import BatchGuides, GuidedRows, MicroBatchGuide
from .cache import BITS_PER_ELEMENT, BLOCK, EntryCut, EntryKey, TraceCache, TraceEntry
from .errors import (CorruptCacheError, MisshapenCacheError, StaleCacheError, TraceBudgetError, TraceCacheError,
                     TraceError, TraceLookupError)
from .guidance import TraceReplay, local_replay
from .integrity import accept, config_fingerprint, expected_site_widths, validate
from .lookup import ExpertSources, GuideProvider, MicroBatchGuides, TraceGuide, lookup, routed_rows, sequence_major_rows
from .metrics import TraceMetrics, mismatch_counts
from .recorder import TraceRecorder, seal_rollouts, without_captures
from .replay import guided_codes, guided_fake_quant, guided_quant_dequant, replay_rows
from .store import TracePlan, TraceStore, plan
from .transport import (ROW_PARALLEL_SITES, ShardSpec, dp_samples, exchange, gather_specs, local_shard,
                        megatron_ep_group, recv_cache, rows_per_dp_rank, select, send_cache)

__all__ = [
    "BITS_PER_ELEMENT", "BLOCK", "BatchGuides", "CorruptCacheError", "EntryCut", "EntryKey", "ExpertSources",
    "GuideProvider", "GuidedRows", "MicroBatchGuide", "MicroBatchGuides", "MisshapenCacheError", "ROW_PARALLEL_SITES", "ShardSpec", "StaleCacheError",
    "TraceBudgetError", "TraceCache", "TraceCacheBuilder", "TraceCacheError", "TraceEntry", "TraceError",
    "TraceGuide", "TraceLookupError", "TraceMetrics", "TracePlan", "TraceRecorder", "TraceReplay", "TraceStore", "accept", "config_fingerprint",
    "dp_samples", "exchange", "expected_site_widths", "gather_specs", "guided_codes", "local_replay", "guided_fake_quant",
    "guided_quant_dequant", "local_shard", "lookup", "megatron_ep_group", "mismatch_counts", "plan", "recv_cache",
    "replay_rows", "routed_rows", "rows_per_dp_rank", "seal_rollouts", "select", "send_cache",
    "sequence_major_rows", "validate", "without_captures"
]
