"""Statistics of the evidence campaigns: paired per-seed differences with Student-t 95% intervals.

Arms of one seed share the SFT start, the prompts and the sampling seeds (common random numbers), so an arm
is compared with a reference by the differences d_k = arm_k - ref_k over the seeds k both finished:
mean(d) +- t_{0.975, n-1} * sd(d) / sqrt(n), sd the sample standard deviation. No scipy needed (the device
image may lack it): the quantiles below are the standard table values.
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

# t_{0.975, df} for df = 1..30 (two-sided 95%); beyond 30 the normal quantile's Cornish-Fisher expansion
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """The two-sided 95% Student-t quantile for `df` >= 1 degrees of freedom."""
    if df < 1:
        raise ValueError(f"a t-interval needs at least 2 values (df >= 1), got df={df}")
    if df <= len(T975):
        return T975[df - 1]
    z = 1.959964
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


def finite(values: Iterable) -> list[float]:
    return [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def mean_ci(values: Sequence[float]) -> dict:
    """{'n', 'mean', 'sd', 'half', 'lo', 'hi'}: mean, sample sd and the 95% t-interval of the finite values
    (half-width NaN for fewer than two)."""
    vals = finite(values)
    n = len(vals)
    if not n:
        return {"n": 0, "mean": math.nan, "sd": math.nan, "half": math.nan, "lo": math.nan, "hi": math.nan}
    m = sum(vals) / n
    sd = math.sqrt(sum((v - m) ** 2 for v in vals) / (n - 1)) if n > 1 else math.nan
    half = t975(n - 1) * sd / math.sqrt(n) if n > 1 else math.nan
    return {"n": n, "mean": m, "sd": sd, "half": half, "lo": m - half, "hi": m + half}


def paired_ci(arm: dict, ref: dict) -> dict:
    """arm, ref: {seed: value}. The 95% t-interval of arm - ref over the seeds both have (finite values)."""
    seeds = sorted(s for s in set(arm) & set(ref) if finite([arm[s], ref[s]]) == [arm[s], ref[s]])
    out = mean_ci([arm[s] - ref[s] for s in seeds])
    out["seeds"] = seeds
    return out


def fmt_ci(ci: dict, digits: int = 3) -> str:
    """'+0.012 [-0.004, +0.028]' (n < 2: the mean alone; no value: '-')."""
    if not ci["n"]:
        return "-"
    if math.isnan(ci["half"]):
        return f"{ci['mean']:+.{digits}f}"
    return f"{ci['mean']:+.{digits}f} [{ci['lo']:+.{digits}f}, {ci['hi']:+.{digits}f}]"
