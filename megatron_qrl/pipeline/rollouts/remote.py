"""The trainer ranks' rollouts of a disaggregated job: engine ranks generate, trainer rank 0 commands them.

Per step: trainer rank 0 sends Generate and the weights (BroadcastSync); each engine generates its
contiguous share of the prompt groups (same seeds and sample indices as one engine would use); samples and
rollouts (without TRACE captures) go to every rank; each engine seals the TRACE cache of its samples and
`megatron_qrl.trace.exchange` ships every trainer rank the samples it trains (trace_specs).
"""
from __future__ import annotations

import time
from typing import Optional

from ..commands import Evaluate, Generate, Save, Stop
from ..wire import gather_from_engines
from .protocol import RolloutsContext


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


class RemoteRollouts(RolloutsContext):
    """Trainer ranks' Rollouts: `weights` is the BroadcastSync, `commands` the CommandChannel to the engines."""

    def __init__(self, s, place, weights, commands):
        self.s, self.place, self.weights, self.commands = s, place, weights, commands
        self._build_s = 0.0

    def sync(self, step: int) -> dict:
        self.commands.send(Generate(step))
        return self.weights.push(step)

    def generate(self, prompts: list, step: int, first_index: int = 0):
        if first_index:   # config validation refuses rl.dynamic_sampling here
            raise ValueError("disaggregated engine ranks generate one batch per step (no dynamic sampling)")
        parts = gather_from_engines(None, self.place)
        samples = [x for p in parts for x in p["samples"]]
        rollouts = [x for p in parts for x in p["rollouts"]]
        self._build_s = max(p["trace_build_s"] for p in parts)
        return samples, rollouts, {"rollout/s": max(p["generate_s"] for p in parts)}

    def trace(self, batch, step: int):
        from megatron_qrl.trace import TraceMetrics, exchange

        bridge = self.s.trace
        if not bridge.enabled:
            return None, {}
        metrics = TraceMetrics()
        t0 = time.perf_counter()
        cache = exchange(None, trace_specs(self.s.cfg, self.place, len(batch.rollouts)), metrics=metrics)
        return bridge.guides(cache, batch, step, step, {"trace/build_s": self._build_s,
                                                         "trace/transfer_s": time.perf_counter() - t0}, metrics)

    def idle(self) -> None:
        pass

    def evaluate(self, step: int) -> dict:
        """As ColocatedRollouts.evaluate: the weights after this step's updates, no AQN noise (engine 0 scores)."""
        t0 = time.perf_counter()
        self.commands.send(Evaluate(step))
        self.weights.push(step, aqn=False)
        return {**gather_from_engines(None, self.place)[0], "time/eval_s": time.perf_counter() - t0}

    def save(self, step: int) -> None:
        self.commands.send(Save(step))   # the engine ranks join the collective checkpoint write

    def close(self, error: Optional[type] = None) -> None:
        """The end of the run, or a stop at a step boundary (SystemExit, e.g. the non-finite guard's): release the
        engine ranks from their command loop. After any other exception the engines may sit in another
        collective, so nothing is sent: the launcher (torchrun) tears the job down."""
        if error is None or issubclass(error, SystemExit):
            self.commands.send(Stop())
