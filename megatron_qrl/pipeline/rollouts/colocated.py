"""Colocated rollouts: every rank holds an engine and generates its data-parallel share of the prompts."""
from __future__ import annotations

import time
from typing import Optional

import torch.distributed as dist

from megatron_qrl.trace.recorder import without_captures

from ..evaluate import evaluate
from ..rollout_batch import encode_prompts
from ..wire import all_gather_objects
from .hand_over import hand_over_to_replay
from .protocol import SyncingRollouts


def engine_share(num_prompts: int, engine_index: int, num_engines: int) -> tuple[int, int]:
    """[first, stop) prompt indices engine `engine_index` generates (contiguous, like data parallel)."""
    per = -(-num_prompts // num_engines)
    return min(num_prompts, engine_index * per), min(num_prompts, (engine_index + 1) * per)


def generate_shard(s, prompts: list, step: int, first_index: int = 0):
    """Each rank's engine generates a contiguous share of the prompt groups (the same shares, seeds and
    sample indices as that many disaggregated engines); all ranks get all. Sample indices start at
    first_index (a step's later generate calls draw fresh seeds). The samples travel without TRACE captures:
    those stay with the engine's recorder, a handle each travels (hand_over seals them)."""
    G = s.cfg.rollout.group_size
    rank, world = dist.get_rank(), dist.get_world_size()
    first, stop = engine_share(len(prompts), rank, world)
    samples = [p for p in prompts[first:stop] for _ in range(G)]
    sampling = s.sampling(step, index_offset=first_index + first * G)
    rollouts = s.guard.generate(encode_prompts(s.tokenizer, samples), sampling, step)  # restarts a failed engine
    rollouts = without_captures(rollouts)
    if world > 1:
        parts = all_gather_objects((samples, rollouts))
        samples = [x for p in parts for x in p[0]]
        rollouts = [x for p in parts for x in p[1]]
    return samples, rollouts


class ColocatedRollouts(SyncingRollouts):
    """Every rank runs an engine over its data-parallel share (generate_shard); `weights` is its WeightSync."""

    def generate(self, prompts: list, step: int, first_index: int = 0):
        t0 = time.perf_counter()
        samples, rollouts = generate_shard(self.s, prompts, step, first_index)
        return samples, rollouts, {"rollout/s": time.perf_counter() - t0}

    def hand_over(self, batch, step: int) -> None:
        """Every rank's engine seals its samples of the batch; the exchange gives each trainer rank its part."""
        s = self.s
        if s.trainer.trace is None:   # TRACE off (the same on every rank)
            return
        t0 = time.perf_counter()
        cache = s.engine.trace_recorder.seal([r.trace_handle for r in batch.rollouts], step)
        hand_over_to_replay(s, s.placement, cache, batch, step, time.perf_counter() - t0)

    def idle(self) -> None:
        self.s.engine_idle()   # the engine gives its memory back while the trainer runs

    def evaluate(self, step: int) -> dict:
        """Held-out accuracy of the weights after this step's updates, without AQN noise: exactly what
        `qrl eval` reports for the checkpoint written after this step (same FP4 bytes, greedy decoding)."""
        s = self.s
        t0 = time.perf_counter()
        self.weights.push(step, aqn=False)
        out = evaluate(s.engine, s.tokenizer, s.eval_set, s.cfg.rollout.max_new_tokens, s.reward_fn,
                       s.cfg.data.reward_time_limit_s)
        return {**out, "time/eval_s": time.perf_counter() - t0}

    def save(self, step: int) -> None:
        pass   # every rank writes its own part of the checkpoint already

    def close(self, error: Optional[type] = None) -> None:
        pass
