"""Codec behaviour: rounding modes, TRACE capture/replay, packing, STE gradient, bad input."""
import pytest
import torch

from megatron_qrl.quant import (GuidedRounding, canonical, fake_quant, mxfp4_quantize, nvfp4_dequantize,
                                nvfp4_quantize, pack_bits, round_nearest, unpack_bits, unpack_nibbles)


def _codes(packed):
    return canonical(unpack_nibbles(packed))


def test_nearest_ties_to_even_and_saturation():
    z = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.75, -0.1, 0.26, 100.0])
    expected = [0, 2, 2, 4, 4, 6, 6, 7, 8 | 2, 8, 1, 7]
    assert round_nearest(z).tolist() == expected


def test_pack_layout_low_nibble_first():
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1] = 6.0, 0.5  # codes 7 and 1 -> byte 0x17
    packed, scales, g = nvfp4_quantize(x, global_scale=torch.tensor(1.0 / 448))
    assert packed[0, 0].item() == 0x17
    assert torch.equal(unpack_bits(pack_bits(torch.tensor([[1, 0, 1, 1, 0, 0, 0, 1]]))),
                       torch.tensor([[1, 0, 1, 1, 0, 0, 0, 1]], dtype=torch.uint8))
    assert pack_bits(torch.tensor([[1, 0, 1, 1, 0, 0, 0, 1]])).item() == 0b10001101


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_capture_bits_are_code_lsbs_and_guided_replays_exactly(dtype):
    x = (torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 2).to(dtype)
    packed, scales, g, bits = nvfp4_quantize(x, capture=True)
    assert bits.shape == (64, 32) and bits.dtype == torch.uint8
    assert torch.equal(unpack_bits(bits), unpack_nibbles(packed) & 1)
    stats = {}
    replay, _, _ = nvfp4_quantize(x, g, "guided", scales=scales, trace_bits=bits, stats=stats)
    assert torch.equal(replay, packed)
    assert stats["guided_fallback"] == 0 and stats["guided_elements"] == x.numel()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_guided_removes_99pct_of_disagreements_under_1pct_noise(dtype):
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(1024, 1024, generator=gen) * 3).to(dtype)
    packed, scales, g, bits = nvfp4_quantize(x, capture=True)
    noise = 1 + 0.01 * (2 * torch.rand(x.shape, generator=gen) - 1)
    x_train = (x.float() * noise).to(dtype)
    nearest, _, _ = nvfp4_quantize(x_train, g, scales=scales)
    guided, _, _ = nvfp4_quantize(x_train, g, "guided", scales=scales, trace_bits=bits)
    before = (_codes(nearest) != _codes(packed)).sum().item()
    after = (_codes(guided) != _codes(packed)).sum().item()
    assert before > 1000  # the perturbation does flip codes under independent rounding
    assert after <= 0.01 * before


def test_guided_falls_back_when_far_from_rollout():
    scales = torch.ones(1, 1).to(torch.float8_e4m3fn)
    g = torch.tensor(1.0)
    rollout = torch.zeros(1, 16)
    rollout[0, 0] = 2.0     # code 4, bit 0
    _, _, _, bits = nvfp4_quantize(rollout, g, scales=scales, capture=True)
    trainer = rollout.clone()
    trainer[0, 0] = 2.9     # nearest is 3 (bit 1); bracket [2, 3]; bit 0 -> 2.0 is 0.9 spacing away
    stats = {}
    out, _, _ = nvfp4_quantize(trainer, g, "guided", scales=scales, trace_bits=bits, stats=stats)
    assert unpack_nibbles(out)[0, 0].item() == 5 and stats["guided_fallback"] == 1
    relaxed, _, _ = nvfp4_quantize(trainer, g, "guided", scales=scales, trace_bits=bits, fallback_shift=0.5)
    assert unpack_nibbles(relaxed)[0, 0].item() == 4


def test_stochastic_rounding_is_seeded_and_unbiased():
    x = torch.full((256, 1024), 1.2)
    x[:, ::16] = 6.0  # pins every block scale to 448 and s_block * s_global to 1
    g = torch.tensor(6.0 / (6 * 448))
    a = nvfp4_quantize(x, g, "stochastic", generator=torch.Generator().manual_seed(5))[0]
    b = nvfp4_quantize(x, g, "stochastic", generator=torch.Generator().manual_seed(5))[0]
    assert torch.equal(a, b)
    deq = nvfp4_dequantize(*nvfp4_quantize(x, g, "stochastic", generator=torch.Generator().manual_seed(6)),
                           dtype=torch.float32).view(256, 64, 16)[..., 1:]
    assert set(deq.unique().tolist()) == {1.0, 1.5}
    assert abs(deq.mean().item() - 1.2) < 0.005


def test_fake_quant_straight_through_gradient_and_guided_value():
    x = torch.randn(8, 64, requires_grad=True)
    y = fake_quant(x)
    packed, scales, g, bits = nvfp4_quantize(x.detach(), capture=True)
    assert torch.equal(y.detach(), nvfp4_dequantize(packed, scales, g, torch.float32))
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    guided = fake_quant(x.detach() * 1.001, guide=GuidedRounding(bits, scales, g))
    assert torch.equal(guided, nvfp4_dequantize(packed, scales, g, torch.float32))
    mx = fake_quant(x.detach(), fmt="mxfp4")
    assert mx.shape == x.shape and (mx - x).abs().max() < x.abs().max() / 2


@pytest.mark.parametrize("bad,match", [
    (torch.randn(4, 24), "not a multiple of the block size 16"),
    (torch.tensor([[float("nan")] * 16]), "NaN"),
    (torch.tensor([[float("inf")] * 16]), "Inf"),
    (torch.empty(0, 16), "empty"),
    (torch.randint(0, 3, (4, 16)), "dtype"),
])
def test_bad_input_is_rejected_with_a_clear_error(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        nvfp4_quantize(bad)


def test_guided_requires_its_inputs():
    x = torch.randn(2, 32)
    with pytest.raises(ValueError, match="global_scale"):
        nvfp4_quantize(x, rounding="guided")
    with pytest.raises(ValueError, match="trace_bits must be uint8"):
        p, s, g = nvfp4_quantize(x)
        nvfp4_quantize(x, g, "guided", scales=s, trace_bits=torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="rounding="):
        nvfp4_quantize(x, rounding="up")
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        mxfp4_quantize(torch.randn(2, 48))


def test_guided_replay_with_one_global_scale_per_row():
    """A trainer tensor mixes rows of several engine calls (prefill, decode steps): one scale per row."""
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(9))
    parts = [nvfp4_quantize(x[i:i + 1] * (i + 1), capture=True) for i in range(6)]
    packed = torch.cat([p[0] for p in parts])
    scales = torch.cat([p[1] for p in parts])
    gscales = torch.stack([p[2] for p in parts]).reshape(6, 1)
    bits = torch.cat([p[3] for p in parts])
    rows = torch.cat([x[i:i + 1] * (i + 1) for i in range(6)])
    replay, _, _ = nvfp4_quantize(rows, gscales, "guided", scales=scales, trace_bits=bits)
    assert torch.equal(replay, packed)
    expected = torch.cat([nvfp4_dequantize(*p[:3], dtype=torch.float32) for p in parts])
    assert torch.equal(nvfp4_dequantize(packed, scales, gscales, torch.float32), expected)
    with pytest.raises(ValueError, match="one per row"):
        nvfp4_quantize(rows, torch.ones(3, 1), "guided", scales=scales, trace_bits=bits)
