"""The step's experience: generate, score, shape the rewards and (DAPO dynamic sampling) refill the batch.

`batch_collector(cfg)` picks the behaviour once; the loop calls `collect(s, rollouts, step) -> (batch, metrics)`.

OneShot          one generate call on the next prompt batch (rl.dynamic_sampling.enabled=false).
DynamicSampling  DAPO: groups whose (shaped) rewards are all equal have zero advantage and no gradient, so
                 they are dropped; further prompt batches are generated until rollout.prompts_per_step groups
                 are kept or rl.dynamic_sampling.max_generate_calls calls were made. The kept groups, in the
                 order they were generated and trimmed to prompts_per_step, form the batch; when the limit
                 leaves it short the step trains on fewer groups, and when no group was kept at all on the
                 last call's groups (all zero advantage: the policy-gradient term vanishes, a KL term acts).
                 Each call's responses get the sample indices after the previous calls' (distinct sampling
                 seeds); rank 0's rewards decide for every rank, so all ranks make the same calls.
Both apply OverlongShaping: DAPO's soft overlong punishment on the rewards the advantages use
(rl.overlong_buffer_len) and the filtering of truncated responses out of the loss (rl.mask_truncated).
The filter sees the shaped rewards but not a KL reward penalty (rl.kl_mode=reward), which needs the
trainer's log-probs and is applied to the assembled batch (pipeline/reference_kl.py).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_qrl.rl import informative_groups, overlong_penalty

from .rollout_batch import RolloutBatch, assemble, score


class OverlongShaping:
    """rl.overlong_buffer_len / overlong_penalty_factor / mask_truncated (rl/overlong.py)."""

    def __init__(self, cfg):
        self.max_len, self.buffer = cfg.rollout.max_new_tokens, cfg.rl.overlong_buffer_len
        self.factor, self.mask_truncated = cfg.rl.overlong_penalty_factor, cfg.rl.mask_truncated

    def shape(self, rollouts: list, rewards: torch.Tensor) -> Optional[torch.Tensor]:
        """The rewards the advantages use (None: the verifiers' rewards unchanged)."""
        if not self.buffer:
            return None
        return rewards + overlong_penalty([len(r.tokens) for r in rollouts], self.max_len, self.buffer, self.factor)

    def metrics(self, batch: RolloutBatch, shaped: Optional[torch.Tensor]) -> dict:
        out = {}
        if shaped is not None:
            out["overlong/penalty_mean"] = float((shaped - batch.rewards).mean())
        if self.mask_truncated:
            out["overlong/masked_frac"] = sum(r.finish_reason == "length" for r in batch.rollouts) / len(batch.rollouts)
        return out


def _tokens_per_s(rollouts: list, seconds: float) -> float:
    return sum(len(r.tokens) for r in rollouts) / max(seconds, 1e-9)


class OneShot:
    """One generate call per step."""

    def __init__(self, cfg):
        self.cfg, self.shaping = cfg, OverlongShaping(cfg)

    def __call__(self, s, rollouts, step: int) -> tuple[RolloutBatch, dict]:
        cfg = self.cfg
        samples, outs, gen_m = rollouts.generate(next(s.prompts), step)
        responses, rewards = score(samples, outs, s.tokenizer, s.reward_fn, cfg.data.reward_time_limit_s)
        shaped = self.shaping.shape(outs, rewards)
        batch = assemble(samples, outs, responses, rewards, s.tokenizer, cfg.rollout.group_size,
                         cfg.rl.normalize_std, shaped, self.shaping.mask_truncated)
        return batch, {**gen_m, **self.shaping.metrics(batch, shaped)}


def _same_on_every_rank(rewards: torch.Tensor) -> torch.Tensor:
    """Rank 0's rewards everywhere: the keep/refill decisions (and so the collective generate calls) must agree
    even if a reward function is not deterministic across processes."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return rewards
    from megatron_qrl.trace.transport import comm_device

    t = rewards.to(comm_device())
    dist.broadcast(t, src=0)
    return t.cpu()


class DynamicSampling:
    """DAPO dynamic sampling (see the module docstring)."""

    def __init__(self, cfg):
        self.cfg, self.shaping = cfg, OverlongShaping(cfg)
        self.max_calls = cfg.rl.dynamic_sampling.max_generate_calls

    def __call__(self, s, rollouts, step: int) -> tuple[RolloutBatch, dict]:
        cfg = self.cfg
        G, wanted = cfg.rollout.group_size, cfg.rollout.prompts_per_step
        kept: list[tuple] = []          # (sample, rollout, response, reward, shaped reward) per kept response
        generated: list = []            # every rollout of the step (throughput, reward of all groups)
        all_rewards: list[torch.Tensor] = []
        calls = dropped = 0
        seconds = 0.0
        while True:
            samples, outs, gen_m = rollouts.generate(next(s.prompts), step, first_index=len(generated))
            calls += 1
            seconds += gen_m["rollout/s"]
            generated += outs
            responses, rewards = score(samples, outs, s.tokenizer, s.reward_fn, cfg.data.reward_time_limit_s)
            rewards = _same_on_every_rank(rewards)
            shaped = self.shaping.shape(outs, rewards)
            shaped = rewards if shaped is None else shaped
            all_rewards.append(rewards)
            keep = informative_groups(shaped, G)
            dropped += int((~keep).sum())
            last = list(zip(samples, outs, responses, rewards, shaped))
            kept += [row for i, row in enumerate(last) if keep[i // G]]
            if len(kept) >= wanted * G or calls >= self.max_calls:
                break
        rows = kept[:wanted * G] or last
        samples, outs, responses, rewards, shaped = (list(x) for x in zip(*rows))
        rewards, shaped = torch.stack(rewards), torch.stack(shaped)
        batch = assemble(samples, outs, responses, rewards, s.tokenizer, G, cfg.rl.normalize_std,
                         shaped if self.shaping.buffer else None, self.shaping.mask_truncated)
        n_kept = len(kept) // G
        metrics = {"rollout/s": seconds, "rollout/tokens_per_s": _tokens_per_s(generated, seconds),
                   "dynamic_sampling/generate_calls": float(calls),
                   "dynamic_sampling/extra_generate_calls": float(calls - 1),
                   "dynamic_sampling/dropped_groups": float(dropped),
                   "dynamic_sampling/kept_groups": float(min(n_kept, wanted)),
                   "dynamic_sampling/batch_full": float(n_kept >= wanted),
                   "dynamic_sampling/reward_mean_generated": float(torch.cat(all_rewards).mean())}
        return batch, {**metrics, **self.shaping.metrics(batch, shaped if self.shaping.buffer else None)}


def batch_collector(cfg):
    """The step's batch builder for this config: OneShot, or DynamicSampling (rl.dynamic_sampling.enabled)."""
    return DynamicSampling(cfg) if cfg.rl.dynamic_sampling.enabled else OneShot(cfg)
