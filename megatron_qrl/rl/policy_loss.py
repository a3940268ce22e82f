"""Token-level clipped GRPO/PPO objective with IS weights and an optional KL to a reference.

Per valid token t:  r = exp(logp_new - logp_old),
  pg_t = -min(r*A, clip(r, 1-clip_low, 1+clip_high)*A) * w_t            (w_t: IS weight, section 4)
  kl_t = k(logp_ref - logp_new), k = k1 / k2 / k3 (rl/kl.py; k3 clipped) (only when kl_coef > 0)
  loss = sum_t c_t (pg_t + kl_coef * kl_t)

Coefficients c_t: `token_coef` when given (rl/loss_agg.py: token-mean, seq-mean-token-mean,
seq-mean-token-sum from global counts), else the *global token mean* c_t = 1/N with N = num_tokens_global
(all valid tokens of the optimizer step's batch, over every micro-batch and data-parallel rank) or, without
it, this call's own valid-token count. With global counts the per-micro-batch losses summed over
micro-batches and ranks equal the loss of one process on the whole batch, and so do the summed gradients.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_qrl.rl.importance import _broadcast_tokens
from megatron_qrl.rl.kl import kl_estimate


def policy_loss(logp_new: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                is_weights: Optional[torch.Tensor] = None, clip_low: float = 0.2, clip_high: float = 0.28, *,
                num_tokens_global: Optional[float | int | torch.Tensor] = None,
                token_coef: Optional[torch.Tensor] = None, logp_ref: Optional[torch.Tensor] = None,
                kl_coef: float = 0.0, kl_estimator: str = "k3") -> tuple[torch.Tensor, dict]:
    """(loss, stats). `loss` is a 0-dim tensor with gradient w.r.t. logp_new.

    stats (0-dim detached float64 tensors, no host sync; float(v) to log), means over *this call's* valid
    tokens: pg/loss (the returned loss), pg/pg_loss, pg/clip_frac (tokens where the clipped branch is active),
    pg/clip_frac_low, pg/clip_frac_high, pg/ratio_mean, pg/ratio_max, pg/approx_kl (k3 estimate of
    KL(old||new)), pg/is_weight_mean, pg/num_tokens (count, for weighted averaging across micro-batches),
    and pg/kl_loss (mean KL estimate to the reference) when a reference is used.
    """
    valid = mask.detach().ne(0)
    # bf16 log-probs would make exp(ratio) coarse (~0.4% steps): compute in at least float32
    logp_new = logp_new.to(torch.promote_types(logp_new.dtype, torch.float32))
    zeros = torch.zeros_like(logp_new)
    # masking the inputs (not only the output) keeps NaN/inf at padding out of the forward and the gradient
    log_ratio = torch.where(valid, logp_new - logp_old.detach().to(logp_new.dtype), zeros)
    ratio = torch.exp(log_ratio)
    adv = _broadcast_tokens(advantages.detach(), logp_new).to(logp_new.dtype)
    adv = torch.where(valid, adv, zeros)
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg = -torch.minimum(ratio * adv, clipped * adv)
    if is_weights is not None:
        w = torch.where(valid, is_weights.detach().to(logp_new.dtype), zeros)
        pg = pg * w
    else:
        w = valid.to(logp_new.dtype)
    per_token = pg
    kl = None
    if logp_ref is not None and kl_coef:
        d = torch.where(valid, logp_ref.detach().to(logp_new.dtype) - logp_new, zeros)
        kl = torch.where(valid, kl_estimate(d, kl_estimator, clip=True), zeros)
        per_token = pg + kl_coef * kl

    per_token = torch.where(valid, per_token, zeros)
    if token_coef is not None:
        loss = (per_token * torch.where(valid, token_coef.detach().to(logp_new.dtype), zeros)).sum()
    else:
        if num_tokens_global is None:
            denom = valid.sum().clamp_min(1).to(logp_new.dtype)
        else:
            denom = torch.as_tensor(num_tokens_global, dtype=logp_new.dtype, device=logp_new.device).clamp_min(1)
        loss = per_token.sum() / denom

    with torch.no_grad():
        v = valid.to(torch.float64)
        n = v.sum().clamp_min(1)
        r64, a64, lr64 = ratio.detach().double(), adv.double(), log_ratio.detach().double()
        low = (a64 < 0) & (r64 < 1.0 - clip_low) & valid
        high = (a64 > 0) & (r64 > 1.0 + clip_high) & valid
        stats = {
            "pg/loss": loss.detach().double(),
            "pg/pg_loss": (pg.detach().double() * v).sum() / n,
            "pg/clip_frac": (low | high).double().sum() / n,
            "pg/clip_frac_low": low.double().sum() / n,
            "pg/clip_frac_high": high.double().sum() / n,
            "pg/ratio_mean": (r64 * v).sum() / n,
            "pg/ratio_max": torch.where(valid, r64, torch.zeros_like(r64)).amax() if r64.numel() else n * 0,
            "pg/approx_kl": ((r64 - 1.0 - lr64) * v).sum() / n,
            "pg/is_weight_mean": (w.detach().double() * v).sum() / n,
            "pg/num_tokens": v.sum(),
        }
        if kl is not None:
            stats["pg/kl_loss"] = (kl.detach().double() * v).sum() / n
    return loss, stats
