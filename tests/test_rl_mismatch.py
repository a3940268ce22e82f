"""Peers' train/rollout mismatch metrics on a hand-computed batch (METHODS.md section 8)."""
import math

import pytest
import torch

from megatron_qrl.rl import is_weights

LN2, LN3 = math.log(2), math.log(3)


def _batch():
    """Row 0: d = (ln 2, 0); row 1: d = (-ln 2, ln 3, 0); row 2: no valid token (padding garbage)."""
    lr = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -1.0, -3.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    d = torch.tensor([[LN2, 0.0, 0.0], [-LN2, LN3, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    lt = lr + d
    lt[0, 2] = float("nan")
    lt[2] = float("inf")
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    return lt, lr, mask


def test_mismatch_metrics_hand_computed():
    lt, lr, mask = _batch()
    _, st = is_weights(lt, lr, torch.tensor([1.0, -1.0, 0.0]), mask, "none", {"mis_U": 2.5})
    # valid tokens: d = ln2, 0, -ln2, ln3, 0; rho = 2, 1, 0.5, 3, 1
    assert st["mismatch/logp_abs_diff"] == pytest.approx((2 * LN2 + LN3) / 5, rel=1e-12)
    assert st["mismatch/kl_k1"] == pytest.approx(-LN3 / 5, rel=1e-12)
    # rho - 1 - d: (1 - ln2) + 0 + (-0.5 + ln2) + (2 - ln3) + 0
    assert st["mismatch/kl_k3"] == pytest.approx((2.5 - LN3) / 5, rel=1e-12)
    assert st["mismatch/chi2"] == pytest.approx((4 + 1 + 0.25 + 9 + 1) / 5 - 1, rel=1e-12)
    # per response: mean_t logp_rollout - mean_t logp_train_old = -mean_t d; row 2 has no token
    assert st["mismatch/log_ppl_diff"] == pytest.approx((-LN2 / 2 - (LN3 - LN2) / 3) / 2, rel=1e-12)
    assert st["mismatch/outside_window_frac"] == pytest.approx(1 / 5)   # none: MIS's window [0.4, 2.5]: rho 3
    assert "mismatch/k3" not in st   # renamed mismatch/kl_k3


@pytest.mark.parametrize("method,cfg,expected", [
    ("tis", {"tis_C": 2.5}, 1 / 5),                               # rho > 2.5: 3
    ("ais", {"C": 1.5}, 2 / 5),                                   # rho > 1.5: 2, 3
    ("mis", {"mis_U": 2.5}, 1 / 5),                               # [0.4, 2.5]: 3
    ("icepop", {"icepop_low": 0.6, "icepop_high": 1.5}, 3 / 5),   # 2, 0.5, 3
])
def test_outside_window_fraction_follows_the_active_method(method, cfg, expected):
    # (windows avoid the rhos 2 and 0.5 at their bounds: exp(lt - lr) is 2 only up to rounding)
    lt, lr, mask = _batch()
    _, st = is_weights(lt, lr, torch.tensor([1.0, -1.0, 0.0]), mask, method, cfg)
    assert st["mismatch/outside_window_frac"] == pytest.approx(expected, rel=1e-12)
    # at the token level the method's own masked / truncated fraction is the same set of tokens
    key = "is/masked_frac" if method in ("mis", "icepop") else "is/truncated_frac"
    assert st[key] == pytest.approx(expected, rel=1e-12)


def test_no_valid_token_gives_finite_zeros():
    lt, lr, mask = _batch()
    _, st = is_weights(lt, lr, torch.zeros(3), torch.zeros_like(mask), "tis", {})
    assert all(st[k] == 0.0 for k in st if k.startswith("mismatch/"))
