"""The static decode step and its loop (rollout/static_decode.py, graph_decode.py) against the eager engine.

On the CPU the static loop runs its step without CUDA graphs (rollout.decode=static): the same code the
graphs capture on a GPU. Reference path (kernels off): its experts are the model's own Megatron experts and
its attention the eager engine's, so tokens, log-probs, routed experts and TRACE captures must equal the
eager engine's bit for bit. Kernel path (Triton interpreter): grouped FP4 expert kernels and the cache
decode-attention kernel against the eager engine with the same kernels.
"""

import pytest
import torch

from megatron_qrl.kernels.decode_fused import sum_slots
from megatron_qrl.rollout import EmbeddedEngine, SamplingParams
from megatron_qrl.rollout.decode_path import resolve_decode_mode
from megatron_qrl.rollout.graph_decode import batch_buckets
from megatron_qrl.rollout.rng import stream_keys, uniforms
from megatron_qrl.rollout.sampling import sample_rows, sample_token, sequence_generator

from test_rollout_engine import make_cfg, prompts
from test_rollout_kernels import source_model  # noqa: F401  (the module-scoped test model)


def engine(model, decode, kernels="off", window=16, **kw):
    cfg = make_cfg(**kw)
    cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"decode": decode,
                                                                            "decode_window": window})})
    e = EmbeddedEngine(cfg, keep_codes=True, kernels=kernels)
    e.sync_from_model(model, version=0)
    return e


def _raw(t):
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


# Kernel path vs eager engine under W4A16: both round the experts' float32 input to bf16 for the kernels; their
# float32 values differ by round-off (another summation order), and where one sits on a bf16 rounding tie the
# inputs differ by one bf16 ulp: that token's log-prob moves by up to ~5e-4 in the tiny models (4.3e-4 on an AMD
# EPYC host for the packed-KV test's prompts), on a token that depends on the host. Such tests bound every log-prob
# by BF16_FLIP_LOGP and their median by float32 round-off: a flip is rare and isolated, a kernel error moves every
# decode token (V row scales 0.1% off: median 6.6e-4 to 2.8e-3, max only 1.4e-3).
BF16_FLIP_LOGP = 2e-3
ROUNDOFF_LOGP = 5e-6


def assert_same(a, b, logp_atol=1e-5, trace=True, min_byte_agreement=0.99, scale_rtol=1e-5, routed_sets=False,
                logp_median_atol=None):
    """Same tokens, finish reasons and routed experts; log-probs within logp_atol (and, with logp_median_atol,
    their median over all samples within it: BF16_FLIP_LOGP says why); TRACE captures aligned
    row for row (prefill rows identical, decode rows agreeing in at least min_byte_agreement of the bytes:
    float32 round-off between two implementations can move a value across an FP4 rounding boundary).
    routed_sets: compare each token's experts as a set (the routing kernel orders a token's slots by
    descending score, torch.topk(sorted=False) in an unspecified order; R3 replays the set)."""
    assert len(a) == len(b)
    if logp_median_atol is not None:
        assert float(torch.cat([(x.logprobs - y.logprobs).abs() for x, y in zip(a, b)]).median()) <= logp_median_atol
    for x, y in zip(a, b):
        assert x.tokens == y.tokens and x.finish_reason == y.finish_reason
        assert float((x.logprobs - y.logprobs).abs().max()) <= logp_atol
        if routed_sets:
            assert torch.equal(x.routed_experts.sort(-1).values, y.routed_experts.sort(-1).values)
        else:
            assert torch.equal(x.routed_experts, y.routed_experts)
        assert x.routed_experts.shape[0] == x.num_forwarded
        if not trace:
            continue
        assert sorted(x.trace) == sorted(y.trace)
        P = len(x.prompt_ids)
        for layer, roles in x.trace.items():
            assert set(roles) == set(y.trace[layer])
            for role, cap in roles.items():
                other = y.trace[layer][role]
                assert cap.bits.shape[0] == x.num_forwarded
                for name in ("bits", "scales", "global_scale", "codes"):
                    t, u = getattr(cap, name), getattr(other, name)
                    assert (t is None) == (u is None), name
                    if t is None:
                        continue
                    assert t.dtype == u.dtype and t.shape == u.shape, (layer, role, name)
                    assert torch.equal(_raw(t[:P]), _raw(u[:P])), (layer, role, name)
                    if name == "global_scale":
                        assert scale_rtol is None or torch.allclose(t, u, rtol=scale_rtol, atol=0), (layer, role)
                    elif min_byte_agreement:
                        agree = float((_raw(t) == _raw(u)).float().mean())
                        assert agree >= min_byte_agreement, (layer, role, name, agree)


SCHEMES = [dict(weights="bf16"), dict(weights="nvfp4", scheme="w4a16"), dict(weights="nvfp4", scheme="w4a4"),
           dict(weights="mxfp4", scheme="w4a4")]


@pytest.mark.parametrize("kw", SCHEMES, ids=lambda kw: "-".join(kw.values()))
@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0, max_new_tokens=6),
                                      SamplingParams(temperature=1.0, top_k=20, top_p=0.9, max_new_tokens=8, seed=3)],
                         ids=["greedy", "sampled"])
def test_static_loop_equals_eager_engine(source_model, kw, sampling):
    ps = prompts(5, 9, 3, 7, seed=2)
    eager, static = engine(source_model, "eager", **kw), engine(source_model, "static", window=3, **kw)
    a, b = eager.generate(ps, sampling), static.generate(ps, sampling)
    assert_same(a, b)
    if kw.get("scheme") == "w4a4":
        assert sorted(b[0].trace) == [0, 1] and set(b[0].trace[0]) == {"fc1", "fc2"}
    assert static.health()["decode"] == "static" and eager.health()["decode"] == "eager"


def test_continuous_batching_and_windows(source_model):
    """More prompts than rows: admission waves refill finished rows; W4A16 tokens do not depend on the batch,
    so they equal the eager engine's; window sizes change nothing."""
    ps = prompts(4, 11, 2, 9, 6, 3, 8, seed=5)
    sp = SamplingParams(temperature=1.0, max_new_tokens=7, seed=4)
    eager = engine(source_model, "eager", weights="nvfp4", scheme="w4a16", max_batch_size=2)
    ref = eager.generate(ps, sp)
    for window in (1, 2, 5):
        static = engine(source_model, "static", window=window, weights="nvfp4", scheme="w4a16", max_batch_size=2)
        out = static.generate(ps, sp)
        assert_same(ref, out, trace=False)
        assert static._static_loop.stats["admission_waves"] >= 3


def test_stop_tokens_retire_rows_early_under_w4a4(source_model):
    """Rows that stop early stay in the batch as inactive rows; they must not change what the others compute
    (the per-expert activation scale of W4A4 is taken over active rows only)."""
    ps = prompts(5, 9, 3, 7, seed=7)
    free = engine(source_model, "eager", weights="nvfp4", scheme="w4a4").generate(
        ps, SamplingParams(temperature=0.0, max_new_tokens=8))
    stop = free[0].tokens[2]
    sp = SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(stop,))
    a = engine(source_model, "eager", weights="nvfp4", scheme="w4a4").generate(ps, sp)
    b = engine(source_model, "static", window=4, weights="nvfp4", scheme="w4a4").generate(ps, sp)
    assert a[0].finish_reason == "stop" and len(a[0].tokens) <= 3
    assert any(s.finish_reason == "length" for s in a)
    assert_same(a, b)


def test_rows_compact_when_early_ones_finish(source_model, monkeypatch):
    """A row that stops early frees its place: the rows still decoding move to the front (DecodeState.permute)
    so that a smaller bucket serves them, and the results equal the eager engine's."""
    from megatron_qrl.rollout.graph_decode import DecodeState

    ps = prompts(5, 9, 3, seed=1)
    free = engine(source_model, "eager").generate(ps, SamplingParams(temperature=0.0, max_new_tokens=8))
    sp = SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(free[0].tokens[2],))
    counts, permute = [], DecodeState.permute
    monkeypatch.setattr(DecodeState, "permute", lambda st, order, n: counts.append(n) or permute(st, order, n))
    a, b = engine(source_model, "eager").generate(ps, sp), engine(source_model, "static", window=1).generate(ps, sp)
    assert [s.finish_reason for s in a] == ["stop", "length", "length"] and counts == [2]
    assert_same(a, b, trace=False)


def test_weight_updates_and_release_resume(source_model):
    """The loop keeps working across in-place weight updates and a release/resume of the engine memory."""
    ps = prompts(6, 4, seed=3)
    sp = SamplingParams(temperature=0.0, max_new_tokens=5)
    eager = engine(source_model, "eager", weights="nvfp4", scheme="w4a16")
    static = engine(source_model, "static", weights="nvfp4", scheme="w4a16")
    static.generate(ps, sp)
    with torch.no_grad():
        noisy = [(n, p + 0.05 * torch.randn_like(p)) for n, p in source_model.named_parameters()]
    for e in (eager, static):
        from megatron_qrl.quant import pack_state

        w, h = pack_state(noisy, e.format, lambda n: n in e.store.quantized)
        e.update_weights(w, 1, h)
    assert_same(eager.generate(ps, sp), static.generate(ps, sp), trace=False)
    static.release_memory()
    static.resume_memory()
    assert static._static_loop is None
    assert_same(eager.generate(ps, sp), static.generate(ps, sp), trace=False)


@pytest.mark.parametrize("kw", [dict(weights="nvfp4", scheme="w4a16"), dict(weights="nvfp4", scheme="w4a4"),
                                dict(weights="mxfp4", scheme="w4a4")], ids=lambda kw: "-".join(kw.values()))
def test_kernel_path_equals_eager_kernel_engine(source_model, kw):
    """Grouped FP4 kernels + cache decode attention (Triton interpreter) against the eager engine on the same
    kernels. The kernels see the rows in other groupings (assignments vs dispatcher rows, a padded bucket),
    so values agree to float32/bf16 round-off, which W4A4 amplifies when a value sits on an FP4 rounding
    boundary: prefill captures are identical, decode captures stay aligned (the experts-level test below
    checks the captures on identical inputs)."""
    ps = prompts(5, 9, 3, seed=4)
    sp = SamplingParams(temperature=0.0, max_new_tokens=4)
    eager = engine(source_model, "eager", kernels="on", **kw)
    static = engine(source_model, "static", kernels="on", window=2, **kw)
    assert static.kernels is not None
    a, b = eager.generate(ps, sp), static.generate(ps, sp)
    w4a4 = kw["scheme"] == "w4a4"
    # W4A4: a 1-ulp change of a layer's input (the attention kernel's float32 order) changes some FP4 codes,
    # and a changed code is a large step, so later layers differ by more than round-off (what TRACE is for);
    # W4A16: BF16_FLIP_LOGP
    assert_same(a, b, logp_atol=5e-2 if w4a4 else BF16_FLIP_LOGP, min_byte_agreement=0, scale_rtol=None,
                routed_sets=True, logp_median_atol=None if w4a4 else ROUNDOFF_LOGP)
    assert sorted(b[0].trace) == ([0, 1] if w4a4 else [])


@pytest.mark.parametrize("scheme", ["w4a16", "w4a4"])
def test_tile_major_expert_stacks_in_the_engine(source_model, scheme, monkeypatch):
    """moe_grouped_gemm.EXPERT_STACK_TILE: the engine prepares tile-major expert stacks and the static step's
    kernels read them through the heuristic's tile-major configs (tile=w.tile): the row-major engine's tokens and
    routed experts, log-probs to the kernels' round-off (the configs take other K steps); a weight sync rewrites
    the stacks in place (captured graphs keep their addresses) and decodes the same again."""
    from megatron_qrl.kernels import moe_grouped_gemm as mg

    ps = prompts(5, 9, 3, seed=4)
    sp = SamplingParams(temperature=0.0, max_new_tokens=4)
    row = engine(source_model, "static", kernels="on", weights="nvfp4", scheme=scheme)
    monkeypatch.setattr(mg, "EXPERT_STACK_TILE", (32, 32))       # the tiny model's 64-wide experts
    tiled = engine(source_model, "static", kernels="on", weights="nvfp4", scheme=scheme)
    runner = next(iter(tiled.kernels.grouped.values()))
    assert runner.w13.tile == runner.w2.tile == (32, 32)
    assert next(iter(row.kernels.grouped.values())).w13.tile is None
    a, b = row.generate(ps, sp), tiled.generate(ps, sp)
    w4a4 = scheme == "w4a4"
    assert_same(a, b, logp_atol=5e-2 if w4a4 else BF16_FLIP_LOGP, min_byte_agreement=0, scale_rtol=None,
                routed_sets=True, logp_median_atol=None if w4a4 else ROUNDOFF_LOGP)
    codes = runner.w13.qweight
    tiled.sync_from_model(source_model, version=1)
    assert runner.w13.qweight is codes and runner.w13.tile == (32, 32)
    assert_same(b, tiled.generate(ps, sp), logp_atol=0, scale_rtol=None, min_byte_agreement=1.0)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_kernel_experts_match_megatron_experts(source_model, fmt):
    """Identical inputs: the grouped-kernel experts (Triton interpreter) against the model's own experts.
    fc1 captures are byte-identical (same rows, same per-expert scale rule); outputs agree to the kernels'
    bf16 precision; inactive rows change nothing."""
    from megatron_qrl.rollout.decode_experts import FP4KernelExperts, MegatronExperts

    eng = engine(source_model, "static", kernels="on", weights=fmt, scheme="w4a4")
    dense = engine(source_model, "static", kernels="off", weights=fmt, scheme="w4a4")   # the kernel engine
    layer = eng.model.decoder.layers[1]                                                # keeps no dense copy
    name = [n for n, m in eng.model.named_modules() if m is layer.mlp.experts][0]
    ref = MegatronExperts(dense.model.decoder.layers[1].mlp.experts, capture=True, keep_codes=True)
    ker = FP4KernelExperts(eng.kernels.grouped[name], fmt, True, capture=True, keep_codes=True)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 64, generator=g)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2], [1, 3]])
    probs = torch.softmax(torch.randn(6, 2, generator=g), -1)
    active = torch.tensor([True, True, False, True, True, True])
    (y_ref, c_ref), (y_ker, c_ker) = ref(x, ids, probs, active), ker(x, ids, probs, active)
    assert y_ker.shape == (6, 2, 64)                # the k slot outputs; the step sums them
    y_ker = sum_slots(y_ker)
    a = active
    err = float((y_ref[a] - y_ker[a]).norm() / y_ref[a].norm())
    assert err < 2e-2, err
    for name_ in ("bits", "scales", "codes") + (("global_scale",) if fmt == "nvfp4" else ()):
        assert torch.equal(_raw(c_ref["fc1"][name_][a]), _raw(c_ker["fc1"][name_][a])), name_
    assert float((c_ref["fc2"]["bits"][a] == c_ker["fc2"]["bits"][a]).float().mean()) > 0.8
    x2 = x.clone()
    x2[2] = 100.0                                   # an inactive row's input must not move anyone's scale
    y2, c2 = ker(x2, ids, probs, active)
    assert torch.equal(sum_slots(y2)[a], y_ker[a]) and torch.equal(c2["fc1"]["bits"][a], c_ker["fc1"]["bits"][a])


@pytest.mark.parametrize("scheme", ["w4a16", "w4a4"])
def test_fp4_kernel_experts_take_the_fused_routing(source_model, scheme, monkeypatch):
    """`route` (the routing kernel) gives what Megatron's routing + the experts' own alignment give, and the
    static step's kernel path routes through it (one route call per MoE layer and step)."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    from megatron_qrl.kernels import decode_routing
    from megatron_qrl.rollout.decode_experts import FP4KernelExperts

    eng = engine(source_model, "static", kernels="on", weights="nvfp4", scheme=scheme)
    layer = eng.model.decoder.layers[1]
    name = [n for n, m in eng.model.named_modules() if m is layer.mlp.experts][0]
    ker = FP4KernelExperts(eng.kernels.grouped[name], "nvfp4", scheme == "w4a4", capture=True, keep_codes=True)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 64, generator=g)
    active = torch.tensor([True, True, False, True, True, True])
    logits = layer.mlp.router.gating(x)
    probs, ids, routing = ker.route(logits, 2)
    ref_probs, ref_ids = topk_routing_with_score_function(logits, 2, dense_output=True)
    order, ref_order = ids.sort(-1), ref_ids.sort(-1)
    assert torch.equal(order.values, ref_order.values)
    assert torch.allclose(probs.gather(1, order.indices), ref_probs.gather(1, ref_order.indices), rtol=1e-6, atol=0)
    (y, cap), (y_ref, cap_ref) = ker(x, ids, probs, active, routing=routing), ker(x, ids, probs, active)
    assert torch.equal(y, y_ref) and (cap is None) == (scheme == "w4a16")
    if cap is not None:
        assert all(torch.equal(_raw(cap[r][n]), _raw(cap_ref[r][n])) for r in cap for n in cap[r])
    calls, original = [], decode_routing.route_and_align
    monkeypatch.setattr(decode_routing, "route_and_align",
                        lambda *a, **kw: calls.append(a[0].shape) or original(*a, **kw))
    out = eng.generate(prompts(3, 5, seed=1), SamplingParams(temperature=0.0, max_new_tokens=3))
    decode_steps = eng._static_loop.stats["replays"]
    assert len(out) == 2 and len(calls) == 2 * decode_steps          # two MoE layers per decode step


def test_decode_mode_resolution():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_decode_mode("auto", cpu, None) == "eager"
    assert resolve_decode_mode("auto", cuda, None) == "graphs"
    assert resolve_decode_mode("auto", cuda, "LoRA adapters (QeRL mode)") == "eager"
    assert resolve_decode_mode("static", cpu, None) == "static"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_decode_mode("graphs", cpu, None)
    with pytest.raises(ValueError, match="does not support shared experts"):
        resolve_decode_mode("static", cpu, "shared experts")
    with pytest.raises(ValueError, match="use one of"):
        resolve_decode_mode("fast", cpu, None)


def test_unsupported_models_fall_back_or_refuse(source_model):
    cfg = make_cfg(targets="all_linears")
    auto = EmbeddedEngine(cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"decode": "auto"})}))
    assert auto.decode_mode == "eager"                                        # auto on a CPU
    assert EmbeddedEngine(make_cfg(weights="bf16", targets="all_linears").model_copy(update={"rollout": make_cfg(
        weights="bf16").rollout.model_copy(update={"decode": "static"})})).decode_mode == "static"
    bf16 = make_cfg(weights="bf16")       # QeRL over a bf16 base: its experts have no graph-capturable runner
    lora = bf16.model_copy(update={"rollout": bf16.rollout.model_copy(update={"decode": "static"}),
                                   "lora": bf16.lora.model_copy(update={"enabled": True, "base_format": "bf16"})})
    with pytest.raises(ValueError, match="LoRA routed experts over a bf16 base"):
        EmbeddedEngine(lora)


def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(48) == [1, 2, 4, 8, 16, 32, 48]


# ---------------------------------------------------------------------------------- sampling pieces
def test_counter_uniforms_are_pure_and_spread():
    keys = stream_keys(11, torch.arange(64))
    c = torch.arange(64)
    u = uniforms(keys, c)
    assert u.dtype == torch.float64 and bool(((u >= 0) & (u < 1)).all())
    assert torch.equal(u, uniforms(keys.clone(), c.clone()))
    assert len(set(u.tolist())) == 64
    assert not torch.equal(stream_keys(11, torch.arange(4)), stream_keys(12, torch.arange(4)))
    big = uniforms(stream_keys(0, torch.arange(2000)).repeat_interleave(10), torch.arange(10).repeat(2000))
    assert abs(float(big.mean()) - 0.5) < 0.02 and abs(float(big.var()) - 1 / 12) < 0.005
    g = sequence_generator(11, 5)
    assert float(g.next()) == float(uniforms(keys[5:6], torch.zeros(1))[0]) and g.counter == 1
    assert float(g.next()) == float(uniforms(keys[5:6], torch.ones(1))[0])


def test_batched_sampling_equals_row_by_row():
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.8),
                   SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=1.2, top_p=0.7)):
        keys = stream_keys(params.seed, torch.arange(6))
        batch = sample_rows(logits, params, uniforms(keys, torch.zeros(6, dtype=torch.long)))
        rows = [sample_token(logits[i], params, sequence_generator(params.seed, i)) for i in range(6)]
        assert batch.tolist() == rows
        if params.top_k:
            allowed = torch.topk(logits, params.top_k, dim=-1).indices
            assert all(int(t) in allowed[i].tolist() for i, t in enumerate(batch))


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0, max_new_tokens=5),
                                      SamplingParams(temperature=0.9, max_new_tokens=6, seed=7),
                                      SamplingParams(temperature=1.0, top_k=10, max_new_tokens=6, seed=8)],
                         ids=["greedy", "sampled", "top_k"])
def test_device_sampling_kernels_in_both_loops(source_model, sampling, monkeypatch):
    """QRL_KERNELS=triton sends the sampling of the eager engine, of the static loop's admission and of its
    step to the sampling kernels (interpreter): both loops still agree, and with this 64-token vocabulary
    (no uniform near a CDF boundary) they pick the torch path's tokens."""
    from megatron_qrl.kernels import decode_sampling

    ps = prompts(5, 9, 3, seed=6)
    ref = engine(source_model, "eager", weights="bf16").generate(ps, sampling)
    calls, original = [], decode_sampling._select
    monkeypatch.setattr(decode_sampling, "_select", lambda *a, **kw: calls.append(a[1]) or original(*a, **kw))
    monkeypatch.setenv("QRL_KERNELS", "triton")
    a = engine(source_model, "eager", weights="bf16").generate(ps, sampling)
    eager_calls = len(calls)
    b = engine(source_model, "static", window=2, weights="bf16").generate(ps, sampling)
    assert eager_calls > 0 and len(calls) > eager_calls
    assert_same(a, b, trace=False)
    assert_same(ref, a, trace=False)


def test_cache_decode_attention_kernel_matches_reference():
    from megatron_qrl.kernels.cache_attention import cache_decode_attention, cache_decode_attention_reference

    g = torch.Generator().manual_seed(1)
    # 600 positions: 4 splits and the combine launch; 200: one split written by the kernel itself
    for dtype, max_len in ((torch.float32, 600), (torch.bfloat16, 600), (torch.float32, 200), (torch.bfloat16, 200)):
        keys = torch.randn(5, max_len, 2, 32, generator=g).to(dtype)
        values = torch.randn(5, max_len, 2, 32, generator=g).to(dtype)
        q = torch.randn(4, 8, 32, generator=g).to(dtype)
        slots, lens = torch.tensor([4, 0, 2, 2]), torch.tensor([1, max_len, 157, 64])
        out = cache_decode_attention(q, keys, values, slots, lens, 0.2)
        ref = cache_decode_attention_reference(q, keys, values, slots, lens, 0.2)
        err = float((out.float() - ref.float()).norm() / ref.float().norm())
        assert out.dtype == dtype and err < (1e-6 if dtype == torch.float32 else 1e-2), err


def test_grouped_bf16_experts_match_megatron_experts(source_model):
    """torch._grouped_mm over the stacked experts (the GPU graph path of BF16 engines) equals the model's own
    experts; the experts' parameters become views of the stack, so weight updates reach it."""
    from megatron_qrl.rollout.decode_experts import GroupedBF16Experts, MegatronExperts

    eng = engine(source_model, "static", weights="bf16")
    mlp = eng.model.decoder.layers[1].mlp.experts
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 64, generator=g)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2], [1, 3]])
    probs = torch.softmax(torch.randn(6, 2, generator=g), -1)
    active = torch.ones(6, dtype=torch.bool)
    ref, _ = MegatronExperts(mlp, False, False)(x, ids, probs, active)
    grouped = GroupedBF16Experts(mlp)
    out, cap = grouped(x, ids, probs, active)
    out = sum_slots(out)
    assert cap is None and torch.allclose(out, ref, atol=1e-6, rtol=1e-5)
    with torch.no_grad():
        mlp.local_experts[2].linear_fc2.weight.mul_(2.0)         # an in-place update of one expert
    assert torch.equal(grouped.w2[2], mlp.local_experts[2].linear_fc2.weight)
    moved = sum_slots(grouped(x, ids, probs, active)[0])
    assert torch.allclose(moved, MegatronExperts(mlp, False, False)(x, ids, probs, active)[0], atol=1e-6, rtol=1e-5)
    assert not torch.allclose(moved, out)


# ------------------------------------------------------------------- launches removed from the step
def _bf16_engine(model, **kw):
    """A static kernel-path engine whose model runs in bf16, as on a GPU: the router's fp32 casts (Megatron's
    moe_router_dtype=fp32) only exist then."""
    cfg = make_cfg(**kw)
    cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"bf16": True}),
                                 "rollout": cfg.rollout.model_copy(update={"decode": "static"})})
    e = EmbeddedEngine(cfg, keep_codes=True, kernels="on")
    e.sync_from_model(model, version=0)
    return e


def _step_inputs(B, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 64, (B,), generator=g), torch.randint(0, 20, (B,), generator=g), torch.arange(B),
            torch.rand(B, generator=g) > 0.2)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_step_router_logits_are_router_gating(source_model, bf16):
    """The step's router GEMM is Router.gating bit for bit. Over a bf16 model (moe_router_dtype=fp32) the step
    keeps an fp32 copy of the weight, which refresh_weights (every generate call) updates in place after
    weight changes; over an fp32 model it reads the parameter itself."""
    from megatron_qrl.rollout.decode_path import build_graph_loop

    eng = _bf16_engine(source_model) if bf16 else engine(source_model, "static", kernels="on")
    step = build_graph_loop(eng, "static").model
    g = torch.Generator().manual_seed(8)
    for i in step.moe_index:
        r = step.layers[i].mlp.router
        w = step.router_weights[i]
        assert w.dtype == torch.float32 and (w is not r.weight) == bf16
        x = torch.randn(5, 64, generator=g).to(step.dtype)
        assert torch.equal(step._router_logits(i, r, x, None), r.gating(x))
        assert torch.equal(step._router_logits(i, r, x, x.float()), r.gating(x))
        with torch.no_grad():
            r.weight.mul_(1.25)                                            # an in-place weight update
        step.refresh_weights()
        assert torch.equal(step._router_logits(i, r, x, None), r.gating(x))


@pytest.mark.parametrize("kw", [dict(weights="nvfp4", scheme="w4a16"), dict(weights="nvfp4", scheme="w4a4")],
                         ids=lambda kw: "-".join(kw.values()))
def test_step_conversions_in_the_norm_give_the_old_numbers(source_model, kw, monkeypatch):
    """bf16 model, kernel path, 32 rows (the bucket whose W4A16 gate/up converts its input to the fp16
    operand): the pre-MLP norm also writes the router's fp32 input and that operand, and the router weight is
    kept in fp32; logits, R3 ids and TRACE bytes equal, bit for bit, the step with the separate conversions
    (router.gating, the experts' own conversion launch)."""
    from megatron_qrl.kernels import moe_grouped_gemm
    from megatron_qrl.rollout.decode_path import build_graph_loop
    from megatron_qrl.rollout.static_decode import DecodeModel

    B = 32
    step = build_graph_loop(_bf16_engine(source_model, max_batch_size=B, **kw), "static").model
    wide, f16 = step._moe_inputs(1, torch.zeros(B, 64, dtype=torch.bfloat16))
    w4a16 = kw["scheme"] == "w4a16"
    assert wide.dtype == torch.float32 and (f16 is not None) == w4a16
    inputs = _step_inputs(B, seed=9)
    with monkeypatch.context() as m:          # the experts take the norm's operand: no conversion of their own
        m.setattr(moe_grouped_gemm, "to_fp16_operand", lambda x: pytest.fail("converted the expert input"))
        new, new_rec = step.forward(*inputs)
    monkeypatch.setattr(DecodeModel, "_moe_inputs", lambda self, i, h: (None, None))
    step.router_weights = dict.fromkeys(step.router_weights)                # None: router.gating
    old, old_rec = step.forward(*inputs)
    assert torch.equal(new, old) and torch.equal(new_rec.routed, old_rec.routed)
    assert sorted(new_rec.trace) == sorted(old_rec.trace) == ([] if w4a16 else [0, 1])
    for layer, roles in old_rec.trace.items():
        for role, fields in roles.items():
            for name, t in fields.items():
                assert torch.equal(_raw(new_rec.trace[layer][role][name]), _raw(t)), (layer, role, name)


@pytest.mark.parametrize("kernels", ["on", "off"])
def test_step_r3_record_holds_each_layers_ids(source_model, kernels, monkeypatch):
    """The step's R3 record [B, moe_layers, k] is the per-layer ids in int16 stacked over the MoE layers (the
    former ids.to(int16) + torch.stack): the routing kernels write each layer's column (kernel experts), one
    copy does it (reference experts)."""
    from megatron_qrl.rollout import decode_experts
    from megatron_qrl.rollout.decode_path import build_graph_loop

    step = build_graph_loop(engine(source_model, "static", kernels=kernels), "static").model
    seen = []
    cls = decode_experts.FP4KernelExperts if kernels == "on" else decode_experts.MegatronExperts
    call = cls.__call__

    def spy(self, x, ids, *args, **kw):
        seen.append(ids.clone())
        return call(self, x, ids, *args, **kw)
    monkeypatch.setattr(cls, "__call__", spy)
    _, rec = step.forward(*_step_inputs(4, seed=10))
    assert len(seen) == 2 and rec.routed.dtype == torch.int16
    assert torch.equal(rec.routed, torch.stack([ids.to(torch.int16) for ids in seen], dim=1))
