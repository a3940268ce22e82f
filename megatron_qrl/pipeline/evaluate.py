"""Held-out accuracy: greedy generation on the eval split, scored by the task's verifier."""
from __future__ import annotations

from typing import Sequence

from megatron_qrl.data import Sample
from megatron_qrl.rl import compute_rewards
from megatron_qrl.rollout.protocol import SamplingParams

from .rollout_batch import encode_prompts


def evaluate(engine, tokenizer, samples: Sequence[Sample], max_new_tokens: int, reward_fn,
             time_limit_s: float = 1.0) -> dict:
    """{'eval/accuracy', 'eval/reward_mean', 'eval/num_prompts'} over `samples` (greedy, AQN as installed)."""
    sampling = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=tokenizer.stop_ids)
    outs = engine.generate(encode_prompts(tokenizer, samples), sampling)
    rewards = compute_rewards([tokenizer.decode(o.tokens) for o in outs], list(samples), reward_fn,
                              time_limit_s=time_limit_s)
    n = max(len(rewards), 1)
    return {"eval/accuracy": sum(r >= 1.0 for r in rewards) / n, "eval/reward_mean": sum(rewards) / n,
            "eval/num_prompts": float(len(rewards))}
