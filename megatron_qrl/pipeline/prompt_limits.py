"""Prompts must leave room for the response in the model's context: an input error, found before generating.

Why: the engine refuses a prompt longer than model.max_sequence_length - rollout.max_new_tokens with a
ValueError, and the step guard treats engine errors as failures to retry (a restart cannot fix a prompt).
A data file is checked whole at start-up (megatron_qrl.data.inputs.check_prompts_fit, after the chat
template); every batch is checked again here before generation (a prompt set that changes under the run,
a user reward's own prompts).
"""
from __future__ import annotations

from typing import Optional, Sequence

from megatron_qrl.errors import PromptTooLong


def prompt_budget(cfg) -> int:
    """The longest prompt (tokens, BOS included) that leaves room for rollout.max_new_tokens."""
    return cfg.model.max_sequence_length - cfg.rollout.max_new_tokens


def _fixes(cfg) -> str:
    return (f"shorten or drop those prompts, lower rollout.max_new_tokens ({cfg.rollout.max_new_tokens}), or raise "
            f"model.max_sequence_length ({cfg.model.max_sequence_length})")


def overflow(prompts: Sequence[Sequence[int]], cfg) -> Optional[str]:
    """What is wrong with one batch's encoded prompts (None when they fit); checked before generate."""
    budget = prompt_budget(cfg)
    longest = max((len(p) for p in prompts), default=0)
    if longest <= budget:
        return None
    n = sum(len(p) > budget for p in prompts)
    return (f"{n} prompt(s) of this batch are longer than the {budget} tokens the context leaves (the longest has "
            f"{longest} tokens): {_fixes(cfg)}")


def check_encoded(prompts: Sequence[Sequence[int]], cfg) -> None:
    """PromptTooLong unless every prompt fits (one process; StepGuard.generate agrees across ranks itself)."""
    problem = overflow(prompts, cfg)
    if problem:
        raise PromptTooLong(problem)
