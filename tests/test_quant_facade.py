"""quant/ as the one FP4 facade: the format objects, their one dispatch point, the block sizes and site names
defined once, the W4A16 weight-layout and launcher registries."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_qrl.quant import (MXFP4, NVFP4, GuidedRounding, block_size, fp4_format, mxfp4_quantize, nvfp4_quantize,
                                parse_site_name, quant_dequant, site_name)


ROOT = Path(__file__).resolve().parents[1]


def _x(seed=0, shape=(8, 64), dtype=torch.float32):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


def _bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def test_format_objects_describe_their_format():
    assert (NVFP4.block, NVFP4.scale_dtype, NVFP4.has_global_scale) == (16, torch.float8_e4m3fn, True)
    assert (MXFP4.block, MXFP4.scale_dtype, MXFP4.has_global_scale) == (32, torch.uint8, False)
    assert fp4_format("nvfp4") is NVFP4 and fp4_format("mxfp4") is MXFP4
    assert block_size("nvfp4") == 16 and block_size("mxfp4") == 32
    with pytest.raises(ValueError, match="unknown FP4 format 'fp8'.*nvfp4"):
        fp4_format("fp8")
    with pytest.raises(ValueError, match="unknown FP4 format 'bf16'"):
        block_size("bf16")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_format_objects_on_cpu_are_the_reference_codec(dtype):
    x = _x(1, dtype=dtype)
    enc = NVFP4.quantize(x, capture=True)
    for a, b in zip(enc, nvfp4_quantize(x, capture=True)):
        _same(a, b)
    enc = MXFP4.quantize(x, capture=True)
    ref = mxfp4_quantize(x, capture=True)
    assert enc.global_scale is None
    for a, b in zip((enc.packed, enc.scales, enc.bits), ref):
        _same(a, b)
    for f in (NVFP4, MXFP4):
        values, captured = f.fake_quant(x, capture=True)
        _same(values, quant_dequant(x, f.name))
        _same(f.dequantize(captured.packed, captured.scales, captured.global_scale, dtype), values)
        guide = GuidedRounding(captured.bits, captured.scales, captured.global_scale)
        stats, ref_stats = {}, {}
        noisy = x + 0.01 * _x(2, dtype=dtype)
        replay, _ = f.guided(noisy, guide, stats=stats)
        _same(replay, quant_dequant(noisy, f.name, guide=guide, stats=ref_stats))
        assert stats == ref_stats and stats["guided_elements"] == x.numel()


def test_nvfp4_rows_with_their_own_global_scales_equal_one_call_per_row():
    x = _x(3, shape=(4, 32))
    gs = torch.tensor([[0.01], [0.002], [0.03], [0.0005]])
    values, enc = NVFP4.fake_quant(x, gs, capture=True)
    for r in range(4):
        ref = nvfp4_quantize(x[r:r + 1], gs[r, 0], capture=True)
        _same(enc.packed[r:r + 1], ref[0])
        _same(enc.bits[r:r + 1], ref[3])
    assert torch.equal(NVFP4.global_scales(torch.tensor([0.0, 6.0 * 448])), torch.tensor([1 / (6 * 448), 1.0]))
    assert MXFP4.global_scales(torch.tensor([1.0])) is None


def test_every_codec_call_dispatches_at_the_backend(monkeypatch):
    """QRL_KERNELS=triton under the interpreter sends the format objects' calls to the Triton codec (the same
    bytes); QRL_KERNELS=torch keeps them on the reference. One predicate decides: kernels.backend.use_triton."""
    pytest.importorskip("triton")
    from megatron_qrl.kernels import backend, fp4_fake_quant, fp4_quant

    if not backend.interpreter_enabled():
        pytest.skip("needs TRITON_INTERPRET=1 (tests/conftest.py sets it without a GPU)")
    calls = []
    for mod, name in ((fp4_quant, "nvfp4_quantize_triton"), (fp4_fake_quant, "nvfp4_fake_quant_triton"),
                      (fp4_fake_quant, "fp4_fake_quant_capture_triton")):
        original = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _f=original, _n=name, **kw: calls.append(_n) or _f(*a, **kw))
    x = _x(4, shape=(4, 32))
    ref = nvfp4_quantize(x, capture=True)
    monkeypatch.setenv("QRL_KERNELS", "torch")
    NVFP4.quantize(x)
    NVFP4.fake_quant(x)
    assert calls == []
    monkeypatch.setenv("QRL_KERNELS", "triton")
    enc = NVFP4.quantize(x, capture=True)
    for a, b in zip(enc, ref):
        _same(a, b)
    values, captured = NVFP4.fake_quant(x, ref[2], capture=True)
    _same(values, quant_dequant(x, "nvfp4", global_scale=ref[2]))
    _same(captured.packed, ref[0])
    NVFP4.fake_quant(x)
    assert calls == ["nvfp4_quantize_triton", "fp4_fake_quant_capture_triton", "nvfp4_fake_quant_triton"]
    calls.clear()
    NVFP4.quantize(x, "stochastic", generator=torch.Generator().manual_seed(0))   # reference only
    NVFP4.fake_quant(x, kernels=False)                                          # a caller's explicit choice
    assert calls == []


def test_block_sizes_are_defined_once():
    from megatron_qrl.kernels import fp4_quant, layouts
    from megatron_qrl.quant import blocks, mxfp4, nvfp4
    from megatron_qrl.trace import cache

    assert blocks.BLOCK_SIZES == {"nvfp4": 16, "mxfp4": 32}
    for module in (fp4_quant, layouts):
        assert (module.NVFP4_BLOCK, module.MXFP4_BLOCK) == (blocks.NVFP4_BLOCK, blocks.MXFP4_BLOCK)
    assert nvfp4.BLOCK is blocks.NVFP4_BLOCK and mxfp4.BLOCK is blocks.MXFP4_BLOCK and cache.BLOCK is nvfp4.BLOCK


@pytest.mark.parametrize("name, parsed", [("L0.qkv", (0, "qkv", None)), ("L3.fc1.E17", (3, "fc1", 17)),
                                          ("L12.shared_fc2", (12, "shared_fc2", None))])
def test_site_names_round_trip_through_every_reader(name, parsed):
    from megatron_qrl.models.fp4_linear import site_name as model_site_name
    from megatron_qrl.trace.cache import EntryKey

    assert tuple(parse_site_name(name)) == parsed
    assert site_name(*parsed) == name == model_site_name(*parsed)
    key = EntryKey.from_site_name(name)
    assert (key.layer, key.site, None if key.expert < 0 else key.expert) == parsed and key.site_name == name


@pytest.mark.parametrize("bad", ["3.fc1", "L3", "L3.fc1.17", "Lx.fc1", "L3.fc1.E", "L3..fc1"])
def test_a_bad_site_name_is_refused_naming_the_grammar(bad):
    from megatron_qrl.rollout.capture import scatter_records

    with pytest.raises(ValueError, match=r"L<layer>\.<role>\[\.E<expert>\]"):
        parse_site_name(bad)

    class Record:
        site = bad

    with pytest.raises(RuntimeError, match="unknown site"):
        scatter_records([Record()], None, 1, [], "nvfp4")


def test_light_quant_modules_import_without_torch():
    code = ("import sys; import megatron_qrl.quant.blocks, megatron_qrl.quant.sites, megatron_qrl.config; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr


def test_w4a16_weight_layouts_are_one_registry():
    pytest.importorskip("triton")
    from megatron_qrl.kernels import WEIGHT_LAYOUTS, prepare_weight
    from megatron_qrl.kernels.layouts import prepare_mxfp4_weight, prepare_nvfp4_weight

    assert set(WEIGHT_LAYOUTS) == {"nvfp4", "mxfp4"}
    x = _x(5, shape=(16, 64))
    p, s, g = nvfp4_quantize(x)
    a, b = prepare_weight("nvfp4", p, s, g), prepare_nvfp4_weight(p, s, g)
    assert a.fmt == "nvfp4" and all(torch.equal(_bits(u), _bits(v)) for u, v in
                                    ((a.qweight, b.qweight), (a.scales, b.scales), (a.global_scale, b.global_scale)))
    p, s = mxfp4_quantize(x)
    assert torch.equal(prepare_weight("mxfp4", p, s).scales, prepare_mxfp4_weight(p, s).scales)
    with pytest.raises(ValueError, match="no W4A16 weight layout for format 'bf16'"):
        prepare_weight("bf16", p, s)


def test_w4a16_launchers_are_one_registry():
    pytest.importorskip("triton")
    from megatron_qrl.kernels import w4a16_gemm as D
    from megatron_qrl.kernels.w4a16_gemv import GemvConfig
    from megatron_qrl.kernels.w4a16_gluon_gemm import GluonGemmConfig
    from megatron_qrl.kernels.w4a16_mma_gemv import MmaGemvConfig

    assert set(D.LAUNCHERS) == {D.GemmConfig, GemvConfig, MmaGemvConfig, GluonGemmConfig}
    with pytest.raises(TypeError, match="no W4A16 kernel for a str"):
        D._launch(None, None, "not a config", None)
