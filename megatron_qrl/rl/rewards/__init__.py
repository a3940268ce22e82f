"""Reward verifiers: math final answer, countdown, user 'module:function'. They never raise on model text."""
from megatron_qrl.rl.rewards.compute import compute_rewards, resolve_reward_fn
from megatron_qrl.rl.rewards.countdown import countdown_reward, evaluate_expression, extract_expression
from megatron_qrl.rl.rewards.math_answer import extract_answer, math_reward, parse_number
from megatron_qrl.rl.rewards.user import RewardFunctionError, call_reward_fn, load_reward_fn

__all__ = ["compute_rewards", "resolve_reward_fn", "countdown_reward", "evaluate_expression",
           "extract_expression", "extract_answer", "math_reward", "parse_number", "RewardFunctionError",
           "call_reward_fn", "load_reward_fn"]
