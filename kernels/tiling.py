"""Launch-shape choices shared by the W4A16 kernels (w4a16_gemm.py, w4a16_gemv.py)."""
from __future__ import annotations


def split_k_for(tiles: int, k_steps: int, sms: int, cap: int = 16, per_sm: int = 2) -> int:
    """Split-K factor: a divisor of k_steps (no idle splits) that brings tiles * split nearest to per_sm
    CTAs per SM, never fewer CTAs than SMs when avoidable."""
    best, best_cost = 1, None
    for d in range(1, min(cap, k_steps) + 1):
        if k_steps % d:
            continue
        ctas = tiles * d
        cost = abs(ctas - per_sm * sms) + (4 * sms if ctas < sms else 0)
        if best_cost is None or cost < best_cost:
            best, best_cost = d, cost
    return best
