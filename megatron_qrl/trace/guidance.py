"""The trainer's TRACE port: the step's cache, replayed as guided rounding in every micro-batch.

The Trainer gets one `TraceReplay` at construction (`Trainer(cfg, trace=TraceReplay.for_config(cfg))`) and
asks it, per pass, `begin_pass(micro_batches)` and, per micro-batch, `for_micro_batch(sample_ids,
batch_rows) -> provider or None` (the FP4 linears' guide provider, models/fp4_linear.py). Per step the
rollout side `load`s what trace.exchange delivered to this rank: the cache is validated (version, step,
fingerprint, checksum, site widths; a rejected cache counts in trace/rejected and the batch falls back to
nearest rounding) and indexed for the trainer's layout (TP/SP rank, EP sources, local experts).
The first pass after a load (the loop's log-prob pass) also measures the code mismatch before/after
guidance (trace/code_mismatch_before / _after); `metrics()` reports it with the transfer's numbers.
device_guides=True indexes guide rows on the trainer's device once per pass (trace/device_guides.py);
False selects the host reference (lookup.MicroBatchGuides, per-site lookups), kept for tests.
"""
from __future__ import annotations

from typing import Optional

from .metrics import TraceMetrics


class MeasuringGuides:
    """Wraps the host reference MicroBatchGuides: the same providers, plus mismatch accounting while `measuring`."""

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

    from .lookup import ExpertSources
    from .transport import megatron_ep_group, rows_per_dp_rank

    ep = ps.get_expert_model_parallel_world_size()
    if ep == 1:
        return None
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    _, group = megatron_ep_group(dp_rank, ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
                                 ep, ps.get_expert_tensor_parallel_world_size())
    return ExpertSources(num_samples, rows_per_dp_rank(num_samples, dp, cfg.trainer.micro_batch_size), dp_rank,
                         tuple(group))


class TraceReplay:
    """The trainer's guided rounding from the step's TRACE cache (module docstring)."""

    def __init__(self, cfg, device_guides: bool = True):
        self.cfg, self.device_guides = cfg, device_guides
        self._guides = None
        self._metrics: Optional[TraceMetrics] = None
        self._loaded: dict = {}

    @classmethod
    def for_config(cls, cfg) -> Optional["TraceReplay"]:
        """The replay of a TRACE run (trace.enabled and cached layers), else None."""
        return cls(cfg) if cfg.trace.enabled and cfg.cached_layers() else None

    @classmethod
    def serving(cls, guides) -> "TraceReplay":
        """A replay of guides built elsewhere (a `(sample_ids, batch_rows) -> provider` hook; tests, tools)."""
        replay = cls(None)
        replay.install(guides)
        return replay

    # ------------------------------------------------------------------ per step (the rollout side)
    def load(self, cache, batch, step: int, version: int, timings: dict, metrics: Optional[TraceMetrics] = None
             ) -> None:
        """This rank's cache of `batch` (a RolloutBatch) as the guides of the next passes; None or a rejected
        cache: nearest rounding. timings: the delivery's trace/build_s and trace/transfer_s."""
        from .integrity import accept, config_fingerprint, expected_site_widths

        cfg = self.cfg
        metrics = metrics or TraceMetrics()
        cache = accept(cache, version, step, metrics, expected_shapes=expected_site_widths(cfg),
                       expected_fingerprint=config_fingerprint(cfg))
        loaded = {**timings, "trace/cache_bytes": float(cache.nbytes) if cache is not None else 0.0,
                  "trace/bits_per_element": float(cache.bits_per_element()) if cache is not None else 0.0}
        self.install(self._index(cache, batch, metrics) if cache is not None else None, metrics, loaded)

    def install(self, guides, metrics: Optional[TraceMetrics] = None, loaded: Optional[dict] = None) -> None:
        """Serve `guides` (None: no guidance) from now on; the next pass measures into `metrics`."""
        self._guides, self._metrics, self._loaded = guides, metrics, dict(loaded or {})
        if guides is not None and hasattr(guides, "measuring"):
            guides.measuring = True

    def _index(self, cache, batch, metrics: TraceMetrics):
        from megatron.core import parallel_state as ps

        from megatron_qrl.models import sequence_parallel_enabled

        cfg = self.cfg
        tp, sp = ps.get_tensor_model_parallel_world_size(), sequence_parallel_enabled(cfg)
        seq_len = batch.tokens.shape[1]
        if sp and tp > 1:   # the trainer pads T to a multiple of TP under sequence parallelism (trainer/batch.py)
            seq_len = -(-seq_len // tp) * tp
        layout = dict(tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp, sequence_parallel=sp,
                      metrics=metrics, expert_sources=expert_sources(cfg, batch.tokens.shape[0]))
        if self.device_guides:
            from megatron_qrl.platform import device

            from .device_guides import BatchGuides

            ep, n = ps.get_expert_model_parallel_world_size(), cfg.model.num_experts
            local = (ps.get_expert_model_parallel_rank() * (n // ep), n // ep) if n else (0, 0)
            return BatchGuides(cache, seq_len, batch.r3_expert_ids, local_experts=local, num_experts=n,
                               device=device(), **layout)
        from .lookup import MicroBatchGuides

        return MeasuringGuides(MicroBatchGuides(cache, seq_len, batch.r3_expert_ids, **layout), metrics,
                               cfg.trace.fallback_shift)

    # ------------------------------------------------------------------ per pass / micro-batch (the Trainer)
    def begin_pass(self, micro_batches: list) -> None:
        """micro_batches: every micro-batch's (sample_ids, batch_rows) of the coming pass."""
        if hasattr(self._guides, "prepare"):   # device guides: every micro-batch's rows indexed once per pass
            self._guides.prepare(micro_batches)

    def for_micro_batch(self, sample_ids, batch_rows):
        """The guide provider of one micro-batch (None: nearest rounding)."""
        return self._guides(sample_ids, batch_rows) if self._guides is not None else None

    def end_pass(self) -> None:
        """Only the first pass after a load measures code mismatches (the log-prob pass)."""
        if self._guides is not None and hasattr(self._guides, "measuring"):
            self._guides.measuring = False

    def metrics(self) -> dict:
        """The loaded step's TRACE metrics (docs/trace.md "Metrics"); {} before the first load."""
        measured = self._metrics.as_dict() if self._metrics is not None else {}
        return {**measured, **self._loaded}


def local_replay(cfg, rollouts, batch, step: int = 0, version: int = 0) -> Optional[TraceReplay]:
    """The replay of `rollouts`' own captures, sealed and loaded in this process (what a one-rank exchange
    would deliver; tools and tests outside the RL loop). None when `cfg` has TRACE off."""
    import time

    from .recorder import seal_rollouts

    replay = TraceReplay.for_config(cfg)
    if replay is not None:
        t0 = time.perf_counter()
        cache = seal_rollouts(cfg, rollouts, step, version)
        replay.load(cache, batch, step, version, {"trace/build_s": time.perf_counter() - t0, "trace/transfer_s": 0.0})
    return replay
