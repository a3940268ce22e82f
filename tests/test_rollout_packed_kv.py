"""The engine on a packed fp4 / fp8 KV cache (rollout/kv_cache.py packed storage), kernels through the Triton
interpreter: the engine packs its cache when its kernels are on (as on CUDA).

The tiny MoE of test_rollout_engine.py with head_dim 32 (packed fp4 needs >= 32), fp32. The eager engine reads
the packed cache dequantized, so its numbers do not depend on the storage (bit for bit). The static decode step
writes the cache with the quantize-write kernel and attends from the packed bytes with the decode-attention
kernel (float32 dots for an fp32 model): against the eager engine on the same kernels, to the tolerance of the
bf16-cache kernel path (test_rollout_static.py).
"""
import pytest
import torch

from megatron_qrl.rollout import EmbeddedEngine, SamplingParams
from megatron_qrl.rollout import embedded

from test_rollout_engine import make_cfg, prompts
from test_rollout_kernels import built_model
from test_rollout_static import BF16_FLIP_LOGP, ROUNDOFF_LOGP, assert_same

HEAD_DIM = 32


def cfg_of(decode="eager", kv_cache="fp4", **kw):
    cfg = make_cfg(kv_cache=kv_cache, **kw)
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"kv_channels": HEAD_DIM}),
                                  "rollout": cfg.rollout.model_copy(update={"decode": decode, "decode_window": 2})})


@pytest.fixture(scope="module")
def wide_model():
    yield from built_model(cfg_of())


def engine(model, kernels="on", **kw):
    e = EmbeddedEngine(cfg_of(**kw), keep_codes=True, kernels=kernels)
    e.sync_from_model(model, version=0)
    return e


PROMPTS = dict(lengths=(5, 9, 3), seed=4)
SAMPLING = SamplingParams(temperature=0.0, max_new_tokens=4)


@pytest.mark.parametrize("kv_cache", ["fp4", "fp8"])
def test_eager_engine_numbers_do_not_depend_on_the_storage(wide_model, kv_cache, monkeypatch):
    ps = prompts(*PROMPTS["lengths"], seed=PROMPTS["seed"])
    packed = engine(wide_model, kv_cache=kv_cache)
    monkeypatch.setattr(embedded, "packed_storage", lambda *a: False)
    plain = engine(wide_model, kv_cache=kv_cache)
    assert packed.cache.packed and not plain.cache.packed and packed.health()["kv_cache_packed"]
    a, b = packed.generate(ps, SAMPLING), plain.generate(ps, SAMPLING)
    for x, y in zip(a, b):
        assert x.tokens == y.tokens and torch.equal(x.logprobs, y.logprobs)
    # fp32 model, head_dim 32: 4 B per value dequantized; fp4 packs a 32-value row into 16 + 2 + 4 bytes
    assert plain.cache.nbytes() / packed.cache.nbytes() == pytest.approx(128 / (22 if kv_cache == "fp4" else 36))


@pytest.mark.parametrize("kv_cache", ["fp4", "fp8"])
def test_static_step_on_the_packed_cache_equals_eager_engine(wide_model, kv_cache):
    ps = prompts(*PROMPTS["lengths"], seed=PROMPTS["seed"])
    eager = engine(wide_model, kv_cache=kv_cache)
    static = engine(wide_model, decode="static", kv_cache=kv_cache)
    assert static.cache.packed
    a, b = eager.generate(ps, SAMPLING), static.generate(ps, SAMPLING)
    assert static.health()["decode"] == "static"
    loop = static._static_loop.model
    assert loop.fused_qkv and loop.kernel_attention       # fused QK-norm + RoPE -> staging -> quantize-write
    assert_same(a, b, logp_atol=BF16_FLIP_LOGP, min_byte_agreement=0, scale_rtol=None, routed_sets=True,
                logp_median_atol=ROUNDOFF_LOGP)          # test_rollout_static.BF16_FLIP_LOGP says why


def test_static_reference_path_reads_the_packed_cache(wide_model, monkeypatch):
    """kernel_attention=False (the reference step, kernels off) on a packed cache: torch writes, dequantized
    reads; equal to the eager engine on a dequantized cache to float32 round-off."""
    ps = prompts(*PROMPTS["lengths"], seed=PROMPTS["seed"])
    eager = engine(wide_model, kernels="off", kv_cache="fp8")
    monkeypatch.setattr(embedded, "packed_storage", lambda *a: True)
    static = engine(wide_model, kernels="off", decode="static", kv_cache="fp8")
    assert static.cache.packed and not eager.cache.packed
    assert_same(eager.generate(ps, SAMPLING), static.generate(ps, SAMPLING), trace=False, logp_atol=1e-5)
    assert not static._static_loop.model.kernel_attention
