"""Loss callbacks for Trainer.train_step. The trainer sums what they return over micro-batches and
data-parallel ranks, so each normalises by *global* counts (mb["num_global_tokens"], mb["num_loss_sequences"])
and scales its per-micro-batch statistics the same way: the sums are then global means, whatever the layout."""
from __future__ import annotations

import torch

from megatron_qrl.rl import policy_loss
from megatron_qrl.rl.entropy import masked_token_mean
from megatron_qrl.rl.loss_agg import check_mode, token_coefficients


def _global_share(mb: dict) -> float:
    return float(mb["loss_mask"].sum()) / max(float(mb["num_global_tokens"]), 1.0)


def loss_normaliser(mode: str):
    """mb -> the policy_loss keywords that make rl.loss_agg_mode's global normalisation (rl/loss_agg.py)."""
    check_mode(mode)
    if mode == "token-mean":
        return lambda mb: {"num_tokens_global": mb["num_global_tokens"]}

    def per_sequence(mb: dict) -> dict:
        if "num_loss_sequences" not in mb:
            raise KeyError(f"rl.loss_agg_mode={mode} needs batch['num_loss_sequences'] (responses with a valid "
                           "token in the whole batch): build the batch with pipeline.trainer_batch")
        return {"token_coef": token_coefficients(mb["loss_mask"], mode, mb["num_global_tokens"],
                                                 mb["num_loss_sequences"])}

    return per_sequence


def grpo_loss(rl_cfg):
    """Clipped GRPO objective weighted by the per-token IS weights carried in the batch, normalised as
    rl.loss_agg_mode says, plus rl.kl_coef * KL to the reference when the batch carries logp_ref
    (rl.kl_mode=loss; pipeline/reference_kl.py puts it there). With the trainer's per-token policy entropy in
    mb['policy_entropy'] it also reports `policy/entropy`, its global token mean over the response tokens."""
    normalise = loss_normaliser(rl_cfg.loss_agg_mode)
    kl_coef = rl_cfg.kl_coef if rl_cfg.kl_mode == "loss" else 0.0

    def loss_fn(logp_new: torch.Tensor, mb: dict):
        loss, stats = policy_loss(logp_new, mb["logp_old"], mb["advantages"], mb["loss_mask"],
                                  mb.get("is_weights"), rl_cfg.clip_low, rl_cfg.clip_high, **normalise(mb),
                                  logp_ref=mb.get("logp_ref"), kl_coef=kl_coef, kl_estimator=rl_cfg.kl_estimator)
        share = _global_share(mb)
        out = {"train/loss": loss.detach(),
               "train/clip_frac": stats["pg/clip_frac"] * share,
               "train/approx_kl": stats["pg/approx_kl"] * share,
               "train/ratio_mean": stats["pg/ratio_mean"] * share}
        if "pg/kl_loss" in stats:
            out["train/kl_loss"] = stats["pg/kl_loss"] * share
        if mb.get("policy_entropy") is not None:   # the trainer's EntropyProbe (last pipeline stage)
            out["policy/entropy"] = masked_token_mean(mb["policy_entropy"].to(logp_new.device), mb["loss_mask"],
                                                      mb["num_global_tokens"])
        return loss, out

    return loss_fn


def sft_loss(logp_new: torch.Tensor, mb: dict):
    """Token-mean negative log-likelihood of the reference responses."""
    mask = mb["loss_mask"]
    nll = -(torch.where(mask > 0, logp_new, torch.zeros_like(logp_new)) * mask).sum()
    loss = nll / max(float(mb["num_global_tokens"]), 1.0)
    return loss, {"sft/loss": loss.detach()}
