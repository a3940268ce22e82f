"""Loss callbacks for Trainer.train_step. The trainer sums what they return over micro-batches and
data-parallel ranks, so each normalises by the *global* token count (mb["num_global_tokens"]) and scales
its per-micro-batch statistics the same way: the sums are then global means, whatever the layout."""
from __future__ import annotations

import torch

from megatron_qrl.rl import policy_loss


def _global_share(mb: dict) -> float:
    return float(mb["loss_mask"].sum()) / max(float(mb["num_global_tokens"]), 1.0)


def grpo_loss(rl_cfg):
    """Clipped GRPO objective weighted by the per-token IS weights carried in the batch."""

    def loss_fn(logp_new: torch.Tensor, mb: dict):
        loss, stats = policy_loss(logp_new, mb["logp_old"], mb["advantages"], mb["loss_mask"],
                                  mb.get("is_weights"), rl_cfg.clip_low, rl_cfg.clip_high,
                                  num_tokens_global=mb["num_global_tokens"])
        share = _global_share(mb)
        return loss, {"train/loss": loss.detach(),
                      "train/clip_frac": stats["pg/clip_frac"] * share,
                      "train/approx_kl": stats["pg/approx_kl"] * share,
                      "train/ratio_mean": stats["pg/ratio_mean"] * share}

    return loss_fn


def sft_loss(logp_new: torch.Tensor, mb: dict):
    """Token-mean negative log-likelihood of the reference responses."""
    mask = mb["loss_mask"]
    nll = -(torch.where(mask > 0, logp_new, torch.zeros_like(logp_new)) * mask).sum()
    loss = nll / max(float(mb["num_global_tokens"]), 1.0)
    return loss, {"sft/loss": loss.detach()}
