"""From prompts to a trainer batch: GRPO groups, engine generation, rewards, advantages, token alignment.

Alignment (the one rule everything below follows): a sequence is prompt_ids + response tokens. The
trainer's logp[:, t] is log p(tokens[t] | tokens[:t]); response token j sits at position P + j, so
logp_rollout[:, P + j] = rollout.logprobs[j] and loss_mask[:, P + j] = 1. R3 ids: the engine's row i is the
forward of input position i (P + T - 1 rows); the trainer also forwards the last token and the padding,
whose outputs reach no loss term, and those rows replay ids 0..k-1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megatron_qrl.data import Sample
from megatron_qrl.rl import compute_rewards, grpo_advantages
from megatron_qrl.rollout.protocol import RolloutEngine, RolloutSample, SamplingParams


@dataclass
class RolloutBatch:
    """One RL step's experience, identical on every rank."""

    samples: list[Sample]            # one per response (each prompt repeated group_size times)
    rollouts: list[RolloutSample]
    responses: list[str]
    rewards: torch.Tensor            # [B]
    advantages: torch.Tensor         # [B]
    tokens: torch.Tensor             # long [B, T]
    loss_mask: torch.Tensor          # float [B, T]
    logp_rollout: torch.Tensor       # float [B, T] (0 off the response)
    r3_expert_ids: Optional[torch.Tensor]  # long [B, T, L, k] or None
    prompt_lens: list[int]
    r3_mask: Optional[torch.Tensor] = None  # float [B, T]: 1 where the engine routed the token (its R3 ids are real)
    logp_ref: Optional[torch.Tensor] = None  # float [B, T]: the reference policy's log-probs (rl.kl_mode=loss)
    train_rewards: Optional[torch.Tensor] = None  # [B]: the rewards the advantages use, when not `rewards`
                                                  # (overlong shaping, a KL reward penalty)

    @property
    def num_response_tokens(self) -> int:
        return int(self.loss_mask.sum())


def encode_prompts(tokenizer, samples: Sequence[Sample]) -> list[list[int]]:
    """The ids generation starts from (the tokenizer's encode_prompt: chat template when it has one)."""
    return [tokenizer.encode_prompt(s.prompt) for s in samples]


def generate(engine: RolloutEngine, tokenizer, prompts: Sequence[Sample], group_size: int,
             sampling: SamplingParams) -> tuple[list[Sample], list[RolloutSample]]:
    """Each prompt repeated group_size times (group-contiguous, as grpo_advantages expects)."""
    samples = [s for s in prompts for _ in range(group_size)]
    return samples, engine.generate(encode_prompts(tokenizer, samples), sampling)


def _r3_ids(rollouts: list[RolloutSample], T: int) -> Optional[torch.Tensor]:
    if any(r.routed_experts is None for r in rollouts):
        return None
    L, k = rollouts[0].routed_experts.shape[1:]
    ids = torch.arange(k).expand(len(rollouts), T, L, k).clone()
    for i, r in enumerate(rollouts):
        ids[i, :r.num_forwarded] = r.routed_experts.long()
    return ids


def score(samples: list[Sample], rollouts: list[RolloutSample], tokenizer, reward_fn,
          time_limit_s: float = 1.0) -> tuple[list[str], torch.Tensor]:
    """(decoded responses, float32 rewards [B]) from the verifiers."""
    responses = [tokenizer.decode(r.tokens) for r in rollouts]
    rewards = torch.tensor(compute_rewards(responses, samples, reward_fn, time_limit_s=time_limit_s),
                           dtype=torch.float32)
    return responses, rewards


def assemble(samples: list[Sample], rollouts: list[RolloutSample], responses: list[str], rewards: torch.Tensor,
             tokenizer, group_size: int, normalize_std: bool, shaped_rewards: Optional[torch.Tensor] = None,
             mask_truncated: bool = False) -> RolloutBatch:
    """GRPO advantages (from `shaped_rewards` when given, e.g. with the overlong penalty; `rewards` stay the
    verifiers' for logging) and the padded trainer tensors. mask_truncated: responses that hit the length
    limit (finish_reason "length") get loss_mask 0 (DAPO's overlong filtering; their rewards still count in
    their group's advantages)."""
    advantages = grpo_advantages(rewards if shaped_rewards is None else shaped_rewards, group_size,
                                 normalize_std=normalize_std)
    T = max(len(r.prompt_ids) + len(r.tokens) for r in rollouts)
    B = len(rollouts)
    tokens = torch.full((B, T), tokenizer.pad_id, dtype=torch.long)
    loss_mask = torch.zeros(B, T)
    logp = torch.zeros(B, T)
    for i, r in enumerate(rollouts):
        seq = r.sequence
        tokens[i, :len(seq)] = torch.tensor(seq)
        P, n = len(r.prompt_ids), len(r.tokens)
        loss_mask[i, P:P + n] = 0.0 if (mask_truncated and r.finish_reason == "length") else 1.0
        if r.logprobs is not None:
            logp[i, P:P + n] = r.logprobs.float().cpu()
    r3_ids = _r3_ids(rollouts, T)
    r3_mask = (torch.arange(T)[None, :] < torch.tensor([r.num_forwarded for r in rollouts])[:, None]).float() \
        if r3_ids is not None else None
    return RolloutBatch(samples, rollouts, responses, rewards, advantages, tokens, loss_mask, logp,
                        r3_ids, [len(r.prompt_ids) for r in rollouts], r3_mask, train_rewards=shaped_rewards)


def build_batch(samples: list[Sample], rollouts: list[RolloutSample], tokenizer, group_size: int,
                normalize_std: bool, reward_fn, time_limit_s: float = 1.0) -> RolloutBatch:
    """Rewards (verifiers), GRPO advantages and the padded trainer tensors."""
    responses, rewards = score(samples, rollouts, tokenizer, reward_fn, time_limit_s)
    return assemble(samples, rollouts, responses, rewards, tokenizer, group_size, normalize_std)


def sft_batch(samples: Sequence[Sample], tokenizer) -> dict:
    """Prompt (as generation sees it) + reference response + EOS, loss on the response tokens and the EOS
    (the SFT warm start)."""
    seqs, prompt_lens = [], []
    for s in samples:
        p = tokenizer.encode_prompt(s.prompt)
        seqs.append(p + tokenizer.encode(s.response) + [tokenizer.eos_id])
        prompt_lens.append(len(p))
    T = max(map(len, seqs))
    tokens = torch.full((len(seqs), T), tokenizer.pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), T)
    for i, (seq, P) in enumerate(zip(seqs, prompt_lens)):
        tokens[i, :len(seq)] = torch.tensor(seq)
        mask[i, P:len(seq)] = 1.0
    return {"tokens": tokens, "loss_mask": mask}
