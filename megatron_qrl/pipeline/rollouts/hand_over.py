"""TRACE's one transport, shared by every placement: each engine's recorder seals the cache of its samples,
`megatron_qrl.trace.exchange` ships every trainer rank the samples it trains (trace_specs), and a trainer rank's
replay (given to its Trainer at construction) loads what it received. Colocated and disaggregated runs alike.
"""
from __future__ import annotations

import time
from typing import Optional


def trace_active(cfg) -> bool:
    """Whether this run records and replays TRACE (the engines record, the trainer ranks hold a replay); every
    rank of the job decides the same, so all or none join the exchange."""
    return bool(cfg.trace.enabled and cfg.cached_layers())


def trace_specs(cfg, place, num_samples: int) -> dict:
    """rank -> ShardSpec: each trainer rank receives the samples its data-parallel split trains (full
    hidden width: under tensor parallelism the trainer's MicroBatchGuides slices row-parallel sites) and,
    under expert parallelism, its own experts' rows for every sample of its EP group."""
    from megatron_qrl.trace import ShardSpec

    t = cfg.trainer
    dp = place.num_trainers // (t.tensor_parallel * t.pipeline_parallel)
    # Megatron's rank order tp-cp-ep-dp-pp (cp = 1): rank = tp_rank + tp * (dp_rank + dp * pp_rank)
    return {r: ShardSpec.for_rank(num_samples, dp_rank=(r // t.tensor_parallel) % dp, dp_size=dp,
                                  micro_batch_size=t.micro_batch_size, tp_rank=r % t.tensor_parallel,
                                  tp_size=t.tensor_parallel, num_experts=cfg.model.num_experts,
                                  ep_size=t.expert_parallel, etp_size=t.expert_tensor_parallel)
            for r in range(place.num_trainers)}


def exchange_trace(cfg, place, cache, num_samples: int, metrics=None) -> tuple[Optional[object], float]:
    """Join trace.exchange with the cache this rank's engine sealed (None: no engine here); returns (what this
    rank received, None on an engine rank; the transfer time)."""
    from megatron_qrl.trace import exchange

    t0 = time.perf_counter()
    received = exchange(cache, trace_specs(cfg, place, num_samples), metrics=metrics)
    return received, time.perf_counter() - t0


def hand_over_to_replay(s, place, cache, batch, step: int, build_s: float) -> None:
    """A trainer rank's side: exchange (with its own engine's sealed cache, colocated; None, disaggregated) and
    load its part of `batch`'s cache into the trainer's replay."""
    from megatron_qrl.trace import TraceMetrics

    replay = s.trainer.trace
    metrics = TraceMetrics()
    received, transfer_s = exchange_trace(s.cfg, place, cache, len(batch.rollouts), metrics)
    replay.load(received, batch, step, step, {"trace/build_s": build_s, "trace/transfer_s": transfer_s}, metrics)
