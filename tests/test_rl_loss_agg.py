"""Loss aggregation modes (token-mean, seq-mean-token-mean, seq-mean-token-sum), by hand and over splits."""
import pytest
import torch

from megatron_qrl.config import ConfigError, RLConfig, from_dict
from megatron_qrl.pipeline.losses import grpo_loss
from megatron_qrl.rl import count_loss_sequences, count_valid_tokens, policy_loss, token_coefficients

D64 = torch.float64
# per-token policy terms: row 0 = (1, 2), row 1 = (3), row 2 has no valid token
TERMS = torch.tensor([[1.0, 2.0], [3.0, 0.0], [0.0, 0.0]], dtype=D64)
MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
EXPECTED = {"token-mean": (1 + 2 + 3) / 3, "seq-mean-token-mean": ((1 + 2) / 2 + 3) / 2,
            "seq-mean-token-sum": ((1 + 2) + 3) / 2}


def _loss(rows, mode, logp_new):
    # ratio 1 and A = -term make pg_t = term_t
    coef = token_coefficients(MASK[rows], mode, count_valid_tokens(MASK), count_loss_sequences(MASK))
    return policy_loss(logp_new[rows], torch.zeros_like(TERMS[rows]), -TERMS[rows], MASK[rows], token_coef=coef)[0]


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_modes_hand_computed_and_split_invariant(mode):
    assert count_loss_sequences(MASK) == 2
    lp = torch.zeros_like(TERMS, requires_grad=True)
    whole = _loss(slice(None), mode, lp)
    assert whole.item() == pytest.approx(EXPECTED[mode], rel=1e-12)
    (g_whole,) = torch.autograd.grad(whole, lp)
    parts = _loss(slice(0, 1), mode, lp) + _loss(slice(1, 3), mode, lp)   # two micro-batches / ranks
    (g_parts,) = torch.autograd.grad(parts, lp)
    assert parts.item() == pytest.approx(whole.item(), abs=1e-14)
    torch.testing.assert_close(g_parts, g_whole, rtol=0, atol=1e-15)


def test_token_mean_coefficients_equal_the_global_token_normaliser():
    lp = torch.zeros_like(TERMS)
    by_coef = _loss(slice(None), "token-mean", lp)
    by_n, _ = policy_loss(lp, torch.zeros_like(TERMS), -TERMS, MASK, num_tokens_global=3)
    assert by_coef.item() == pytest.approx(by_n.item(), rel=1e-15)


def _mb(**extra):
    return {"loss_mask": MASK, "logp_old": torch.zeros_like(TERMS), "advantages": -TERMS, "num_global_tokens": 3.0,
            "num_loss_sequences": 2.0, **extra}


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_grpo_loss_uses_the_configured_mode(mode):
    loss, stats = grpo_loss(RLConfig(loss_agg_mode=mode))(torch.zeros_like(TERMS), _mb())
    assert loss.item() == pytest.approx(EXPECTED[mode], rel=1e-12)
    assert "train/kl_loss" not in stats


def test_grpo_loss_kl_term_only_in_loss_mode():
    ref = torch.tensor([[0.5, -0.5], [0.2, 9.0], [0.0, 0.0]], dtype=D64)   # 9.0 sits on padding
    zeros = torch.zeros_like(TERMS)
    base, _ = grpo_loss(RLConfig(loss_agg_mode="seq-mean-token-mean"))(zeros, _mb())
    loss, st = grpo_loss(RLConfig(loss_agg_mode="seq-mean-token-mean", kl_coef=0.1, kl_estimator="k2"))(
        zeros, _mb(logp_ref=ref))
    k2 = [0.125, 0.125, 0.02]   # l^2 / 2 on the valid tokens
    # the KL term is aggregated like the policy term: ((k_00 + k_01) / 2 + k_10) / 2
    assert loss.item() == pytest.approx(base.item() + 0.1 * ((k2[0] + k2[1]) / 2 + k2[2]) / 2, rel=1e-12)
    assert float(st["train/kl_loss"]) == pytest.approx(sum(k2) / 3, rel=1e-12)   # token mean (share = 1 here)
    rew, st = grpo_loss(RLConfig(kl_coef=0.1, kl_mode="reward"))(zeros, _mb(logp_ref=ref))
    assert rew.item() == pytest.approx(EXPECTED["token-mean"]) and "train/kl_loss" not in st


def test_sequence_modes_need_the_global_sequence_count_and_valid_names():
    mb = _mb()
    del mb["num_loss_sequences"]
    with pytest.raises(KeyError, match="num_loss_sequences"):
        grpo_loss(RLConfig(loss_agg_mode="seq-mean-token-sum"))(torch.zeros_like(TERMS), mb)
    with pytest.raises(ConfigError, match=r"rl\.loss_agg_mode"):
        from_dict({"rl": {"loss_agg_mode": "sequence-mean"}})
    assert RLConfig().loss_agg_mode == "token-mean"   # the behaviour before the option existed
