"""KL estimators k1 / k2 / k3 and the KL-to-reference loss term, against hand-computed values (METHODS.md 8)."""
import math

import pytest
import torch

from megatron_qrl.config import ConfigError, from_dict
from megatron_qrl.rl import kl_estimate, policy_loss
from megatron_qrl.rl.kl import KL_ALIASES, canonical_estimator

D64 = torch.float64


def test_estimators_hand_computed():
    l = torch.tensor([0.5, -0.5, 0.0], dtype=D64)   # l = log q - log p
    assert kl_estimate(l, "k1").tolist() == [-0.5, 0.5, 0.0]
    assert kl_estimate(l, "k2").tolist() == [0.125, 0.125, 0.0]
    k3 = [math.exp(0.5) - 1 - 0.5, math.exp(-0.5) - 1 + 0.5, 0.0]
    assert kl_estimate(l, "k3").tolist() == pytest.approx(k3, rel=1e-15)
    assert min(kl_estimate(torch.linspace(-5, 5, 101, dtype=D64), "k3").tolist()) >= 0.0   # k3 >= 0


def test_k3_clip_and_finite_gradient():
    l = torch.tensor([25.0, -25.0, 3.0], dtype=D64, requires_grad=True)
    k = kl_estimate(l, "k3", clip=True)
    # e^25 - 26 and e^-25 + 24 both exceed 10: clipped; l = 3 gives e^3 - 4 = 16.09: clipped too
    assert k.tolist() == [10.0, 10.0, 10.0]
    k.sum().backward()
    assert torch.isfinite(l.grad).all() and l.grad.tolist() == [0.0, 0.0, 0.0]
    assert kl_estimate(torch.tensor([-25.0], dtype=D64), "k3", clip=False).item() == pytest.approx(math.exp(-25) + 24)
    small = torch.tensor([1.0], dtype=D64)
    assert kl_estimate(small, "k3").item() == pytest.approx(math.e - 2, rel=1e-15)   # inside the clip


def test_peer_aliases_and_unknown_names():
    assert [canonical_estimator(n) for n in ("kl", "mse", "low_var_kl", "K3")] == ["k1", "k2", "k3", "k3"]
    with pytest.raises(ValueError, match="choose one of k1, k2, k3"):
        canonical_estimator("abs")


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_term_in_policy_loss_value_and_gradient(estimator):
    ref = torch.tensor([[0.5, -0.5, 0.2]], dtype=D64)
    lp = torch.zeros(1, 3, dtype=D64, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])   # the third token is padding
    loss, st = policy_loss(lp, lp.detach(), torch.zeros(1, dtype=D64), mask, None, logp_ref=ref, kl_coef=0.5,
                           kl_estimator=estimator)
    l = [0.5, -0.5]
    k = {"k1": [-x for x in l], "k2": [x * x / 2 for x in l], "k3": [math.exp(x) - 1 - x for x in l]}[estimator]
    assert loss.item() == pytest.approx(0.5 * sum(k) / 2, rel=1e-12)   # A = 0: only the KL term
    assert float(st["pg/kl_loss"]) == pytest.approx(sum(k) / 2, rel=1e-12)
    loss.backward()
    # d k / d logp with l = ref - logp: k1 -> +1, k2 -> -l, k3 -> 1 - e^l
    dk = {"k1": [1.0, 1.0], "k2": [-x for x in l], "k3": [1 - math.exp(x) for x in l]}[estimator]
    assert lp.grad[0, :2].tolist() == pytest.approx([0.5 * g / 2 for g in dk], rel=1e-12)
    assert lp.grad[0, 2] == 0.0


def test_config_kl_fields_validate_with_the_field_and_the_fix():
    assert from_dict({"rl": {"kl_estimator": "low_var_kl"}}).rl.kl_estimator == "k3"
    assert from_dict({"rl": {"kl_estimator": "mse"}}).rl.kl_estimator == "k2"
    with pytest.raises(ConfigError, match=r"rl\.kl_estimator: unknown KL estimator 'abs'; choose k1, k2 or k3"):
        from_dict({"rl": {"kl_estimator": "abs"}})
    with pytest.raises(ConfigError, match=r"rl\.kl_coef: Input should be greater than or equal to 0"):
        from_dict({"rl": {"kl_coef": -0.1}})
    with pytest.raises(ConfigError, match=r"rl\.kl_mode"):
        from_dict({"rl": {"kl_mode": "advantage"}})
    from megatron_qrl.config import _KL_ALIASES
    assert _KL_ALIASES == KL_ALIASES   # config's copy of the alias table (it imports no torch)
    rl = from_dict({}).rl
    assert rl.kl_coef == 0 and rl.kl_mode == "loss" and rl.kl_reference is None   # off by default
