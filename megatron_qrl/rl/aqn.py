"""AQN: adaptive quantization noise schedule and draw (METHODS.md section 5, QeRL).

Stage k = floor(step / (M / K)), clamped to [0, K-1]; stage 0 is noise-free (the policy first adapts to FP4),
stage k >= 1 decays geometrically from sigma_start (k=1) to sigma_end (k=K-1). The model side adds the draw
to the RMSNorm weights in front of quantized linears; here we only compute sigma and draw Z.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from megatron_qrl.rl.importance import cfg_get


def aqn_stage(step: int, total_steps: int, stages: int) -> int:
    """floor(step * K / M) in integer arithmetic (exact at the boundaries), clamped to [0, K-1]."""
    if total_steps < 1 or stages < 1:
        raise ValueError(f"AQN needs total_steps >= 1 and stages >= 1 (got {total_steps}, {stages})")
    return min(stages - 1, max(0, (int(step) * int(stages)) // int(total_steps)))


def aqn_sigma(step: int, total_steps: int, cfg: Any) -> float:
    """Noise std for this step. cfg: sigma_start, sigma_end, stages (K), optional enabled (False -> 0).

    K = 2 has one noisy stage, at sigma_start (the geometric exponent (k-1)/(K-2) is taken as 0).
    """
    if not cfg_get(cfg, "enabled", True):
        return 0.0
    k_total = int(cfg_get(cfg, "stages", 10))
    s0, s1 = float(cfg_get(cfg, "sigma_start", 1e-2)), float(cfg_get(cfg, "sigma_end", 1e-4))
    if s0 <= 0 or s1 <= 0:
        raise ValueError(f"aqn.sigma_start and aqn.sigma_end must be > 0 (got {s0}, {s1})")
    k = aqn_stage(step, total_steps, k_total)
    if k == 0:
        return 0.0
    if k_total <= 2 or k == 1:
        return s0
    if k == k_total - 1:
        return s1
    return s0 * (s1 / s0) ** ((k - 1) / (k_total - 2))


def aqn_noise(shape: Sequence[int] | int, sigma: float, generator: Optional[torch.Generator] = None,
              dtype: torch.dtype = torch.float32, device: Optional[torch.device | str] = None) -> torch.Tensor:
    """Z ~ N(0, sigma^2) of `shape` (e.g. [hidden]) to add to a norm weight; exact zeros when sigma == 0.

    Drawn in float32 then cast, so a bf16 weight gets the same noise as its fp32 master would.
    """
    if sigma < 0:
        raise ValueError(f"sigma must be >= 0 (got {sigma})")
    if device is None and generator is not None:
        device = generator.device
    z = torch.zeros(shape, dtype=torch.float32, device=device)
    if sigma > 0:
        z.normal_(0.0, float(sigma), generator=generator)
    return z.to(dtype)
