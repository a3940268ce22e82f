"""Importance-sampling corrections of the rollout/train mismatch (METHODS.md sections 4 and 8).

d_t = logp_train_old - logp_rollout per valid token. The correction acts on *units* of one level
(rl.is_level), each with a ratio R:
  token   a unit per token,    R = rho_t = exp(d_t)
  seq     a unit per response, R = rho_seq = exp(sum_t d_t)   (product of the token ratios; verl's "seq")
  geo     a unit per response, R = rho_geo = exp(mean_t d_t)  (geometric mean; verl's "geo")
Methods, per unit:
  none    w = 1
  tis     w = min(R, tis_C)
  mis     w = R * 1[1/mis_U <= R <= mis_U]       (mask_weight=one keeps w = 1 instead of R)
  icepop  w = R * 1[icepop_low <= R <= icepop_high]
  ais     w = 1 + alpha * (min(R, C) - 1), alpha from statistics over the batch's units (see `ais_alpha`;
          at a sequence level: over responses, A = the response's advantage, dbar = mean |log R|)
A response's weight applies to each of its tokens. Weights are detached and 0 at mask==0 positions. All
batch statistics are sums/counts in float64, all-reduced over ``group`` so data-parallel shards reproduce
the single-process result (a response never spans ranks).
"""
from __future__ import annotations

import math
from typing import Any

import torch

from megatron_qrl.rl.mismatch import mismatch_metrics
from megatron_qrl.rl.reduce import all_reduce_max, global_sums

METHODS = ("none", "tis", "mis", "icepop", "ais")
LEVELS = ("token", "seq", "geo")
# log R of a product ratio is clamped here before exp, so rho_seq stays finite in float64 (weights are
# truncated or masked long before that)
_SEQ_LOG_RATIO_MAX = 700.0

_DEFAULTS = {"C": 2.0, "delta": 0.05, "gamma": 1.0, "beta": 0.5, "tis_C": 2.0, "mis_U": 2.0,
             "mis_level": "token", "is_level": "token", "icepop_low": 0.5, "icepop_high": 2.0, "mask_weight": "rho"}
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
    """alpha and its factors from the batch's valid units (float64 inputs of one shape, `valid` boolean):
    tokens [B, T] at the token level, responses [B] at a sequence level.

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


def is_level(cfg: Any, method: str) -> str:
    """The unit level of the correction: rl.is_level; the deprecated rl.mis_level=sequence means geo for mis."""
    level = str(cfg_get(cfg, "is_level"))
    if level not in LEVELS:
        raise ValueError(f"unknown IS level '{level}'; choose one of {', '.join(LEVELS)} (rl.is_level)")
    if level == "token" and method == "mis":
        old = str(cfg_get(cfg, "mis_level"))
        if old not in ("token", "sequence"):
            raise ValueError(f"mis_level must be 'token' or 'sequence' (got '{old}'); prefer rl.is_level")
        level = "geo" if old == "sequence" else level
    return level


class _Units:
    """The batch seen as units of one level: their log ratio, validity and advantage, and the way back to
    tokens. Token level: the [B, T] tensors themselves. Sequence levels: one entry per response ([B]); a
    response without valid tokens is not a unit."""

    def __init__(self, level: str, log_rho: torch.Tensor, valid: torch.Tensor, adv: torch.Tensor):
        self.level, self.shape = level, log_rho.shape
        if level == "token":
            self.log_ratio, self.valid, self.adv = log_rho, valid, adv
            return
        v = valid.to(torch.float64)
        count = v.sum(-1)
        total = (log_rho * v).sum(-1)
        log_r = total if level == "seq" else total / count.clamp_min(1.0)
        self.log_ratio = log_r.clamp(-_SEQ_LOG_RATIO_MAX, _SEQ_LOG_RATIO_MAX)
        self.valid = count > 0
        self.adv = (adv * v).sum(-1) / count.clamp_min(1.0)   # the response's advantage (GRPO: constant)

    def to_tokens(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.level == "token" else x[:, None].expand(self.shape)


def _window(method: str, cfg: Any) -> tuple[float, float]:
    """The ratio window [lo, hi] each method trusts (none: MIS's, so the diagnostic exists for every method)."""
    if method == "tis":
        return 0.0, float(cfg_get(cfg, "tis_C"))
    if method == "ais":
        return 0.0, float(cfg_get(cfg, "C"))
    if method == "icepop":
        lo, hi = float(cfg_get(cfg, "icepop_low")), float(cfg_get(cfg, "icepop_high"))
        if not 0 < lo < hi:
            raise ValueError(f"IcePop needs 0 < icepop_low < icepop_high (got {lo}, {hi}): rl.icepop_*")
        return lo, hi
    u = float(cfg_get(cfg, "mis_U"))
    if u <= 1:
        raise ValueError(f"mis_U must be > 1 (got {u})")
    return 1.0 / u, u


def _unit_weights(method: str, units: _Units, cfg: Any, group, stats: dict):
    """(weight, kept, truncated) per unit; AIS adds its factors to `stats`."""
    ratio = torch.exp(units.log_ratio)
    kept = units.valid
    truncated = torch.zeros_like(units.valid)
    lo, hi = _window(method, cfg)
    if method == "none":
        w = torch.ones_like(ratio)
    elif method == "tis":
        w, truncated = ratio.clamp(max=hi), ratio > hi
    elif method in ("mis", "icepop"):
        keep_weight = str(cfg_get(cfg, "mask_weight"))
        if keep_weight not in ("rho", "one"):
            raise ValueError(f"mask_weight must be 'rho' or 'one' (got '{keep_weight}')")
        inside = (ratio >= lo) & (ratio <= hi)
        kept = units.valid & inside
        w = torch.where(inside, ratio if keep_weight == "rho" else torch.ones_like(ratio), torch.zeros_like(ratio))
    else:  # ais
        wbar = ratio.clamp(max=hi)
        truncated = ratio > hi
        adv = torch.where(units.valid, units.adv, torch.zeros_like(units.adv))
        stats.update(ais_alpha(wbar, units.log_ratio.abs(), adv, units.valid, cfg, group))
        w = 1.0 + stats["ais/alpha"] * (wbar - 1.0)
    return w, kept, truncated


def _extremes(x: torch.Tensor, valid: torch.Tensor, group) -> tuple[float, float]:
    """(max, min) of x over valid entries of the whole batch (0, 0 when there are none)."""
    neg_inf = torch.full((), -math.inf, dtype=torch.float64, device=x.device)
    ext = torch.stack([torch.where(valid, x, neg_inf).amax() if x.numel() else neg_inf,
                       torch.where(valid, -x, neg_inf).amax() if x.numel() else neg_inf])
    hi, neg_lo = all_reduce_max(ext, group).tolist()
    return (hi, -neg_lo) if math.isfinite(hi) else (0.0, 0.0)


def is_weights(logp_train_old: torch.Tensor, logp_rollout: torch.Tensor, advantages: torch.Tensor,
               mask: torch.Tensor, method: str, cfg: Any = None, group=None) -> tuple[torch.Tensor, dict]:
    """Per-token IS weights [B, T] (detached, 0 where mask==0) and a stats dict of python floats.

    Stats for every method, means over the whole (all-reduced) batch's valid tokens: is/weight_mean,
    is/masked_frac, is/rho_mean, is/rho_min, is/rho_max (token rho), is/truncated_frac (tokens whose unit's
    ratio exceeds C for tis/ais), is/num_tokens, and the mismatch/* metrics of rl/mismatch.py. At a sequence
    level also, over responses: is/seq_ratio_mean, is/seq_ratio_min, is/seq_ratio_max, is/seq_masked_frac,
    is/num_sequences. AIS adds ais/alpha, ais/alpha_ess, ais/alpha_mis, ais/alpha_var, ais/cv, ais/dsigma,
    ais/dbar.
    """
    method = (method or "none").lower()
    if method not in METHODS:
        raise ValueError(f"unknown IS method '{method}'; choose one of {', '.join(METHODS)} (rl.is_method)")
    if logp_train_old.shape != logp_rollout.shape or logp_train_old.shape != mask.shape:
        raise ValueError(f"shape mismatch: logp_train_old {tuple(logp_train_old.shape)}, logp_rollout "
                         f"{tuple(logp_rollout.shape)}, mask {tuple(mask.shape)}")
    level = is_level(cfg, method)
    out_dtype = torch.promote_types(logp_train_old.dtype, torch.float32)  # never round weights to bf16
    valid = mask.detach().ne(0)
    v = valid.to(torch.float64)
    lt = logp_train_old.detach().to(torch.float64)
    lr = logp_rollout.detach().to(torch.float64)
    log_rho = torch.where(valid, lt - lr, torch.zeros_like(lt))  # padding may hold garbage / inf
    rho = torch.exp(log_rho)
    adv = torch.where(valid, _broadcast_tokens(advantages.detach(), lt).to(torch.float64), torch.zeros_like(lt))
    units = _Units(level, log_rho, valid, adv)

    stats: dict[str, float] = {}
    w_unit, kept_unit, truncated_unit = _unit_weights(method, units, cfg, group, stats)
    w = torch.where(valid, units.to_tokens(w_unit), torch.zeros_like(rho))
    kept = valid & units.to_tokens(kept_unit)
    truncated = valid & units.to_tokens(truncated_unit)

    n, s_w, s_masked, s_rho, s_tr = global_sums(
        [v, w, (valid & ~kept).to(torch.float64), rho * v, truncated.to(torch.float64)], group).tolist()
    rmax, rmin = _extremes(rho, valid, group)
    d = max(n, 1.0)
    stats.update({"is/weight_mean": s_w / d, "is/masked_frac": s_masked / d, "is/rho_mean": s_rho / d,
                  "is/rho_max": rmax, "is/rho_min": rmin, "is/truncated_frac": s_tr / d, "is/num_tokens": n})
    if level != "token":
        uv = units.valid.to(torch.float64)
        ratio = torch.exp(units.log_ratio)
        n_seq, s_ratio, s_dropped = global_sums([uv, ratio * uv, (units.valid & ~kept_unit).to(torch.float64)],
                                                group).tolist()
        smax, smin = _extremes(ratio, units.valid, group)
        stats.update({"is/seq_ratio_mean": s_ratio / max(n_seq, 1.0), "is/seq_ratio_max": smax,
                      "is/seq_ratio_min": smin, "is/seq_masked_frac": s_dropped / max(n_seq, 1.0),
                      "is/num_sequences": n_seq})
    stats.update(mismatch_metrics(log_rho, valid, _window(method, cfg), group))
    return w.to(out_dtype), stats
