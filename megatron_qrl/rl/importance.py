"""Importance-sampling corrections of the rollout/train mismatch (METHODS.md section 4).

rho_t = exp(logp_train_old - logp_rollout) per valid token. Methods:
  none    w = 1
  tis     w = min(rho, tis_C)
  mis     w = rho * 1[1/mis_U <= rho <= mis_U] per token, or per sequence with rho_seq = geometric mean of
          the sequence's token rhos (mis_level=sequence); mask_weight=one keeps w = 1 instead of rho
  icepop  w = rho * 1[icepop_low <= rho <= icepop_high]  (mask_weight=one: w = 1 inside)
  ais     w = 1 + alpha * (min(rho, C) - 1), alpha from batch statistics (see `ais_alpha`)
Weights are detached and 0 at mask==0 positions. All batch statistics are sums/counts in float64,
all-reduced over ``group`` so data-parallel shards reproduce the single-process result.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from megatron_qrl.rl.reduce import all_reduce_max, global_sums

METHODS = ("none", "tis", "mis", "icepop", "ais")

_DEFAULTS = {"C": 2.0, "delta": 0.05, "gamma": 1.0, "beta": 0.5, "tis_C": 2.0, "mis_U": 2.0,
             "mis_level": "token", "icepop_low": 0.5, "icepop_high": 2.0, "mask_weight": "rho"}
_STD_A_ZERO = 1e-12  # std(A) at or below this is "no advantage spread": alpha_var = 0


def cfg_get(cfg: Any, name: str, default=None):
    """Read `name` from a dict, a dataclass/pydantic object, or an RLConfig's nested `ais` section."""
    default = _DEFAULTS.get(name) if default is None else default
    if cfg is None:
        return default
    if isinstance(cfg, dict):
        if name in cfg:
            return cfg[name]
        sub = cfg.get("ais")
    else:
        if hasattr(cfg, name):
            return getattr(cfg, name)
        sub = getattr(cfg, "ais", None)
    return cfg_get(sub, name, default) if sub is not None else default


def _broadcast_tokens(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-sample [B] tensor repeated over tokens -> [B, T]."""
    x = torch.as_tensor(x, device=like.device)
    if x.dim() == 1 and like.dim() == 2:
        x = x[:, None]
    return x.expand_as(like)


def ais_alpha(wbar: torch.Tensor, absdiff: torch.Tensor, adv: torch.Tensor, valid: torch.Tensor, cfg,
              group=None) -> dict[str, float]:
    """alpha and its factors from the batch's valid tokens (float64 inputs, `valid` boolean).

    alpha_ess = (1 + CV^2(wbar))^-1/2, alpha_mis = min(1, mean|d| / delta),
    alpha_var = max(0, (std(wbar*A)/std(A) - gamma)/gamma), alpha = clip(alpha_ess - beta*alpha_var, 0, 1)*alpha_mis.
    Population statistics via two passes (sums, then centred sums of squares). Conventions that avoid NaN:
    empty batch -> alpha_ess=1, alpha_mis=0 (alpha=0); mean(wbar)==0 -> alpha_ess=0; std(A)==0 -> alpha_var=0.
    """
    delta, gamma, beta = (float(cfg_get(cfg, k)) for k in ("delta", "gamma", "beta"))
    if delta <= 0 or gamma <= 0 or beta < 0:
        raise ValueError(f"AIS needs delta > 0, gamma > 0, beta >= 0 (got {delta}, {gamma}, {beta}): rl.ais.*")
    v = valid.to(torch.float64)
    wa = wbar * adv
    n, s_w, s_d, s_a, s_wa = global_sums([v, wbar * v, absdiff * v, adv * v, wa * v], group).tolist()
    if n == 0:
        return {"ais/alpha": 0.0, "ais/alpha_ess": 1.0, "ais/alpha_mis": 0.0, "ais/alpha_var": 0.0,
                "ais/cv": 0.0, "ais/dsigma": 0.0, "ais/dbar": 0.0}
    m_w, m_a, m_wa = s_w / n, s_a / n, s_wa / n
    q_w, q_a, q_wa = global_sums([(wbar - m_w) ** 2 * v, (adv - m_a) ** 2 * v, (wa - m_wa) ** 2 * v],
                                 group).tolist()
    std_w, std_a, std_wa = math.sqrt(q_w / n), math.sqrt(q_a / n), math.sqrt(q_wa / n)
    if m_w > 0:
        cv = std_w / m_w
        alpha_ess = (1.0 + cv * cv) ** -0.5
    else:
        cv, alpha_ess = math.inf, 0.0
    dbar = s_d / n
    alpha_mis = min(1.0, dbar / delta)
    if std_a > _STD_A_ZERO:
        dsigma = std_wa / std_a
        alpha_var = max(0.0, (dsigma - gamma) / gamma)
    else:
        dsigma, alpha_var = 0.0, 0.0
    alpha = min(1.0, max(0.0, alpha_ess - beta * alpha_var)) * alpha_mis
    return {"ais/alpha": alpha, "ais/alpha_ess": alpha_ess, "ais/alpha_mis": alpha_mis,
            "ais/alpha_var": alpha_var, "ais/cv": cv, "ais/dsigma": dsigma, "ais/dbar": dbar}


def _seq_rho(log_rho: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Geometric-mean sequence ratio exp(mean_t log rho_t) over each row's valid tokens, [B, 1]."""
    v = valid.to(log_rho.dtype)
    cnt = v.sum(-1, keepdim=True).clamp_min(1)
    return torch.exp((log_rho * v).sum(-1, keepdim=True) / cnt)


def is_weights(logp_train_old: torch.Tensor, logp_rollout: torch.Tensor, advantages: torch.Tensor,
               mask: torch.Tensor, method: str, cfg: Any = None, group=None) -> tuple[torch.Tensor, dict]:
    """Per-token IS weights [B, T] (detached, 0 where mask==0) and a stats dict of python floats.

    Stats for every method: is/weight_mean, is/masked_frac, is/rho_mean, is/rho_min, is/rho_max,
    is/truncated_frac (rho > C for tis/ais), mismatch/logp_abs_diff, mismatch/k3 (KL(rollout||train)
    estimate), is/num_tokens; for ais also ais/alpha, ais/alpha_ess, ais/alpha_mis, ais/alpha_var, ais/cv,
    ais/dsigma, ais/dbar. All are means over the whole (all-reduced) batch's valid tokens.
    """
    method = (method or "none").lower()
    if method not in METHODS:
        raise ValueError(f"unknown IS method '{method}'; choose one of {', '.join(METHODS)} (rl.is_method)")
    if logp_train_old.shape != logp_rollout.shape or logp_train_old.shape != mask.shape:
        raise ValueError(f"shape mismatch: logp_train_old {tuple(logp_train_old.shape)}, logp_rollout "
                         f"{tuple(logp_rollout.shape)}, mask {tuple(mask.shape)}")
    out_dtype = torch.promote_types(logp_train_old.dtype, torch.float32)  # never round weights to bf16
    valid = mask.detach().ne(0)
    v = valid.to(torch.float64)
    lt = logp_train_old.detach().to(torch.float64)
    lr = logp_rollout.detach().to(torch.float64)
    log_rho = torch.where(valid, lt - lr, torch.zeros_like(lt))  # padding may hold garbage / inf
    rho = torch.exp(log_rho)
    absdiff = log_rho.abs()
    kept = valid
    truncated = torch.zeros_like(valid)

    if method == "none":
        w = torch.ones_like(rho)
    elif method == "tis":
        c = float(cfg_get(cfg, "tis_C"))
        w, truncated = rho.clamp(max=c), rho > c
    elif method in ("mis", "icepop"):
        if method == "mis":
            u = float(cfg_get(cfg, "mis_U"))
            if u <= 1:
                raise ValueError(f"mis_U must be > 1 (got {u})")
            lo, hi = 1.0 / u, u
            level = str(cfg_get(cfg, "mis_level"))
            if level not in ("token", "sequence"):
                raise ValueError(f"mis_level must be 'token' or 'sequence' (got '{level}')")
            ratio = _seq_rho(log_rho, valid).expand_as(rho) if level == "sequence" else rho
        else:
            lo, hi = float(cfg_get(cfg, "icepop_low")), float(cfg_get(cfg, "icepop_high"))
            ratio = rho
        keep_weight = str(cfg_get(cfg, "mask_weight"))
        if keep_weight not in ("rho", "one"):
            raise ValueError(f"mask_weight must be 'rho' or 'one' (got '{keep_weight}')")
        inside = (ratio >= lo) & (ratio <= hi)
        kept = valid & inside
        w = torch.where(inside, ratio if keep_weight == "rho" else torch.ones_like(ratio), torch.zeros_like(ratio))
    stats: dict[str, float] = {}
    if method == "ais":
        c = float(cfg_get(cfg, "C"))
        wbar = rho.clamp(max=c)
        truncated = rho > c
        adv = _broadcast_tokens(advantages.detach(), lt).to(torch.float64)
        adv = torch.where(valid, adv, torch.zeros_like(adv))
        stats.update(ais_alpha(wbar, absdiff, adv, valid, cfg, group))
        w = 1.0 + stats["ais/alpha"] * (wbar - 1.0)

    w = torch.where(valid, w, torch.zeros_like(w))
    n, s_w, s_masked, s_rho, s_d, s_k3, s_tr = global_sums(
        [v, w, (valid & ~kept).to(torch.float64), rho * v, absdiff * v, (rho - 1.0 - log_rho) * v,
         truncated.to(torch.float64) * v], group).tolist()
    # mismatch/k3: E_rollout[rho - 1 - log rho] estimates KL(pi_rollout || pi_train) from rollout samples.
    neg_inf = torch.full_like(rho, -math.inf)
    ext = torch.stack([torch.where(valid, rho, neg_inf).amax() if rho.numel() else neg_inf.new_tensor(-math.inf),
                       torch.where(valid, -rho, neg_inf).amax() if rho.numel() else neg_inf.new_tensor(-math.inf)])
    rmax, neg_rmin = all_reduce_max(ext, group).tolist()
    d = max(n, 1.0)
    stats.update({
        "is/weight_mean": s_w / d, "is/masked_frac": s_masked / d, "is/rho_mean": s_rho / d,
        "is/rho_max": rmax if n else 0.0, "is/rho_min": -neg_rmin if n else 0.0, "is/truncated_frac": s_tr / d,
        "mismatch/logp_abs_diff": s_d / d, "mismatch/k3": s_k3 / d, "is/num_tokens": n,
    })
    return w.to(out_dtype), stats
