import math

import pytest
import torch

from megatron_qrl.rl import count_valid_tokens, policy_loss

D64 = torch.float64


def test_hand_computed_clipped_objective():
    # ratios 1.5 (A=+1: clipped at 1.28), 0.5 (A=-1: clipped at 0.8), 1.1 (A=+1: unclipped), 0.9 (A=-1: unclipped)
    ratios = torch.tensor([[1.5, 0.5], [1.1, 0.9]], dtype=D64)
    adv = torch.tensor([[1.0, -1.0], [1.0, -1.0]], dtype=D64)
    logp_new = ratios.log().requires_grad_(True)
    loss, st = policy_loss(logp_new, torch.zeros(2, 2, dtype=D64), adv, torch.ones(2, 2), None, 0.2, 0.28)
    terms = [-min(1.5, 1.28), -min(-0.5, -0.8), -1.1, -min(-0.9, -0.9)]
    assert loss.item() == pytest.approx(sum(terms) / 4, rel=1e-12)
    assert float(st["pg/clip_frac"]) == 0.5 and float(st["pg/clip_frac_high"]) == 0.25
    assert float(st["pg/clip_frac_low"]) == 0.25 and float(st["pg/num_tokens"]) == 4
    assert float(st["pg/ratio_mean"]) == pytest.approx(1.0) and float(st["pg/ratio_max"]) == pytest.approx(1.5)
    kl = sum(r - 1 - math.log(r) for r in (1.5, 0.5, 1.1, 0.9)) / 4
    assert float(st["pg/approx_kl"]) == pytest.approx(kl, rel=1e-12)
    loss.backward()
    # clipped tokens get no gradient; unclipped: d(-r*A)/dlogp = -r*A / N
    assert logp_new.grad.tolist()[0] == [0.0, 0.0]
    assert logp_new.grad[1].tolist() == pytest.approx([-1.1 / 4, 0.9 / 4], rel=1e-12)


def test_is_weights_scale_terms_and_per_sample_advantages_broadcast():
    lp = torch.log(torch.tensor([[1.1, 0.9]], dtype=D64))
    w = torch.tensor([[2.0, 0.5]], dtype=D64)
    loss, st = policy_loss(lp, torch.zeros_like(lp), torch.tensor([1.0], dtype=D64), torch.ones(1, 2), w)
    assert loss.item() == pytest.approx((-1.1 * 2.0 - 0.9 * 0.5) / 2, rel=1e-12)
    assert float(st["pg/is_weight_mean"]) == pytest.approx(1.25)


def test_k3_kl_to_reference():
    lp = torch.zeros(1, 2, dtype=D64)
    ref = torch.tensor([[0.5, -0.5]], dtype=D64)
    loss, st = policy_loss(lp, lp, torch.zeros(1, dtype=D64), torch.ones(1, 2), None, logp_ref=ref, kl_coef=0.1)
    k3 = [math.exp(d) - d - 1 for d in (0.5, -0.5)]
    assert float(st["pg/kl_loss"]) == pytest.approx(sum(k3) / 2, rel=1e-12)
    assert loss.item() == pytest.approx(0.1 * sum(k3) / 2, rel=1e-12)
    loss0, st0 = policy_loss(lp, lp, torch.zeros(1, dtype=D64), torch.ones(1, 2), None, logp_ref=ref)
    assert loss0.item() == 0.0 and "pg/kl_loss" not in st0  # kl_coef defaults to 0: off


def test_global_token_mean_over_microbatches():
    g = torch.Generator().manual_seed(0)
    lp_old = -torch.rand(6, 5, generator=g, dtype=D64)
    lp_new = (lp_old + 0.3 * torch.randn(6, 5, generator=g, dtype=D64)).requires_grad_(True)
    adv = torch.randn(6, generator=g, dtype=D64)
    mask = (torch.arange(5)[None] < torch.tensor([5, 1, 3, 2, 5, 4])[:, None]).float()
    w = 0.5 + torch.rand(6, 5, generator=g, dtype=D64)
    full, _ = policy_loss(lp_new, lp_old, adv, mask, w)
    (g_full,) = torch.autograd.grad(full, lp_new)
    n = count_valid_tokens(mask)
    assert n == int(mask.sum())
    total = 0.0
    for rows in (slice(0, 1), slice(1, 4), slice(4, 6)):  # uneven micro-batches
        part, _ = policy_loss(lp_new[rows], lp_old[rows], adv[rows], mask[rows], w[rows], num_tokens_global=n)
        total = total + part
    (g_parts,) = torch.autograd.grad(total, lp_new)
    assert total.item() == pytest.approx(full.item(), abs=1e-12)
    torch.testing.assert_close(g_parts, g_full, rtol=0, atol=1e-14)


def test_padding_garbage_and_empty_mask():
    lp_new = torch.tensor([[-0.1, float("nan")]], requires_grad=True)
    lp_old = torch.tensor([[-0.2, float("-inf")]])
    mask = torch.tensor([[1.0, 0.0]])
    loss, st = policy_loss(lp_new, lp_old, torch.tensor([1.0]), mask, torch.tensor([[1.0, float("nan")]]))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp_new.grad).all() and lp_new.grad[0, 1] == 0
    assert all(math.isfinite(float(v)) for v in st.values())
    lp = torch.zeros(2, 3, requires_grad=True)
    loss, st = policy_loss(lp, lp.detach(), torch.ones(2), torch.zeros(2, 3))
    loss.backward()
    assert loss.item() == 0.0 and all(math.isfinite(float(v)) for v in st.values())


def test_bf16_inputs_are_upcast():
    lp_old = torch.tensor([[-1.0, -2.0]], dtype=torch.bfloat16)
    lp_new = (lp_old.float() + torch.tensor([[0.01, -0.01]])).to(torch.bfloat16).requires_grad_(True)
    loss, _ = policy_loss(lp_new, lp_old, torch.ones(1), torch.ones(1, 2))
    assert loss.dtype == torch.float32
    loss.backward()
    assert lp_new.grad.dtype == torch.bfloat16
