"""RL algorithms: GRPO advantages, clipped policy loss, IS corrections (TIS/MIS/IcePop/AIS at token or
sequence level), mismatch metrics, KL estimators, loss aggregation, DAPO filters, AQN, rewards.

Pure torch, no Megatron import: the trainer calls these inside its loss function. Statistics that must be
global across data-parallel ranks take a `group` (a torch.distributed process group). See docs/rl.md.
"""
from megatron_qrl.rl.advantages import grpo_advantages
from megatron_qrl.rl.aqn import aqn_noise, aqn_sigma, aqn_stage
from megatron_qrl.rl.group_filter import informative_groups
from megatron_qrl.rl.importance import LEVELS as IS_LEVELS
from megatron_qrl.rl.importance import METHODS as IS_METHODS
from megatron_qrl.rl.importance import ais_alpha, is_weights
from megatron_qrl.rl.kl import KL_ESTIMATORS, kl_estimate
from megatron_qrl.rl.loss_agg import LOSS_AGG_MODES, count_loss_sequences, token_coefficients
from megatron_qrl.rl.mismatch import mismatch_metrics
from megatron_qrl.rl.overlong import overlong_penalty
from megatron_qrl.rl.policy_loss import policy_loss
from megatron_qrl.rl.reduce import count_valid_tokens
from megatron_qrl.rl.rewards import RewardFunctionError, compute_rewards, load_reward_fn

__all__ = ["grpo_advantages", "aqn_noise", "aqn_sigma", "aqn_stage", "informative_groups", "IS_LEVELS",
           "IS_METHODS", "ais_alpha", "is_weights", "KL_ESTIMATORS", "kl_estimate", "LOSS_AGG_MODES",
           "count_loss_sequences", "token_coefficients", "mismatch_metrics", "overlong_penalty", "policy_loss",
           "count_valid_tokens", "compute_rewards", "load_reward_fn", "RewardFunctionError"]
