"""Every IS estimator against small hand-computed cases (METHODS.md section 4)."""
import math

import pytest
import torch

from megatron_qrl.config import RLConfig
from megatron_qrl.rl import is_weights, policy_loss

D64 = torch.float64


def _logps(rhos):
    """logp_train_old, logp_rollout with exp(train - rollout) = rho."""
    lt = torch.tensor(rhos, dtype=D64).log()
    return lt, torch.zeros_like(lt)


def test_none_and_tis():
    lt, lr = _logps([[0.5, 1.0, 3.0]])
    mask, adv = torch.ones(1, 3), torch.tensor([1.0])
    w, st = is_weights(lt, lr, adv, mask, "none", {})
    assert w.tolist() == [[1.0, 1.0, 1.0]] and st["is/weight_mean"] == 1.0 and st["is/masked_frac"] == 0.0
    assert st["mismatch/logp_abs_diff"] == pytest.approx((math.log(2) + math.log(3)) / 3)
    w, st = is_weights(lt, lr, adv, mask, "tis", {"tis_C": 2.0})
    assert w[0].tolist() == pytest.approx([0.5, 1.0, 2.0], abs=1e-12)
    assert st["is/weight_mean"] == pytest.approx(3.5 / 3) and st["is/truncated_frac"] == pytest.approx(1 / 3)
    assert st["is/rho_max"] == pytest.approx(3.0) and st["is/rho_min"] == pytest.approx(0.5)


def test_mis_token_level():
    lt, lr = _logps([[0.4, 1.5, 2.5, 0.6]])
    mask = torch.ones(1, 4)
    w, st = is_weights(lt, lr, torch.tensor([1.0]), mask, "mis", {"mis_U": 2.0})  # keep rho in [0.5, 2]
    assert w[0].tolist() == pytest.approx([0.0, 1.5, 0.0, 0.6], abs=1e-12)
    assert st["is/masked_frac"] == 0.5 and st["is/weight_mean"] == pytest.approx(2.1 / 4)
    w, _ = is_weights(lt, lr, torch.tensor([1.0]), mask, "mis", {"mis_U": 2.0, "mask_weight": "one"})
    assert w[0].tolist() == [0.0, 1.0, 0.0, 1.0]


def test_mis_sequence_level_geometric_mean():
    # seq 0: rhos 3, 1 (+ padding) -> sqrt(3) <= 2 kept, every token weighs sqrt(3); seq 1: 3, 3 -> 3 > 2 masked
    lt, lr = _logps([[3.0, 1.0, 7.0], [3.0, 3.0, 1.0]])
    lt[0, 2] = float("nan")  # padding garbage must not leak
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    w, st = is_weights(lt, lr, torch.tensor([1.0, -1.0]), mask, "mis", {"mis_U": 2.0, "mis_level": "sequence"})
    assert w.flatten().tolist() == pytest.approx([math.sqrt(3), math.sqrt(3), 0.0, 0.0, 0.0, 0.0], abs=1e-12)
    assert st["is/masked_frac"] == 0.5 and st["is/num_tokens"] == 4


def test_icepop_bounds_inclusive():
    lt, lr = _logps([[0.4, 0.5, 2.0, 2.1]])
    w, st = is_weights(lt, lr, torch.tensor([1.0]), torch.ones(1, 4), "icepop",
                       {"icepop_low": 0.5, "icepop_high": 2.0})
    assert w[0].tolist() == pytest.approx([0.0, 0.5, 2.0, 0.0], abs=1e-12)
    assert st["is/masked_frac"] == 0.5


def _ais_case():
    # tokens: rho = 1, 2 (sample A=+1) and 1, 0.5 (sample A=-1); C = 1.5 -> wbar = 1, 1.5, 1, 0.5
    lt, lr = _logps([[1.0, 2.0], [1.0, 0.5]])
    return lt, lr, torch.tensor([1.0, -1.0]), torch.ones(2, 2)


def test_ais_hand_computed():
    lt, lr, adv, mask = _ais_case()
    cfg = {"C": 1.5, "delta": 1.0, "gamma": 1.0, "beta": 0.5}
    w, st = is_weights(lt, lr, adv, mask, "ais", cfg)
    wbar = [1.0, 1.5, 1.0, 0.5]
    # mean(wbar) = 1, var = (0 + .25 + 0 + .25)/4 = .125 -> CV^2 = .125
    alpha_ess = (1 + 0.125) ** -0.5
    # dbar = mean |log rho| = (0 + ln2 + 0 + ln2)/4
    alpha_mis = min(1.0, (math.log(2) / 2) / 1.0)
    # wbar*A = 1, 1.5, -1, -0.5: mean .25, var = (.75^2 + 1.25^2 + 1.25^2 + .75^2)/4 = 1.0625; std(A) = 1
    dsigma = math.sqrt(1.0625) / 1.0
    alpha_var = max(0.0, (dsigma - 1.0) / 1.0)
    alpha = min(1.0, max(0.0, alpha_ess - 0.5 * alpha_var)) * alpha_mis
    assert st["ais/alpha_ess"] == pytest.approx(alpha_ess, rel=1e-12)
    assert st["ais/alpha_mis"] == pytest.approx(alpha_mis, rel=1e-12)
    assert st["ais/alpha_var"] == pytest.approx(alpha_var, rel=1e-9)
    assert st["ais/alpha"] == pytest.approx(alpha, rel=1e-9)
    assert 0 < alpha < 1
    expected = [1 + alpha * (x - 1) for x in wbar]
    assert w.flatten().tolist() == pytest.approx(expected, rel=1e-9)
    for key in ("is/weight_mean", "is/masked_frac", "mismatch/logp_abs_diff", "ais/alpha_var"):
        assert key in st
    # delta small -> alpha_mis saturates at 1; gamma small/beta big -> variance penalty clips alpha to 0
    _, st = is_weights(lt, lr, adv, mask, "ais", {**cfg, "delta": 0.05})
    assert st["ais/alpha_mis"] == 1.0
    w, st = is_weights(lt, lr, adv, mask, "ais", {**cfg, "gamma": 0.5, "beta": 2.0})
    assert st["ais/alpha_var"] == pytest.approx((dsigma - 0.5) / 0.5) and st["ais/alpha"] == 0.0
    assert torch.equal(w, torch.ones_like(w))


def test_ais_reads_rlconfig_and_broadcasts_token_advantages():
    lt, lr, adv, mask = _ais_case()
    cfg = RLConfig(ais={"C": 1.5, "delta": 1.0, "gamma": 1.0, "beta": 0.5})
    w1, s1 = is_weights(lt, lr, adv, mask, "ais", cfg)
    w2, s2 = is_weights(lt, lr, adv[:, None].expand(2, 2), mask, "ais", cfg.ais)
    assert torch.equal(w1, w2) and s1 == s2


@pytest.mark.parametrize("how", ["rho_one", "delta_huge"])
def test_ais_alpha_zero_is_plain_grpo(how):
    g = torch.Generator().manual_seed(0)
    lr = -torch.rand(4, 5, generator=g)
    lt = lr.clone() if how == "rho_one" else lr + 0.1 * torch.randn(4, 5, generator=g)
    delta = 0.05 if how == "rho_one" else 1e300
    mask = torch.ones(4, 5)
    mask[1, 3:] = 0
    adv = torch.tensor([1.0, -0.5, 0.3, -0.8])
    w, st = is_weights(lt, lr, adv, mask, "ais", {"delta": delta})
    assert st["ais/alpha"] < 1e-290
    assert torch.equal(w, mask)  # exactly 1 on valid tokens, 0 on padding
    logp_new = (lt + 0.05 * torch.randn(4, 5, generator=g)).requires_grad_(True)
    loss_ais, _ = policy_loss(logp_new, lt, adv, mask, w, 0.2, 0.28)
    loss_grpo, _ = policy_loss(logp_new, lt, adv, mask, None, 0.2, 0.28)
    assert torch.equal(loss_ais, loss_grpo)


def test_degenerate_batches_no_nan():
    lt, lr, _, _ = _ais_case()
    # all advantages zero: std(A) = 0 -> alpha_var = 0 by convention
    w, st = is_weights(lt, lr, torch.zeros(2), torch.ones(2, 2), "ais", {"C": 1.5})
    assert st["ais/alpha_var"] == 0.0 and all(math.isfinite(v) for v in st.values())
    # empty batch: weights 0, alpha 0, every stat finite
    for method in ("none", "tis", "mis", "icepop", "ais"):
        w, st = is_weights(lt, lr, torch.ones(2), torch.zeros(2, 2), method, {})
        assert torch.equal(w, torch.zeros_like(w)) and all(math.isfinite(v) for v in st.values()), method
    w, st = is_weights(torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(0), torch.zeros(0, 3), "ais", {})
    assert w.shape == (0, 3) and st["ais/alpha"] == 0.0


def test_weights_detached_and_errors():
    lt = torch.zeros(1, 2, requires_grad=True)
    w, _ = is_weights(lt, torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2), "tis", {})
    assert not w.requires_grad
    with pytest.raises(ValueError, match="unknown IS method"):
        is_weights(lt, torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2), "bogus", {})
    with pytest.raises(ValueError, match="shape"):
        is_weights(lt, torch.zeros(1, 3), torch.ones(1), torch.ones(1, 2), "tis", {})


@pytest.mark.parametrize("method", ["none", "tis", "mis", "icepop", "ais"])
def test_required_stats_and_config_objects(method):
    lt, lr = _logps([[0.4, 1.5, 2.5, 0.9]])
    cfg = RLConfig(tis_C=1.2, mis_U=1.6, icepop_low=0.5, icepop_high=1.4, mask_weight="one")
    w, st = is_weights(lt, lr, torch.tensor([1.0]), torch.ones(1, 4), method, cfg)
    for key in ("is/weight_mean", "is/masked_frac", "mismatch/logp_abs_diff"):
        assert isinstance(st[key], float)
    if method == "ais":
        assert {"ais/alpha", "ais/alpha_ess", "ais/alpha_mis", "ais/alpha_var"} <= set(st)
    expected = {"none": [1, 1, 1, 1], "tis": [0.4, 1.2, 1.2, 0.9], "mis": [0, 1, 0, 1], "icepop": [0, 0, 0, 1]}
    if method in expected:
        assert w[0].tolist() == pytest.approx(expected[method], abs=1e-6)


# ---------------------------------------------------------------- sequence level (rl.is_level: seq / geo)
def _seq_batch():
    """Response ratios: row 0 rho = 2, 2 -> rho_seq 4, rho_geo 2; row 1 rho = 0.5, 1, 1 -> 0.5 and 0.5^(1/3);
    row 2 rho = 1.2 -> 1.2 and 1.2; row 3 has no valid token."""
    rhos = [[2.0, 2.0, 1.0], [0.5, 1.0, 1.0], [1.2, 1.0, 1.0], [1.0, 1.0, 1.0]]
    lt, lr = _logps(rhos)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    lt[0, 2] = float("nan")   # padding garbage
    return lt, lr, torch.tensor([1.0, -1.0, 0.5, 0.0]), mask


def _per_token(row_values, mask):
    """A response's value on each of its valid tokens, flattened."""
    return [v if m else 0.0 for v, row in zip(row_values, mask.tolist()) for m in row]


@pytest.mark.parametrize("level,ratios", [("seq", [4.0, 0.5, 1.2]), ("geo", [2.0, 0.5 ** (1 / 3), 1.2])])
def test_sequence_tis_weights_whole_responses(level, ratios):
    lt, lr, adv, mask = _seq_batch()
    w, st = is_weights(lt, lr, adv, mask, "tis", {"tis_C": 3.0, "is_level": level})
    expected = [min(r, 3.0) for r in ratios] + [0.0]
    assert w.flatten().tolist() == pytest.approx(_per_token(expected, mask), rel=1e-12)
    assert st["is/truncated_frac"] == pytest.approx((2 / 6) if level == "seq" else 0.0)   # row 0's 2 of 6 tokens
    assert st["is/num_sequences"] == 3 and st["is/seq_ratio_max"] == pytest.approx(max(ratios), rel=1e-12)
    assert st["is/seq_ratio_min"] == pytest.approx(min(ratios), rel=1e-12)
    assert st["is/seq_ratio_mean"] == pytest.approx(sum(ratios) / 3, rel=1e-12)
    assert st["is/rho_max"] == pytest.approx(2.0)   # token statistics stay token-level


def test_sequence_mis_drops_whole_responses():
    lt, lr, adv, mask = _seq_batch()
    w, st = is_weights(lt, lr, adv, mask, "mis", {"mis_U": 3.0, "is_level": "seq"})   # window [1/3, 3]
    assert w.flatten().tolist() == pytest.approx(_per_token([0.0, 0.5, 1.2, 0.0], mask), rel=1e-12)   # rho_seq 4 dropped
    assert st["is/masked_frac"] == pytest.approx(2 / 6) and st["is/seq_masked_frac"] == pytest.approx(1 / 3)
    w, st = is_weights(lt, lr, adv, mask, "mis", {"mis_U": 3.0, "is_level": "geo", "mask_weight": "one"})
    assert w.flatten().tolist() == _per_token([1.0, 1.0, 1.0, 0.0], mask) and st["is/seq_masked_frac"] == 0.0


def test_sequence_icepop():
    lt, lr, adv, mask = _seq_batch()
    cfg = {"icepop_low": 0.6, "icepop_high": 3.5, "is_level": "seq"}
    w, st = is_weights(lt, lr, adv, mask, "icepop", cfg)
    assert w.flatten().tolist() == pytest.approx(_per_token([0.0, 0.0, 1.2, 0.0], mask), rel=1e-12)
    assert st["is/seq_masked_frac"] == pytest.approx(2 / 3) and st["is/masked_frac"] == pytest.approx(5 / 6)
    w, _ = is_weights(lt, lr, adv, mask, "icepop", {**cfg, "is_level": "geo"})   # 2, 0.79, 1.2 all inside
    assert w.flatten().tolist() == pytest.approx(_per_token([2.0, 0.5 ** (1 / 3), 1.2, 0.0], mask), rel=1e-12)


def test_sequence_ais_statistics_are_over_responses():
    lt, lr, adv, mask = _seq_batch()
    cfg = {"C": 3.0, "delta": 10.0, "gamma": 1.0, "beta": 0.5, "is_level": "seq"}
    w, st = is_weights(lt, lr, adv, mask, "ais", cfg)
    R, A = [4.0, 0.5, 1.2], [1.0, -1.0, 0.5]      # one unit per response with a valid token
    wbar = [min(r, 3.0) for r in R]

    def mean(x):
        return sum(x) / len(x)

    def std(x):
        return math.sqrt(mean([(v - mean(x)) ** 2 for v in x]))

    cv = std(wbar) / mean(wbar)
    alpha_ess = (1 + cv * cv) ** -0.5
    dbar = mean([abs(math.log(r)) for r in R])
    alpha_mis = min(1.0, dbar / 10.0)
    dsigma = std([a * b for a, b in zip(wbar, A)]) / std(A)
    alpha_var = max(0.0, (dsigma - 1.0) / 1.0)
    alpha = min(1.0, max(0.0, alpha_ess - 0.5 * alpha_var)) * alpha_mis
    for key, value in (("ais/cv", cv), ("ais/alpha_ess", alpha_ess), ("ais/dbar", dbar), ("ais/dsigma", dsigma),
                       ("ais/alpha_var", alpha_var), ("ais/alpha", alpha)):
        assert st[key] == pytest.approx(value, rel=1e-12), key
    assert 0 < alpha < 1
    assert w.flatten().tolist() == pytest.approx(_per_token([1 + alpha * (x - 1) for x in wbar] + [0.0], mask), rel=1e-12)


def test_level_validation_and_the_deprecated_mis_level():
    lt, lr, adv, mask = _seq_batch()
    with pytest.raises(ValueError, match="rl.is_level"):
        is_weights(lt, lr, adv, mask, "tis", {"is_level": "sentence"})
    w_old, s_old = is_weights(lt, lr, adv, mask, "mis", {"mis_U": 3.0, "mis_level": "sequence"})
    w_new, s_new = is_weights(lt, lr, adv, mask, "mis", {"mis_U": 3.0, "is_level": "geo"})
    assert torch.equal(w_old, w_new) and s_old == s_new
    # the config maps it the same way, and only for MIS
    assert RLConfig(is_method="mis", mis_level="sequence").is_level == "geo"
    assert RLConfig(is_method="tis", mis_level="sequence").is_level == "token"
