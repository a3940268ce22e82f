import math

import pytest
import torch

from megatron_qrl.rl import grpo_advantages


def test_hand_computed_group():
    # group 1: rewards 1,0,0,0 -> mean 0.25, population std sqrt(0.25*0.75)
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0, 2.0, 4.0]), 4, eps=0.0)
    std1 = math.sqrt(0.25 * 0.75)
    expected = [0.75 / std1, -0.25 / std1, -0.25 / std1, -0.25 / std1, -1.0, 1.0, -1.0, 1.0]
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)


def test_eps_in_denominator_and_no_std():
    r = torch.tensor([0.0, 1.0], dtype=torch.float64)
    assert grpo_advantages(r, 2, eps=0.5).tolist() == pytest.approx([-0.5 / 1.0, 0.5 / 1.0])
    assert grpo_advantages(r, 2, normalize_std=False).tolist() == [-0.5, 0.5]


def test_zero_variance_groups_are_exactly_zero():
    r = torch.tensor([0.1, 0.1, 0.1, 1.0, 1.0, 1.0, 0.0, 1.0, 0.5])
    adv = grpo_advantages(r, 3)
    assert adv[:6].tolist() == [0.0] * 6
    assert adv[6:].abs().sum() > 0 and torch.isfinite(adv).all()
    assert grpo_advantages(r, 3, normalize_std=False)[:6].tolist() == [0.0] * 6


def test_list_and_int_inputs_and_group_size_one():
    assert grpo_advantages([1, 0], 2).dtype == torch.float32
    assert grpo_advantages([3.0, 5.0], 1).tolist() == [0.0, 0.0]


def test_batch_not_multiple_of_group_size_raises():
    with pytest.raises(ValueError, match="group_size"):
        grpo_advantages(torch.zeros(5), 2)
