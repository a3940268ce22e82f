"""The embedded FP4 rollout engine on a tiny Megatron MoE (2 layers, hidden 64, 4 experts top-2, vocab 64).

References are full GPTModel.forward passes (no KV cache) of the engine's own model, i.e. of the same
dequantized FP4 weights. W4A16 / BF16 engines must match them to float32 round-off; W4A4 cannot (the
activation global scale is per tensor, so it depends on which tokens share a step) and is checked
through TRACE replay instead.
"""
import dataclasses

import pytest
import torch

from megatron_qrl.config import QRLConfig
from megatron_qrl.rollout import EmbeddedEngine, RolloutEngine, SamplingParams, WeightUpdateError
from megatron_qrl.quant import canonical, payload_digest, tensor_digest, unpack_nibbles
from megatron_qrl.rollout.capture import guided_requantize

TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, num_experts=4,
            moe_router_topk=2, moe_ffn_hidden_size=64, ffn_hidden_size=128, vocab_size=64,
            max_sequence_length=48, init_method_std=0.1)   # std 0.1: peaked logits, few greedy near-ties
LOGP_ATOL = 2e-5   # float32 round-off between cached and uncached attention / different batch shapes


def make_cfg(weights="nvfp4", scheme="w4a16", kv_cache="bf16", max_batch_size=4, targets="routed_experts"):
    traced = weights != "bf16" and scheme == "w4a4"
    tr = dict(enabled=True, num_cached_layers=2) if traced else dict(enabled=False)
    return QRLConfig.model_validate({"model": TINY, "trace": tr, "quant": dict(targets=targets), "rollout": dict(
        weights=weights, scheme=scheme, kv_cache=kv_cache, max_batch_size=max_batch_size)})


@pytest.fixture(scope="module")
def trainer_model():
    from megatron_qrl.platform import init_distributed, teardown

    cfg = make_cfg()
    init_distributed(cfg)
    from megatron_qrl.models import build_model

    torch.manual_seed(0)
    model = build_model(cfg)[0]
    yield model
    teardown()


_ENGINES: dict = {}


@pytest.fixture(scope="module")
def engine(trainer_model):
    """engine(**cfg) -> an EmbeddedEngine loaded with the trainer's weights (cached per configuration)."""

    def get(keep_codes=False, max_tokens_per_step=None, **kw):
        key = (keep_codes, max_tokens_per_step, tuple(sorted(kw.items())))
        if key not in _ENGINES:
            eng = EmbeddedEngine(make_cfg(**kw), keep_codes=keep_codes, max_tokens_per_step=max_tokens_per_step)
            eng.sync_from_model(trainer_model, version=0)
            _ENGINES[key] = eng
        return _ENGINES[key]

    yield get
    _ENGINES.clear()


def prompts(*lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist() for n in lengths]


def full_logits(model, ids):
    """log-softmax [n, V] of one full causal forward (no KV cache) of `model` over `ids`."""
    n = len(ids)
    mask = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        out = model(torch.tensor([ids]), torch.arange(n)[None], mask)[0]
    return torch.log_softmax(out.float(), -1)


def full_forward_logprobs(model, sample):
    lp = full_logits(model, sample.sequence[:-1])
    rows = torch.arange(len(sample.prompt_ids) - 1, sample.num_forwarded)
    return lp[rows, torch.tensor(sample.tokens)]


# ------------------------------------------------------------------------------------ correctness
def test_engine_satisfies_protocol(engine):
    eng = engine()
    assert isinstance(eng, RolloutEngine)
    h = eng.health()
    assert h["weight_version"] == 0 and h["weights"] == "nvfp4" and h["memory"] == "resident"


def test_greedy_equals_stepwise_argmax_of_full_forward(engine):
    eng = engine()
    ps = prompts(5, 11, 2)
    out = eng.generate(ps, SamplingParams(temperature=0, max_new_tokens=10))
    for p, s in zip(ps, out):
        seq = list(p)
        for _ in range(10):
            seq.append(int(full_logits(eng.model, seq)[-1].argmax()))
        assert s.tokens == seq[len(p):]
        assert s.finish_reason == "length" and len(s.logprobs) == 10
        assert torch.allclose(s.logprobs, full_forward_logprobs(eng.model, s), atol=LOGP_ATOL, rtol=0)


def test_sampled_logprobs_equal_full_forward_and_router_ids_are_r3(engine):
    from megatron_qrl.models import r3_routers

    eng = engine()
    for s in eng.generate(prompts(4, 9), SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=8, seed=3)):
        assert torch.allclose(s.logprobs, full_forward_logprobs(eng.model, s), atol=LOGP_ATOL, rtol=0)
        routers = sorted(r3_routers(eng.model), key=lambda r: r.layer_index)
        assert s.routed_experts.shape == (s.num_forwarded, len(routers), TINY["moe_router_topk"])
        for i, r in enumerate(routers):   # the full forward just ran over the same positions
            assert torch.equal(s.routed_experts[:, i].long(), r.last_topk_ids.long())


def test_continuous_batching_equals_generating_alone(engine):
    batched = engine(max_batch_size=2, max_tokens_per_step=6)   # 5 prompts through 2 slots, chunked prefill
    one_at_a_time = engine(max_batch_size=1)                     # each prompt alone, start to finish
    ps = prompts(3, 12, 1, 7, 5, seed=4)
    params = SamplingParams(temperature=1.0, top_k=20, max_new_tokens=6, seed=11)
    together, alone = batched.generate(ps, params), one_at_a_time.generate(ps, params)
    assert batched.health()["peak_batch"] == 2 and one_at_a_time.health()["peak_batch"] == 1
    for s, solo in zip(together, alone):
        assert s.tokens == solo.tokens
        assert torch.allclose(s.logprobs, solo.logprobs, atol=LOGP_ATOL, rtol=0)
        assert torch.equal(s.routed_experts, solo.routed_experts)


def test_seeded_sampling_is_deterministic(engine):
    eng = engine()
    ps = prompts(6, 3, 8)
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=5)
    a, b = eng.generate(ps, params), eng.generate(ps, params)
    assert [s.tokens for s in a] == [s.tokens for s in b]
    assert all(torch.equal(x.logprobs, y.logprobs) for x, y in zip(a, b))
    c = eng.generate(ps, dataclasses.replace(params, seed=6))
    assert [s.tokens for s in a] != [s.tokens for s in c]
    # a GRPO group (the same prompt G times) gets G different samples
    group = eng.generate([ps[0]] * 4, params)
    assert len({tuple(s.tokens) for s in group}) > 1


def test_stop_tokens_and_max_tokens(engine):
    eng = engine()
    p = prompts(5)
    free = eng.generate(p, SamplingParams(temperature=0, max_new_tokens=12))[0]
    stop = free.tokens[3]
    first = free.tokens.index(stop)
    stopped = eng.generate(p, SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(stop,)))[0]
    assert stopped.finish_reason == "stop" and stopped.tokens == free.tokens[:first + 1]
    assert stopped.routed_experts.shape[0] == stopped.num_forwarded
    short = eng.generate(p, SamplingParams(temperature=0, max_new_tokens=2))[0]
    assert short.finish_reason == "length" and short.tokens == free.tokens[:2]
    with pytest.raises(ValueError, match="max_sequence_length"):
        eng.generate(p, SamplingParams(max_new_tokens=TINY["max_sequence_length"]))


# ---------------------------------------------------------------------------------------- weights
def test_wrong_hash_is_refused_and_weights_stay(engine, trainer_model):
    eng = engine()
    before = {n: p.detach().clone() for n, p in eng.model.named_parameters()}
    p = prompts(6)
    ref = eng.generate(p, SamplingParams(temperature=0, max_new_tokens=6))[0]
    new = {n: q.detach() * 1.5 for n, q in trainer_model.named_parameters() if "experts" in n}
    hashes = {n: tensor_digest(t) for n, t in new.items()}
    victim = sorted(new)[0]
    hashes[victim] = tensor_digest(new[victim] + 1)
    with pytest.raises(WeightUpdateError, match="digest mismatch"):
        eng.update_weights(new, version=1, hashes=hashes)
    assert eng.version == 0 and eng.health()["refused_updates"] >= 1
    assert all(torch.equal(q, before[n]) for n, q in eng.model.named_parameters())
    assert eng.generate(p, SamplingParams(temperature=0, max_new_tokens=6))[0].tokens == ref.tokens
    # the same update with honest digests goes through and changes the policy
    hashes[victim] = tensor_digest(new[victim])
    eng.update_weights(new, version=1, hashes=hashes)
    assert eng.version == 1
    assert any(not torch.equal(q, before[n]) for n, q in eng.model.named_parameters())
    eng.sync_from_model(trainer_model, version=2)           # back to the shared weights for other tests
    assert all(torch.equal(q, before[n]) for n, q in eng.model.named_parameters())


def test_engine_runs_the_trainers_fp4_bytes(engine, trainer_model):
    from megatron_qrl.quant import pack_weight

    eng = engine()
    assert eng.store.quantized and all("local_experts" in n for n in eng.store.quantized)
    params = dict(eng.model.named_parameters())
    for name in eng.store.quantized:
        sent = pack_weight(dict(trainer_model.named_parameters())[name], "nvfp4")
        assert eng.store.digests[name] == payload_digest(sent)
        assert torch.equal(params[name], sent.dequantize(params[name].dtype))


def test_release_and_resume_memory(engine):
    eng = engine()
    p = prompts(7, 2)
    params = SamplingParams(temperature=1.0, max_new_tokens=5, seed=9)
    ref = eng.generate(p, params)
    eng.release_memory()
    assert eng.health()["memory"] == "released" and eng.health()["kv_cache_bytes"] == 0
    assert all(q.numel() == 0 for q in eng.model.parameters())
    with pytest.raises(RuntimeError, match="resume_memory"):
        eng.generate(p, params)
    eng.resume_memory()
    again = eng.generate(p, params)
    assert [s.tokens for s in again] == [s.tokens for s in ref]
    assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(again, ref))


# ------------------------------------------------------------------------------------- numerics
def _gap(a, b):
    return float((torch.cat(a) - torch.cat(b)).abs().mean())


def test_fp4_logprob_gap_within_quantization_noise_bound(engine, trainer_model):
    """Bound derived from the measured quantization error (documented in docs/rollout.md).

    Model: FP4 rounding perturbs each quantized weight by an error of RMS e_t (measured per tensor); a
    random perturbation of the same RMS gives the gap a BF16 policy would show under 'generic' noise of
    FP4's size. FP4 must stay within 2x that (its error is bounded, not Gaussian, and slightly
    correlated). W4A4 adds the activation error: the bound scales with sqrt(1 + (e_a / e_w)^2), first-order
    in the relative errors.
    """
    from megatron_qrl.quant import quant_dequant

    bf16, w4a16, w4a4 = engine(weights="bf16"), engine(), engine(scheme="w4a4")
    ps = prompts(5, 9, 3, 7, seed=2)
    resp = [s.tokens for s in bf16.generate(ps, SamplingParams(temperature=1.0, max_new_tokens=12, seed=1))]
    ref = bf16.score(ps, resp)

    # measured weight error, then the same-RMS Gaussian perturbation of the BF16 weights
    src = dict(trainer_model.named_parameters())
    err_sq = err_ref = 0.0
    noise_gaps = []
    for seed in range(3):
        g = torch.Generator().manual_seed(100 + seed)
        noisy = {}
        for n in sorted(w4a16.store.quantized):     # sorted: draws must not depend on set order
            e = w4a16.store.entries[n].dequantize(torch.float32) - src[n].detach()
            if seed == 0:
                err_sq += float(e.pow(2).sum())
                err_ref += float(src[n].pow(2).sum())
            noisy[n] = src[n].detach() + torch.randn(e.shape, generator=g) * e.pow(2).mean().sqrt()
        bf16.update_weights(noisy, 1 + seed, {n: payload_digest(t) for n, t in noisy.items()})
        noise_gaps.append(_gap(bf16.score(ps, resp), ref))
    bf16.sync_from_model(trainer_model, version=10)
    eps_w = (err_sq / err_ref) ** 0.5
    noise_gap = sum(noise_gaps) / len(noise_gaps)

    # measured activation error at the quantized (expert) inputs, from the W4A16 engine's inputs
    xs = []
    hooks = [lin.register_forward_pre_hook(lambda m, a: xs.append(a[0].detach().clone()))
             for n, lin in w4a16.model.named_modules() if n.endswith(("linear_fc1", "linear_fc2")) and "experts" in n]
    gap_w4a16 = _gap(w4a16.score(ps, resp), ref)
    for h in hooks:
        h.remove()
    xs = [x for x in xs if x.numel()]
    eps_a = (sum(float((quant_dequant(x) - x).pow(2).sum()) for x in xs)
             / sum(float(x.pow(2).sum()) for x in xs)) ** 0.5
    gap_w4a4 = _gap(w4a4.score(ps, resp), ref)

    print(f"eps_w {eps_w:.4f} eps_a {eps_a:.4f} noise gaps {[round(g, 4) for g in noise_gaps]} "
          f"W4A16 gap {gap_w4a16:.4f} W4A4 gap {gap_w4a4:.4f}")
    assert 0.05 < eps_w < 0.15 and 0.05 < eps_a < 0.15     # NVFP4 on Gaussian-like data: ~0.09-0.1
    assert 0 < gap_w4a16 <= 2 * noise_gap, (gap_w4a16, noise_gaps)
    assert 0 < gap_w4a4 <= 2 * noise_gap * (1 + (eps_a / eps_w) ** 2) ** 0.5, (gap_w4a4, noise_gaps, eps_a)


def test_kv_cache_quantization_formats(engine):
    ps = prompts(6, 10)
    resp = [s.tokens for s in engine().generate(ps, SamplingParams(temperature=1.0, max_new_tokens=8, seed=2))]
    ref = engine().score(ps, resp)
    gaps = {fmt: _gap(engine(kv_cache=fmt).score(ps, resp), ref) for fmt in ("fp8", "fp4")}
    print(f"KV cache mean |dlogp| vs bf16 KV: {gaps}")
    assert 0 < gaps["fp8"] < gaps["fp4"] < 0.5, gaps   # FP8 (3 mantissa bits) is finer than FP4 (1 bit)


def test_aqn_noise_is_seeded_and_never_accumulates(engine):
    eng = engine()
    ps = prompts(6, 4)
    resp = [s.tokens for s in eng.generate(ps, SamplingParams(temperature=1.0, max_new_tokens=6, seed=2))]
    clean = eng.score(ps, resp)
    assert eng.set_aqn_noise(1e-1, seed=7) == 2 * TINY["num_layers"]
    noisy = eng.score(ps, resp)
    eng.set_aqn_noise(1e-1, seed=7)                        # same draw again: replaces, does not add
    assert all(torch.equal(a, b) for a, b in zip(eng.score(ps, resp), noisy))
    assert _gap(noisy, clean) > 1e-4
    eng.set_aqn_noise(0.0, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(eng.score(ps, resp), clean))


# ------------------------------------------------------------------------------------------ TRACE
def _replay_forward(eng, sample, guided: bool, stats: dict, mismatches: list):
    """Trainer-side recomputation of one sample: full forward, R3 replay of the engine's expert ids and,
    with `guided`, TRACE-guided rounding of every expert input from the sample's capture."""
    from megatron_qrl.models import fp4_linears, r3_routers

    routers = sorted(r3_routers(eng.model), key=lambda r: r.layer_index)
    layer_pos = {r.layer_index: i for i, r in enumerate(routers)}
    ids = sample.routed_experts.long()
    for i, r in enumerate(routers):
        r.set_replay(ids[:, i])
    hooks, saved = [], []
    if guided:
        for lin in fp4_linears(eng.model):
            site = lin.site
            if site.layer not in sample.trace or site.role not in sample.trace[site.layer]:
                continue
            cap = sample.trace[site.layer][site.role]
            if site.expert is None:     # dense site: one row per position, in order
                tokens = torch.arange(sample.num_forwarded)
                gs = None if cap.global_scale is None else cap.global_scale[:, None]
                cap = dataclasses.replace(cap, bits=cap.bits[:, None], scales=cap.scales[:, None],
                                          global_scale=gs, codes=cap.codes[:, None])
                slots = torch.zeros_like(tokens)
            else:
                hit = ids[:, layer_pos[site.layer]] == site.expert
                tokens, slots = hit.nonzero(as_tuple=True)

            def hook(module, args, tokens=tokens, slots=slots, cap=cap):
                x = args[0]
                rows = x.reshape(-1, x.shape[-1])     # dense sites see [s, b=1, K], experts [n, K]
                gs = None if cap.global_scale is None else cap.global_scale[tokens, slots]
                packed, deq = guided_requantize(rows, cap.bits[tokens, slots], cap.scales[tokens, slots], gs,
                                                cap.format, stats=stats)
                # compare code values: -0 and +0 (codes 8 and 0) are the same FP4 number
                ours, theirs = (canonical(unpack_nibbles(c)) for c in (packed, cap.codes[tokens, slots]))
                mismatches.append(int((ours != theirs).sum()))
                return (deq.reshape(x.shape),) + tuple(args[1:])

            saved.append((lin, lin.quant))
            lin.quant = dataclasses.replace(lin.quant, activations=False)   # the hook quantizes instead
            hooks.append(lin.register_forward_pre_hook(hook))
    try:
        return full_forward_logprobs(eng.model, sample)
    finally:
        for h in hooks:
            h.remove()
        for lin, q in saved:
            lin.quant = q
        for r in routers:
            r.set_replay(None)


@pytest.mark.parametrize("targets,fmt", [("routed_experts", "nvfp4"), ("all_linears", "nvfp4"),
                                         ("routed_experts", "mxfp4")])
def test_trace_capture_reproduces_engine_codes(engine, targets, fmt):
    """Re-quantizing the trainer-side inputs of every captured site with the captured bits + scales (guided
    rounding) gives exactly the engine's FP4 codes, and the guided forward reproduces the engine's
    log-probs; for NVFP4, nearest rounding (no TRACE) does not."""
    eng = engine(weights=fmt, scheme="w4a4", keep_codes=True, targets=targets)
    samples = eng.generate(prompts(6, 9, 3), SamplingParams(temperature=1.0, max_new_tokens=8, seed=4))
    roles = {"fc1", "fc2"} | ({"qkv", "proj"} if targets == "all_linears" else set())
    guided_gap = nearest_gap = 0.0
    for s in samples:
        assert sorted(s.trace) == [0, 1] and set(s.trace[1]) == roles
        cap = s.trace[1]["fc1"]
        assert cap.bits.shape == (s.num_forwarded, 2, TINY["hidden_size"] // 8)
        block = 16 if fmt == "nvfp4" else 32
        assert cap.scales.shape == (s.num_forwarded, 2, TINY["hidden_size"] // block)
        assert (cap.global_scale is None) == (fmt == "mxfp4")
        assert s.trace[1]["fc2"].bits.shape == (s.num_forwarded, 2, TINY["moe_ffn_hidden_size"] // 8)
        if targets == "all_linears":
            assert s.trace[0]["proj"].bits.shape == (s.num_forwarded, TINY["hidden_size"] // 8)
            assert s.trace[0]["qkv"].global_scale.shape == (s.num_forwarded,)
        stats, mismatches = {}, []
        guided = _replay_forward(eng, s, True, stats, mismatches)
        assert len(mismatches) > 0 and sum(mismatches) == 0, mismatches
        assert stats["guided_fallback"] == 0 and stats["guided_elements"] > 0
        nearest = _replay_forward(eng, s, False, {}, [])
        guided_gap = max(guided_gap, float((guided - s.logprobs).abs().max()))
        nearest_gap = max(nearest_gap, float((nearest - s.logprobs).abs().max()))
    print(f"TRACE replay ({targets}, {fmt}): max |logp_train - logp_rollout| guided {guided_gap:.2e}, "
          f"nearest {nearest_gap:.2e}")
    assert guided_gap < 1e-4, guided_gap
    if fmt == "nvfp4":   # the per-tensor global scale depends on the step's tokens: RTN drifts without TRACE
        assert nearest_gap > 100 * guided_gap
    else:                # MXFP4 scales are per 32-element block of one token: no batch dependence to remove
        assert nearest_gap < 1e-4
