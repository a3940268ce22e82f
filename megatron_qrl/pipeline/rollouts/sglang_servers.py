"""The trainer ranks' rollouts when SGLang servers run outside the job (rollout.engine=sglang, placement
disaggregated): the servers are `rollout.sglang_server_urls` (started by the user, docs/sglang.md), not ranks
of this job, so every job rank trains. Trainer rank 0 alone talks to SGLang: it sends the weights
(SGLangServerSync), generates the whole batch through the router / servers, and broadcasts the samples to
the other trainer ranks. TRACE is refused by the adapter (config validation).
"""
from __future__ import annotations

import time
from typing import Optional

import torch.distributed as dist

from ..evaluate import evaluate
from ..rollout_batch import encode_prompts
from ..wire import broadcast_object
from .protocol import SyncingRollouts


class SGLangServerRollouts(SyncingRollouts):
    """See the module docstring; `weights` is the SGLangServerSync."""

    def generate(self, prompts: list, step: int, first_index: int = 0):
        s = self.s
        t0 = time.perf_counter()
        samples = [p for p in prompts for _ in range(s.cfg.rollout.group_size)]
        mine = samples if dist.get_rank() == 0 else []               # rank 0 asks SGLang for the whole batch
        rollouts = s.guard.generate(encode_prompts(s.tokenizer, mine) if mine else [], s.sampling(step, first_index),
                                    step)
        if dist.get_world_size() > 1:
            rollouts = broadcast_object(rollouts if dist.get_rank() == 0 else None, src=0)
        return samples, rollouts, {"rollout/s": time.perf_counter() - t0}

    def hand_over(self, batch, step: int) -> None:
        """Nothing to hand over: SGLang records no TRACE bits (config validation refuses trace.enabled)."""

    def idle(self) -> None:
        self.weights.drop_retained()                                   # the trainer's turn: drop the payload

    def evaluate(self, step: int) -> dict:
        s = self.s
        self.weights.push(step, aqn=False)   # the weights after this step's updates, no AQN: as `qrl eval`
        m: Optional[dict] = None
        if dist.get_rank() == 0:
            m = evaluate(s.engine, s.tokenizer, s.eval_set, s.cfg.rollout.max_new_tokens, s.reward_fn,
                         s.cfg.data.reward_time_limit_s)
        self.idle()                          # the evaluation's payload is not kept for a restart either
        return broadcast_object(m, src=0) if dist.get_world_size() > 1 else m

    def save(self, step: int) -> None:
        pass   # every rank trains and writes its part

    def close(self, error: Optional[type] = None) -> None:
        if self.s.engine is not None:
            self.s.engine.shutdown()     # launched servers stop; external servers are left running
