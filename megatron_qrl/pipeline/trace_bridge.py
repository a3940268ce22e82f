"""TRACE between the engine's captures and the trainer's guided QAT (METHODS.md section 3).

prepare(): build the sealed cache from this step's rollouts, validate it (version, step, fingerprint,
checksum, site widths; a rejected cache is counted in trace/rejected and the batch falls back to nearest
rounding) and hand the trainer a `trace_guides(sample_ids) -> provider` hook. In the single-node colocated
placement the cache stays local (no transport); the multi-rank transport is megatron_qrl.trace.exchange.
While measuring is on (the log-prob pass), every guided site also records how many cached elements the
trainer's own nearest rounding would have put on another codeword (trace/code_mismatch_before) and how many
the guided rounding does (trace/code_mismatch_after).
The hook is trace.BatchGuides: guide rows indexed once per batch and gathered on the trainer's device,
mismatches counted there (trace/device_guides.py). device_guides=False selects the host reference
(lookup.MicroBatchGuides, per-site host lookups and mismatch counts), kept for tests and comparisons.
"""
from __future__ import annotations

import time


class _MeasuringGuides:
    """Wraps MicroBatchGuides: the same providers, plus mismatch accounting while `measuring`."""

    def __init__(self, inner, metrics, fallback_shift: float):
        self.inner, self.metrics, self.fallback_shift = inner, metrics, fallback_shift
        self.measuring = True

    def __call__(self, sample_ids, batch_rows=None):
        provider = self.inner(sample_ids, batch_rows)

        def guided(site, x):
            guide = provider(site, x)
            if guide is not None and self.measuring:
                self.metrics.add_mismatch(x, guide, self.fallback_shift)
            return guide

        return guided


def expert_sources(cfg, num_samples: int):
    """This trainer rank's ExpertSources under expert parallelism (None without it)."""
    from megatron.core import parallel_state as ps

    from megatron_qrl.trace import ExpertSources, megatron_ep_group, rows_per_dp_rank

    ep = ps.get_expert_model_parallel_world_size()
    if ep == 1:
        return None
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    _, group = megatron_ep_group(dp_rank, ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
                                 ep, ps.get_expert_tensor_parallel_world_size())
    return ExpertSources(num_samples, rows_per_dp_rank(num_samples, dp, cfg.trainer.micro_batch_size), dp_rank,
                         tuple(group))


class TraceBridge:
    def __init__(self, cfg, device_guides: bool = True):
        self.cfg = cfg
        self.device_guides = device_guides
        self.enabled = bool(cfg.trace.enabled and cfg.cached_layers())
        self._metrics = None
        self._guides = None

    def build(self, rollouts, step: int, version: int, first_index: int = 0):
        """Engine side: the sealed cache of `rollouts`, sample ids first_index.. (None when TRACE is off)."""
        if not self.enabled:
            return None
        from megatron_qrl.trace import TraceCacheBuilder, config_fingerprint

        builder = TraceCacheBuilder(version, step, config_fingerprint(self.cfg), layers=self.cfg.cached_layers())
        for i, r in enumerate(rollouts):
            builder.add_sample(first_index + i, r.trace, routed_experts=r.routed_experts)
        return builder.build()

    def prepare(self, batch, step: int, version: int):
        """Colocated: (trace_guides hook or None, metrics) for this step's batch, built from its rollouts."""
        if not self.enabled:
            return None, {}
        t0 = time.perf_counter()
        cache = self.build(batch.rollouts, step, version)
        return self.guides(cache, batch, step, version, {"trace/build_s": time.perf_counter() - t0,
                                                          "trace/transfer_s": 0.0})

    def guides(self, cache, batch, step: int, version: int, timings: dict, metrics=None):
        """Trainer side: validate `cache` (version, step, fingerprint, checksum, site widths; a rejected
        cache counts in trace/rejected and the batch falls back to nearest rounding) and wrap it as the
        trainer's trace_guides hook. Returns (hook or None, metrics)."""
        from megatron_qrl.trace import MicroBatchGuides, TraceMetrics, accept, config_fingerprint, expected_site_widths

        self._metrics = metrics or TraceMetrics()
        cache = accept(cache, version, step, self._metrics, expected_shapes=expected_site_widths(self.cfg),
                       expected_fingerprint=config_fingerprint(self.cfg))
        out = {**timings, "trace/cache_bytes": float(cache.nbytes) if cache is not None else 0.0,
               "trace/bits_per_element": float(cache.bits_per_element()) if cache is not None else 0.0}
        if cache is None:
            self._guides = None
            return None, out
        from megatron.core import parallel_state as ps

        from megatron_qrl.models import sequence_parallel_enabled

        tp, sp = ps.get_tensor_model_parallel_world_size(), sequence_parallel_enabled(self.cfg)
        seq_len = batch.tokens.shape[1]
        if sp and tp > 1:   # the trainer pads T to a multiple of TP under sequence parallelism (trainer/batch.py)
            seq_len = -(-seq_len // tp) * tp
        layout = dict(tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp, sequence_parallel=sp,
                      metrics=self._metrics, expert_sources=expert_sources(self.cfg, batch.tokens.shape[0]))
        if self.device_guides:
            from megatron_qrl.platform import device
            from megatron_qrl.trace import BatchGuides

            ep, n = ps.get_expert_model_parallel_world_size(), self.cfg.model.num_experts
            local = (ps.get_expert_model_parallel_rank() * (n // ep), n // ep) if n else (0, 0)
            self._guides = BatchGuides(cache, seq_len, batch.r3_expert_ids, local_experts=local, num_experts=n,
                                       device=device(), **layout)
        else:
            inner = MicroBatchGuides(cache, seq_len, batch.r3_expert_ids, **layout)
            self._guides = _MeasuringGuides(inner, self._metrics, self.cfg.trace.fallback_shift)
        return self._guides, out

    def after_logprobs(self) -> dict:
        """TRACE metrics of the log-prob pass; later (training) passes replay without measuring."""
        if self._guides is not None:
            self._guides.measuring = False
        return self._metrics.as_dict() if self._metrics is not None else {}
