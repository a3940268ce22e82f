"""Train/rollout mismatch metrics as peers log them (METHODS.md section 8).

Tokens come from the rollout policy; per valid token d_t = logp_train_old - logp_rollout, rho_t = exp(d_t):
    mismatch/logp_abs_diff        mean |d_t|
    mismatch/kl_k1                mean -d_t                 k1 estimate of KL(rollout || train)
    mismatch/kl_k3                mean rho_t - 1 - d_t      k3 estimate of the same KL (>= 0, unclipped)
    mismatch/chi2                 mean rho_t^2 - 1          chi-square divergence estimate (variance of rho)
    mismatch/log_ppl_diff         mean over responses of (mean_t logp_rollout - mean_t logp_train_old)
                                  = log PPL_train - log PPL_rollout of each response, averaged
    mismatch/outside_window_frac  tokens whose rho_t lies outside the active IS window
Token means are over the batch's valid tokens, the response mean over responses with at least one valid token.
All are float64 sums and counts all-reduced over `group` (one call): a data-parallel split gives exactly the
single-process numbers.
"""
from __future__ import annotations

import torch

from megatron_qrl.rl.kl import kl_estimate
from megatron_qrl.rl.reduce import global_sums


def mismatch_metrics(log_rho: torch.Tensor, valid: torch.Tensor, window: tuple[float, float],
                     group=None) -> dict[str, float]:
    """`log_rho` float64 [B, T] (0 off `valid`), `valid` bool [B, T], `window` = (lo, hi) inclusive."""
    v = valid.to(torch.float64)
    rho = torch.exp(log_rho)
    lo, hi = window
    outside = ((rho < lo) | (rho > hi)) & valid
    per_row = v.sum(-1)
    rows = per_row > 0
    # mean_t logp_rollout - mean_t logp_train_old = -mean_t d_t, per response
    row_diff = torch.where(rows, -(log_rho * v).sum(-1) / per_row.clamp_min(1.0), torch.zeros_like(per_row))
    n, s_abs, s_k1, s_k3, s_sq, s_out, n_rows, s_ppl = global_sums(
        [v, log_rho.abs() * v, kl_estimate(log_rho, "k1") * v, kl_estimate(log_rho, "k3", clip=False) * v,
         rho * rho * v, outside.to(torch.float64), rows.to(torch.float64), row_diff], group).tolist()
    d = max(n, 1.0)
    return {"mismatch/logp_abs_diff": s_abs / d, "mismatch/kl_k1": s_k1 / d, "mismatch/kl_k3": s_k3 / d,
            "mismatch/chi2": s_sq / d - 1.0 if n else 0.0, "mismatch/log_ppl_diff": s_ppl / max(n_rows, 1.0),
            "mismatch/outside_window_frac": s_out / d}
