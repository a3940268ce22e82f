"""One entry point from (responses, samples, task or reward function) to a list of float rewards."""
from __future__ import annotations

from typing import Any, Callable, Sequence

from megatron_qrl.rl.rewards.countdown import countdown_reward
from megatron_qrl.rl.rewards.math_answer import math_reward
from megatron_qrl.rl.rewards.math_verify_reward import math_verify_reward, require_math_verify
from megatron_qrl.rl.rewards.user import RewardFunctionError, call_reward_fn, load_reward_fn

# tasks whose answer is one final number
MATH_TASKS = ("math", "arithmetic", "gsm8k", "jsonl", "parquet")


def _field(sample: Any, name: str, default=None):
    """sample.name, sample[name], or sample.meta[name] / sample['meta'][name]."""
    if isinstance(sample, dict):
        if name in sample:
            return sample[name]
        meta = sample.get("meta")
    else:
        if hasattr(sample, name):
            return getattr(sample, name)
        meta = getattr(sample, "meta", None)
    if isinstance(meta, dict) and name in meta:
        return meta[name]
    return default


def _math(response, sample) -> float:
    answer = _field(sample, "answer")
    return 0.0 if answer is None else math_reward(response, answer)


def _math_verify(response, sample) -> float:
    return math_verify_reward(response, _field(sample, "answer"))


def _countdown(response, sample) -> float:
    numbers, target = _field(sample, "numbers"), _field(sample, "target")
    if numbers is None or target is None:
        return 0.0
    return countdown_reward(response, numbers, target, bool(_field(sample, "require_all", False)))


def resolve_reward_fn(reward: str | Callable) -> tuple[Callable, bool]:
    """(fn(response, sample) -> float, time_limited) for a task name, 'module:function' or a callable; user
    functions and math_verify (symbolic, can be slow) run under the per-sample time limit."""
    if callable(reward):
        return reward, True
    if isinstance(reward, str):
        if reward in MATH_TASKS:
            return _math, False
        if reward == "countdown":
            return _countdown, False
        if reward == "math_verify":
            require_math_verify()
            return _math_verify, True
        if ":" in reward:
            return load_reward_fn(reward), True
    raise RewardFunctionError(f"unknown reward '{reward}': use a task ({', '.join(MATH_TASKS)}, countdown), "
                              "math_verify, "
                              "'module:function', or a callable")


def compute_rewards(responses: Sequence[str], samples: Sequence[Any], reward_fn: str | Callable = "math",
                    time_limit_s: float = 1.0) -> list[float]:
    """Score each response against its sample; malformed outputs score 0.0 and never raise.

    reward_fn: a built-in task name, a user 'module:function' (time-limited per sample to time_limit_s,
    0 = unlimited), or a callable. len(responses) must equal len(samples) (a caller bug otherwise).
    """
    if len(responses) != len(samples):
        raise ValueError(f"{len(responses)} responses for {len(samples)} samples: pass one sample per response "
                         "(repeat each prompt's sample group_size times)")
    fn, user = resolve_reward_fn(reward_fn)
    if user:
        return [call_reward_fn(fn, r, s, time_limit_s) for r, s in zip(responses, samples)]
    return [call_reward_fn(fn, r, s) for r, s in zip(responses, samples)]
