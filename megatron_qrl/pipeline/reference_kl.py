"""KL to a frozen reference policy in the RL loop (METHODS.md section 8): rl.kl_coef, kl_estimator, kl_mode.

    kl = reference_kl(s, start)            # once, after resume / warm start, on every rank (collective)
    batch, m = kl.apply(batch, logp_old)   # each step, after the old policy's log-probs

rl.kl_coef = 0 gives NoKL: no reference is built or loaded, nothing is computed or logged. Otherwise
ReferenceKL computes the reference's log-probs of the batch on the trainer (trainer/reference.py: same
layout, same R3 ids, no gradient) and, with l_t = logp_ref - logp, k the chosen estimator (rl/kl.py):
  kl_mode=loss    the batch carries logp_ref; the GRPO loss adds kl_coef * k(logp_ref - logp_new) per token,
                  aggregated like the policy term (pipeline/losses.py)
  kl_mode=reward  each response's reward the advantages use becomes r_i - kl_coef * sum_t k(l_t) with
                  l = logp_ref - logp_train_old, and the GRPO advantages are recomputed (verl's KL in reward)
Logged every step, token means over the batch's valid tokens between the policy that generated the batch
(logp_train_old) and the reference: kl/ref_mean (the chosen estimator), kl/ref_k1, kl/ref_k2, kl/ref_k3
(every rank holds the whole batch: these are the single-process values); kl/reward_penalty_mean in
reward mode; time/ref_logprobs_s.

Which reference: rl.kl_reference (a checkpoint directory, any saved layout), else the initial policy, i.e.
the weights the RL steps start from (after run.init_checkpoint and the SFT warm start). A fresh run writes
them as its step-0 checkpoint (also a resume point that skips the warm start); a resumed run loads the
reference from there.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_qrl.rl import grpo_advantages, kl_estimate
from megatron_qrl.rl.kl import KL_ESTIMATORS

from .rollout_batch import RolloutBatch
from .run_state import mark_latest, step_path


class NoKL:
    """rl.kl_coef = 0: the batch passes through untouched."""

    def apply(self, batch: RolloutBatch, logp_old: torch.Tensor) -> tuple[RolloutBatch, dict]:
        return batch, {}


def kl_metrics(logp_ref: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor, estimator: str) -> dict:
    """Token means of every estimator of KL(pi || pi_ref) at the batch's tokens (sampled from pi)."""
    valid = mask.ne(0)
    l = torch.where(valid, logp_ref.double() - logp.double(), torch.zeros_like(logp, dtype=torch.float64))
    n = max(float(valid.sum()), 1.0)
    means = {k: float(torch.where(valid, kl_estimate(l, k, clip=True), torch.zeros_like(l)).sum()) / n
             for k in KL_ESTIMATORS}
    return {"kl/ref_mean": means[estimator], **{f"kl/ref_{k}": v for k, v in means.items()}}


def kl_reward_penalty(logp_ref: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor, estimator: str,
                      coef: float) -> torch.Tensor:
    """kl_coef * sum_t k(logp_ref - logp) over each response's valid tokens, float32 [B]."""
    valid = mask.ne(0)
    l = torch.where(valid, logp_ref.double() - logp.double(), torch.zeros_like(logp, dtype=torch.float64))
    k = torch.where(valid, kl_estimate(l, estimator, clip=True), torch.zeros_like(l))
    return (coef * k.sum(-1)).to(torch.float32)


class ReferenceKL:
    """The reference's log-probs each step, used as a loss term or a reward penalty (module docstring)."""

    def __init__(self, reference, cfg):
        self.reference, self.cfg = reference, cfg

    def apply(self, batch: RolloutBatch, logp_old: torch.Tensor) -> tuple[RolloutBatch, dict]:
        from .setup import trainer_batch

        rl = self.cfg.rl
        t0 = time.perf_counter()
        logp_ref = self.reference.logprobs(trainer_batch(batch))   # no TRACE guides (trainer/reference.py)
        m = {**kl_metrics(logp_ref, logp_old, batch.loss_mask, rl.kl_estimator),
             "time/ref_logprobs_s": time.perf_counter() - t0}
        if rl.kl_mode == "loss":
            return dataclasses.replace(batch, logp_ref=logp_ref), m
        penalty = kl_reward_penalty(logp_ref, logp_old, batch.loss_mask, rl.kl_estimator, rl.kl_coef)
        base = batch.rewards if batch.train_rewards is None else batch.train_rewards
        rewards = base - penalty
        advantages = grpo_advantages(rewards, self.cfg.rollout.group_size, normalize_std=rl.normalize_std)
        m["kl/reward_penalty_mean"] = float(penalty.mean())
        return dataclasses.replace(batch, advantages=advantages, train_rewards=rewards), m


def _write_initial_policy(s, path: Path) -> None:
    """The RL start's weights as the step-0 checkpoint (collective; engine ranks of a disaggregated job join)."""
    s.side.save(str(path), {"step": 0, "data": s.prompts.state_dict()})   # job.TrainerSide / EngineSide
    if dist.get_rank() == 0:
        mark_latest(s.cfg.run.output_dir, path)
    dist.barrier()


def reference_kl(s, start: int):
    """NoKL, or the ReferenceKL of this run (see the module docstring). Call on every rank: writing or loading
    the reference is collective; ranks without a trainer get NoKL."""
    from megatron_qrl.trainer.reference import ReferencePolicy

    rl = s.cfg.rl
    if rl.kl_coef == 0:
        return NoKL()
    path = Path(rl.kl_reference) if rl.kl_reference else step_path(s.cfg.run.output_dir, 0)
    if rl.kl_reference is None and start == 0:   # the weights in memory are the initial policy
        _write_initial_policy(s, path)
        ref = ReferencePolicy(s.trainer, rl.kl_reference_offload) if s.side.trains else None
    else:
        if rl.kl_reference and not path.is_dir():
            raise FileNotFoundError(f"rl.kl_reference '{path}' is not a directory: point it at a checkpoint "
                                    "(a run's checkpoints/step_N, or `qrl convert hf-to-mcore` output)")
        if not path.is_dir():
            raise FileNotFoundError(f"the initial policy '{path}' (the run's step-0 checkpoint, the default KL "
                                    f"reference) does not exist: the run resumed at step {start} but started "
                                    "with the KL off; set rl.kl_reference to a checkpoint directory")
        ref = ReferencePolicy.from_checkpoint(s.trainer, path, rl.kl_reference_offload)
    return ReferenceKL(ref, s.cfg) if ref is not None else NoKL()
