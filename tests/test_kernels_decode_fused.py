"""The static decode step's fused kernels (kernels/decode_fused.py) against their torch references, and the
references against the modules and Megatron functions whose op sequence they reproduce.

Without a GPU the kernels run in the Triton interpreter (tests/conftest.py); with one, on CUDA tensors.
float32: within float32 round-off (the kernels sum squares in another order). bfloat16: every intermediate
the torch code rounds is rounded the same way, so at least 99% of the outputs are bit-identical and the
rest one bf16 ulp away (a sum of squares that lands on the other side of a rounding boundary).
"""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megatron_qrl.kernels.decode_fused import (add_rmsnorm, add_rmsnorm_reference, embed_rmsnorm, qk_norm_rope_cache,
                                               qk_norm_rope_cache_reference, rmsnorm_reference, rope_tables,
                                               rotate_half_rope_reference)

from test_rollout_kernels import source_model  # noqa: F401  (the module-scoped test model)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]
POISON = -1234.5          # cache entries the kernel must not touch


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, g, dtype=torch.float32, scale=1.0):
    return (scale * torch.randn(*shape, generator=g)).to(dtype).to(DEVICE)


def assert_close_to_reference(out, ref):
    """float32: round-off; bf16: >= 99% bit-identical, the rest within one ulp."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=2e-6, atol=2e-6)
        return
    o, r = out.float(), ref.float()
    same = float((o == r).float().mean())
    ulp = torch.finfo(torch.bfloat16).eps * r.abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    assert same >= 0.99, same
    assert bool(((o - r).abs() <= ulp).all()), float((o - r).abs().max())


# ----------------------------------------------------------------------------------------- add + RMSNorm
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 100, 2048, 8192])
def test_add_rmsnorm_matches_reference(dtype, hidden):
    g = _gen(hidden)
    x, res = _randn(3, 5, hidden, g=g, dtype=dtype), _randn(3, 5, hidden, g=g, dtype=dtype, scale=3.0)
    weight = (1 + _randn(hidden, g=g, scale=0.1)).to(dtype)
    noise = _randn(hidden, g=g, scale=0.05)                         # AQN buffers are float32
    y, h = add_rmsnorm(x, weight, noise, 1e-6, residual=res)
    y_ref, h_ref = add_rmsnorm_reference(x, weight, noise, 1e-6, residual=res)
    assert torch.equal(h, h_ref)                                    # the residual sum: one rounding, exact
    assert_close_to_reference(y, y_ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_rmsnorm_without_residual_or_noise(dtype):
    g = _gen(1)
    x = _randn(7, 96, g=g, dtype=dtype, scale=5.0)
    weight = (1 + _randn(96, g=g, scale=0.1)).to(dtype)
    y, h = add_rmsnorm(x, weight, None, 1e-5)
    assert h is x
    assert_close_to_reference(y, add_rmsnorm_reference(x, weight, None, 1e-5)[0])
    zeros = torch.zeros(96, device=DEVICE)
    assert torch.equal(add_rmsnorm(x, weight, zeros, 1e-5)[0], y)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k", [1, 2, 8])
def test_add_rmsnorm_sums_expert_slots_in_fp32_slot_order(dtype, k):
    """x = the k slot outputs [R, k, N] of an MoE layer: their fp32 sum in slot order, rounded to the model
    dtype, is the delta added to the residual (exactly: the sum is one rounding, as is the residual add);
    a strided slot view (the down projection's [R * k, N] output viewed [R, k, N]) reads the same."""
    g = _gen(10 + k)
    x, res = _randn(6, k, 128, g=g, dtype=dtype), _randn(6, 128, g=g, dtype=dtype, scale=3.0)
    weight = (1 + _randn(128, g=g, scale=0.1)).to(dtype)
    noise = _randn(128, g=g, scale=0.05)
    y, h = add_rmsnorm(x, weight, noise, 1e-6, residual=res, slots=True)
    y_ref, h_ref = add_rmsnorm_reference(x, weight, noise, 1e-6, residual=res, slots=True)
    assert torch.equal(h, h_ref) and h.shape == res.shape
    assert_close_to_reference(y, y_ref)
    wide = _randn(6, k, 256, g=g, dtype=dtype)[:, :, :128]          # slot stride 256, row stride k * 256
    assert torch.equal(add_rmsnorm(wide, weight, noise, 1e-6, residual=res, slots=True)[1],
                       add_rmsnorm_reference(wide, weight, noise, 1e-6, residual=res, slots=True)[1])
    y0, h0 = add_rmsnorm(x, weight, None, 1e-6, slots=True)         # no residual: h is the slot sum itself
    assert torch.equal(h0, add_rmsnorm_reference(x, weight, None, 1e-6, slots=True)[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=str)
@pytest.mark.parametrize("slots, hidden", [(0, 256), (4, 256), (2, 1024), (8, 2048), (0, 4096), (8, 5120), (0, 7168)],
                         ids=str)
def test_add_rmsnorm_also_writes_the_consumers_conversions(dtype, slots, hidden):
    """wide / f16_operand: the same launch also writes y.to(wide.dtype) (the router's float32 input) and the
    grouped expert kernels' fp16 operand (moe_grouped_gemm.to_fp16_operand of y in bf16), which replace
    those conversion launches in the decode step; y and h stay bit for bit what they are without them (on a
    GPU: the compiled variants must not sum differently; 2048 / 4096 are the bench models' widths, and the
    widths together take each num_warps the launch picks, 1 to 16)."""
    from megatron_qrl.kernels.moe_grouped_gemm import to_fp16_operand

    g = _gen(20 + slots + hidden)
    x = _randn(*((6, slots, hidden) if slots else (6, hidden)), g=g, dtype=dtype)
    res = _randn(6, hidden, g=g, dtype=dtype, scale=3.0)
    weight, noise = (1 + _randn(hidden, g=g, scale=0.1)).to(dtype), _randn(hidden, g=g, scale=0.05)
    y, h = add_rmsnorm(x, weight, noise, 1e-6, residual=res, slots=bool(slots))
    for wide_dtype in (torch.float32, torch.float64):
        wide = torch.full((6, hidden), POISON, dtype=wide_dtype, device=DEVICE)
        f16 = torch.full((6, hidden), POISON, dtype=torch.float16, device=DEVICE)
        y2, h2 = add_rmsnorm(x, weight, noise, 1e-6, residual=res, slots=bool(slots), wide=wide, f16_operand=f16)
        assert torch.equal(y2, y) and torch.equal(h2, h)
        assert torch.equal(wide, y.to(wide_dtype))
        assert torch.equal(f16, to_fp16_operand(y.to(torch.bfloat16)))
    y3, _ = add_rmsnorm(x, weight, noise, 1e-6, residual=res, slots=bool(slots), wide=wide)   # either one alone
    assert torch.equal(y3, y) and torch.equal(wide, y.to(wide.dtype))
    for bad in (dict(wide=wide[:5]), dict(wide=wide.to(torch.float16)), dict(f16_operand=wide),
                dict(f16_operand=f16[:, :128])):
        with pytest.raises(ValueError, match="contiguous"):
            add_rmsnorm(x, weight, noise, 1e-6, residual=res, slots=bool(slots), **bad)
    with pytest.raises(ValueError, match="bfloat16"):           # float32 x: refused (it summed differently on a GPU)
        add_rmsnorm(x.float(), weight.float(), noise, 1e-6, residual=res.float(), slots=bool(slots),
                    wide=wide.to(torch.float32))


def test_noise_is_rounded_to_the_weight_dtype_before_the_multiply():
    """weight + noise is a bf16 add (RMSNorm.effective_weight): noise below half a weight ulp vanishes."""
    weight = torch.ones(64, dtype=torch.bfloat16, device=DEVICE)
    noise = torch.full((64,), 2.0 ** -10, device=DEVICE)            # < half of bf16's ulp at 1.0 (2^-8)
    x = torch.linspace(-2, 2, 64, device=DEVICE).to(torch.bfloat16).reshape(1, 64)
    y, _ = add_rmsnorm(x, weight, noise, 1e-6)
    assert torch.equal(y, add_rmsnorm(x, weight, None, 1e-6)[0])
    assert torch.equal(y, add_rmsnorm_reference(x, weight, noise, 1e-6)[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_embed_rmsnorm_is_embedding_then_norm(dtype):
    g = _gen(2)
    table = _randn(50, 72, g=g, dtype=dtype)
    tokens = torch.tensor([3, 49, 0, 3, 17], device=DEVICE)
    weight, noise = (1 + _randn(72, g=g, scale=0.1)).to(dtype), _randn(72, g=g, scale=0.05)
    y, h = embed_rmsnorm(tokens, table, weight, noise, 1e-6)
    emb = F.embedding(tokens, table)
    assert torch.equal(h, emb)
    assert_close_to_reference(y, rmsnorm_reference(emb, weight, noise, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rmsnorm_reference_is_the_model_norm(dtype):
    """The reference is bit for bit models/aqn_norm.py RMSNorm.forward (weights and AQN noise read from it)."""
    from megatron_qrl.models.aqn_norm import RMSNorm

    g = _gen(3)
    norm = RMSNorm(SimpleNamespace(params_dtype=dtype, sequence_parallel=False), 80, eps=1e-5).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.randn(80, generator=g) * 0.1)
        norm.aqn_noise.copy_(torch.randn(80, generator=g) * 0.05)
    x = _randn(4, 80, g=g, dtype=dtype)
    assert torch.equal(rmsnorm_reference(x, norm.weight, norm.aqn_noise, norm.eps), norm(x))


# ---------------------------------------------------------------------- QK-norm + RoPE + KV cache write
def _qkv_case(dtype, heads, groups, head_dim, rot_dim, batch=4, slots=6, max_len=20, seed=0, norm=True,
              noise=True):
    g = _gen(seed)
    mixed = _randn(batch, groups * (heads // groups + 2) * head_dim, g=g, dtype=dtype, scale=2.0)
    qw = (1 + _randn(head_dim, g=g, scale=0.1)).to(dtype) if norm else None
    kw = (1 + _randn(head_dim, g=g, scale=0.1)).to(dtype) if norm else None
    qz = _randn(head_dim, g=g, scale=0.05) if norm and noise else None
    kz = _randn(head_dim, g=g, scale=0.05) if norm and noise else None
    inv = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv)
    freqs = torch.cat([angles, angles], -1).reshape(max_len, 1, 1, rot_dim).to(DEVICE)
    cos, sin = rope_tables(freqs, dtype)
    positions = torch.randperm(max_len, generator=g)[:batch].to(DEVICE)
    slot_ids = torch.randperm(slots, generator=g)[:batch].to(DEVICE)
    cache = torch.full((slots, max_len, groups, head_dim), POISON, dtype=dtype, device=DEVICE)
    return dict(mixed=mixed, q_weight=qw, k_weight=kw, eps=1e-6, cos=cos, sin=sin, positions=positions,
                slots=slot_ids, num_heads=heads, num_groups=groups, head_dim=head_dim, q_noise=qz,
                k_noise=kz), cache, freqs


def _run_both(case, cache):
    kc, vc, kc_ref, vc_ref = (cache.clone() for _ in range(4))
    q = qk_norm_rope_cache(k_cache=kc, v_cache=vc, **case)
    q_ref = qk_norm_rope_cache_reference(k_cache=kc_ref, v_cache=vc_ref, **case)
    return (q, kc, vc), (q_ref, kc_ref, vc_ref)


# (heads, groups, head_dim, rot_dim): GQA with 1..4 query heads per group, partial rotary, odd head_dim
SHAPES = [(4, 2, 16, 16), (8, 2, 32, 16), (6, 2, 24, 8), (3, 3, 16, 16), (8, 1, 64, 64), (32, 4, 128, 128)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}g{}d{}r{}".format(*s))
def test_qk_norm_rope_cache_matches_reference(dtype, shape):
    case, cache, _ = _qkv_case(dtype, *shape, seed=sum(shape))
    (q, kc, vc), (q_ref, kc_ref, vc_ref) = _run_both(case, cache)
    assert q.shape == (4, shape[0], shape[2]) and q.is_contiguous()
    assert_close_to_reference(q, q_ref)
    written = torch.zeros(cache.shape[:2], dtype=torch.bool, device=DEVICE)
    written[case["slots"], case["positions"]] = True
    for out, ref in ((kc, kc_ref), (vc, vc_ref)):
        assert bool((out[~written] == POISON).all())                # untouched rows stay untouched
        assert_close_to_reference(out[written], ref[written])
    assert torch.equal(vc, vc_ref)                                  # values are copied, never computed


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_qk_rope_cache_without_qk_norm(dtype):
    case, cache, _ = _qkv_case(dtype, 8, 2, 32, 16, seed=9, norm=False)
    (q, kc, vc), (q_ref, kc_ref, vc_ref) = _run_both(case, cache)
    assert torch.equal(q, q_ref) and torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)   # no reduction


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_qk_reference_is_the_decode_model_op_sequence(dtype):
    """The reference equals, bit for bit, what DecodeModel's torch path does: the model's QK RMSNorm modules,
    Megatron's unfused RoPE on the RotaryEmbedding angles (cos/sin per call) and the cache index_put."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from megatron_qrl.models.aqn_norm import RMSNorm

    heads, groups, D, rot = 6, 2, 32, 16
    case, cache, freqs = _qkv_case(dtype, heads, groups, D, rot, seed=5)
    cfg = SimpleNamespace(params_dtype=dtype, sequence_parallel=False)
    q_ln, k_ln = RMSNorm(cfg, D, eps=case["eps"]).to(DEVICE), RMSNorm(cfg, D, eps=case["eps"]).to(DEVICE)
    with torch.no_grad():
        for ln, w, z in ((q_ln, "q_weight", "q_noise"), (k_ln, "k_weight", "k_noise")):
            ln.weight.copy_(case[w])
            ln.aqn_noise.copy_(case[z])
    B, hpg = case["mixed"].shape[0], heads // groups
    mixed = case["mixed"].view(B, groups, (hpg + 2) * D)
    q = q_ln(mixed[..., :hpg * D].reshape(B, heads, D))
    k = k_ln(mixed[..., hpg * D:(hpg + 1) * D])
    v = mixed[..., (hpg + 1) * D:]
    f = freqs[case["positions"]]
    q = _apply_rotary_pos_emb_bshd(q.unsqueeze(1), f).squeeze(1)
    k = _apply_rotary_pos_emb_bshd(k.unsqueeze(1), f).squeeze(1)
    kc, vc = cache.clone(), cache.clone()
    kc[case["slots"], case["positions"]] = k
    vc[case["slots"], case["positions"]] = v
    kc_ref, vc_ref = cache.clone(), cache.clone()
    q_ref = qk_norm_rope_cache_reference(k_cache=kc_ref, v_cache=vc_ref, **case)
    assert torch.equal(q, q_ref) and torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    t = _randn(3, 1, 2, D, g=_gen(6), dtype=dtype)                  # the RoPE piece alone, tables vs per call
    c, s = rope_tables(freqs, dtype)
    pos = torch.tensor([0, 7, 19], device=DEVICE)
    assert torch.equal(rotate_half_rope_reference(t, c[pos].view(3, 1, 1, rot), s[pos].view(3, 1, 1, rot)),
                       _apply_rotary_pos_emb_bshd(t, freqs[pos]))


def test_qk_norm_rope_cache_rejects_bad_layouts():
    case, cache, _ = _qkv_case(torch.float32, 4, 2, 16, 16)
    with pytest.raises(ValueError, match="not \\[B"):
        qk_norm_rope_cache(k_cache=cache, v_cache=cache.clone(), **dict(case, num_heads=6))
    with pytest.raises(ValueError, match="both"):
        qk_norm_rope_cache(k_cache=cache, v_cache=cache.clone(), **dict(case, k_weight=None))
    with pytest.raises(ValueError, match="caches"):
        qk_norm_rope_cache(k_cache=cache.transpose(2, 3), v_cache=cache.transpose(2, 3), **case)


# ------------------------------------------------------------------------------- inside DecodeModel
def _decode_models(source_model, **kw):
    """(fused, unfused): the kernel-path DecodeModel of a static engine, and a copy with the fused kernels off
    (torch norms, RoPE and cache writes; same experts and attention kernel) over its own copy of the cache."""
    import copy

    from megatron_qrl.rollout.decode_path import build_graph_loop

    from test_rollout_static import engine

    eng = engine(source_model, "static", kernels="on", weights="nvfp4", scheme="w4a16", **kw)
    fused = build_graph_loop(eng, "static").model
    g = _gen(11)
    c = fused.cache                                          # a history for the attention to read
    if c.packed:
        slots, length, groups, dim = c.shape
        every_slot, every_pos = torch.arange(slots).repeat_interleave(length), torch.arange(length).repeat(slots)
        for layer in range(c.num_layers):
            c.write(layer, every_slot, every_pos, *(torch.randn(slots * length, groups, dim, generator=g) for _ in "kv"))
    else:
        for t in c.keys + c.values:
            t.copy_(torch.randn(t.shape, generator=g))
    unfused = copy.copy(fused)
    unfused.fused_norms = unfused.fused_qkv = False
    unfused.cache = copy.copy(fused.cache)
    unfused.cache.keys = [k.clone() for k in fused.cache.keys]
    unfused.cache.values = [v.clone() for v in fused.cache.values]
    return eng, fused, unfused


def _step_both(fused, unfused):
    tokens, positions = torch.tensor([5, 17, 40]), torch.tensor([9, 0, 30])
    slots, active = torch.tensor([2, 0, 4]), torch.tensor([True, True, False])   # row 2: the scratch slot
    (a, ra), (b, rb) = (m.forward(tokens, positions, slots, active) for m in (fused, unfused))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.equal(ra.routed, rb.routed)
    for x, y in zip(_cache_values(fused.cache), _cache_values(unfused.cache)):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)
    return a


def _cache_values(cache):
    """Every layer's K and V of every slot, as values (dequantized from a packed cache)."""
    every = torch.arange(cache.shape[0])
    return [t for layer in range(cache.num_layers) for t in cache.read(layer, every, cache.max_len)]


# The DecodeModel-level tests run the CPU test engine's kernels in the Triton interpreter; with a GPU visible
# (QRL_KERNEL_TESTS_DEVICE=cuda runs of this file) they would hand CPU tensors to compiled kernels.
CPU_ENGINE_ONLY = pytest.mark.skipif(DEVICE == "cuda", reason="runs the CPU test engine under the interpreter")


@CPU_ENGINE_ONLY
def test_decode_model_fused_path_equals_torch_path_and_sees_updates(source_model):
    """The fused kernels inside DecodeModel.forward against its torch code; weights and AQN noise changed in
    place afterwards reach the fused path (read at call time, as captured graphs need)."""
    eng, fused, unfused = _decode_models(source_model)
    assert fused.fused_norms and fused.fused_qkv and not unfused.fused_qkv
    before = _step_both(fused, unfused)
    eng.set_aqn_noise(0.05, seed=1)
    layer = eng.model.decoder.layers[0]
    with torch.no_grad():
        layer.self_attention.q_layernorm.weight.mul_(1.5)
        eng.model.decoder.final_layernorm.weight.add_(0.25)
    after = _step_both(fused, unfused)
    assert float(layer.input_layernorm.aqn_noise.abs().max()) > 0
    assert not torch.allclose(before, after)


@CPU_ENGINE_ONLY
@pytest.mark.parametrize("kv_cache", ["fp8", "fp4"])
def test_decode_model_quantized_kv_writes(source_model, kv_cache):
    """A packed cache (fp8 here: the test model's head_dim 16 is too small for packed fp4) takes the fused
    QK-norm + RoPE through a staging buffer and the quantize-write kernel, the unfused copy the torch
    QK-norm + RoPE and the same kernel; a dequantized one (fp4) keeps the torch quantizing write. The norms
    fuse in both."""
    _, fused, unfused = _decode_models(source_model, kv_cache=kv_cache)
    packed = kv_cache == "fp8"
    assert fused.cache.packed == packed and fused.fused_norms and fused.fused_qkv == packed
    _step_both(fused, unfused)
