import pytest
import torch

from megatron_qrl.config import AQNConfig
from megatron_qrl.rl import aqn_noise, aqn_sigma, aqn_stage

CFG = {"sigma_start": 1e-2, "sigma_end": 1e-4, "stages": 10}


def test_stage_boundaries():
    m = 100  # M/K = 10 steps per stage
    assert [aqn_sigma(s, m, CFG) for s in range(10)] == [0.0] * 10
    assert aqn_sigma(10, m, CFG) == 1e-2 and aqn_sigma(19, m, CFG) == 1e-2
    assert aqn_sigma(90, m, CFG) == 1e-4 and aqn_sigma(99, m, CFG) == 1e-4
    assert aqn_sigma(500, m, CFG) == 1e-4  # past the end: clamped to stage K-1
    for k in range(1, 10):  # geometric: sigma_k = s0 * (s1/s0)^((k-1)/(K-2))
        assert aqn_sigma(10 * k, m, CFG) == pytest.approx(1e-2 * (1e-2) ** ((k - 1) / 8), rel=1e-12)
    ratios = [aqn_sigma(10 * (k + 1), m, CFG) / aqn_sigma(10 * k, m, CFG) for k in range(1, 9)]
    assert ratios == pytest.approx([ratios[0]] * 8, rel=1e-9)


def test_uneven_steps_per_stage_and_config_object():
    # M=25, K=10: stage = floor(step*10/25); step 2 -> 0, step 3 -> 1, step 24 -> 9
    assert aqn_stage(2, 25, 10) == 0 and aqn_stage(3, 25, 10) == 1 and aqn_stage(24, 25, 10) == 9
    cfg = AQNConfig()
    assert aqn_sigma(3, 25, cfg) == cfg.sigma_start and aqn_sigma(24, 25, cfg) == cfg.sigma_end
    assert aqn_sigma(24, 25, AQNConfig(enabled=False)) == 0.0
    assert aqn_sigma(7, 10, {"sigma_start": 0.1, "sigma_end": 0.01, "stages": 2}) == 0.1


def test_noise_draw():
    assert torch.equal(aqn_noise([8], 0.0), torch.zeros(8))
    a = aqn_noise([4096], 0.01, torch.Generator().manual_seed(3))
    b = aqn_noise([4096], 0.01, torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and a.shape == (4096,)
    assert a.std().item() == pytest.approx(0.01, rel=0.05) and abs(a.mean().item()) < 1e-3
    assert aqn_noise(16, 0.1, dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError):
        aqn_noise([2], -1.0)
