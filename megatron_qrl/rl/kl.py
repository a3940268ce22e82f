"""Per-token KL estimators from samples (METHODS.md section 8; Schulman's k1 / k2 / k3).

Tokens are drawn from a policy p; q is the other policy; l_t = log q(t) - log p(t). Then
    k1 = -l            unbiased for KL(p || q), high variance, can be negative per token
    k2 = l^2 / 2       biased, low variance (verl's "mse")
    k3 = e^l - 1 - l   unbiased, >= 0, low variance (verl's "low_var_kl")
Two uses share these functions: the KL to a reference (p = the policy, q = the reference:
l = logp_ref - logp) and the train/rollout mismatch metrics (p = the rollout engine, q = the trainer:
l = logp_train_old - logp_rollout).

Clipping (`clip=True`, what the KL-to-reference term uses, as peers do): k3 is clipped to [-10, 10], and l is
clamped to [-20, 20] before exp. The clamp does not change the clipped k3 (|l| >= 20 gives k3 >= 10 already)
but keeps exp finite, so the gradient is 0 there instead of 0 * inf = NaN.
"""
from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")
# peers' names (verl's kl_loss_type / kl_penalty) -> ours
KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
K3_CLIP = 10.0
LOG_RATIO_CLAMP = 20.0


def canonical_estimator(name: str) -> str:
    """'k1' / 'k2' / 'k3' for one of ours or a peer alias; ValueError naming the choices otherwise."""
    key = str(name).lower()
    key = KL_ALIASES.get(key, key)
    if key not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator '{name}'; choose one of {', '.join(KL_ESTIMATORS)} "
                         f"(verl's names {', '.join(KL_ALIASES)} are accepted too)")
    return key


def kl_estimate(log_ratio: torch.Tensor, estimator: str = "k3", clip: bool = True) -> torch.Tensor:
    """Per-token estimate for l = log q - log p at tokens sampled from p (same shape as `log_ratio`)."""
    est = canonical_estimator(estimator)
    if est == "k1":
        return -log_ratio
    if est == "k2":
        return 0.5 * log_ratio * log_ratio
    lr = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) if clip else log_ratio
    k3 = torch.expm1(lr) - lr          # e^l - 1 - l; expm1 keeps it >= 0 where l is a rounding error from 0
    return k3.clamp(-K3_CLIP, K3_CLIP) if clip else k3
