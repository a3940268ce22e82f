"""The static decode step with FP4 attention linears (quant.targets=all_linears, rollout/decode_linears.py)
against the eager engine: qkv and proj in FP4 (W4A16 / W4A4, NVFP4 / MXFP4) with TRACE capture of their
inputs next to the routed experts'. Reference path (kernels off): tokens, log-probs, R3 ids and every TRACE
byte equal the eager engine's. Kernel path (Triton interpreter): the W4A16 kernel and the fused fake-quant
kernel against the eager engine on the same kernels (test_rollout_static.py's tolerance rules).
"""
import pytest
import torch

from megatron_qrl.rollout import EmbeddedEngine, SamplingParams

from test_rollout_engine import prompts
from test_rollout_kernels import source_model  # noqa: F401  (the module-scoped test model)
from test_rollout_static import BF16_FLIP_LOGP, ROUNDOFF_LOGP, _raw, assert_same, engine

DENSE = {"qkv", "proj"}


def _runners(eng):
    return eng._static_loop.model.linears


@pytest.mark.parametrize("kw,sampling", [
    (dict(weights="nvfp4", scheme="w4a4"), SamplingParams(temperature=0.0, max_new_tokens=6)),
    (dict(weights="nvfp4", scheme="w4a4"), SamplingParams(temperature=1.0, top_k=20, max_new_tokens=6, seed=3)),
    (dict(weights="nvfp4", scheme="w4a16"), SamplingParams(temperature=0.0, max_new_tokens=6)),
    (dict(weights="mxfp4", scheme="w4a4"), SamplingParams(temperature=0.0, max_new_tokens=6)),
], ids=["nvfp4-w4a4-greedy", "nvfp4-w4a4-sampled", "nvfp4-w4a16-greedy", "mxfp4-w4a4-greedy"])
def test_all_linears_static_equals_eager(source_model, kw, sampling):
    ps = prompts(5, 9, 3, 7, seed=2)
    eager = engine(source_model, "eager", targets="all_linears", **kw)
    static = engine(source_model, "static", window=3, targets="all_linears", **kw)
    assert static.decode_mode == "static"
    a, b = eager.generate(ps, sampling), static.generate(ps, sampling)
    assert_same(a, b, min_byte_agreement=1.0)            # every TRACE byte, prefill and decode rows
    runners = _runners(static)
    assert sorted((r.site.layer, r.site.role) for r in runners.values()) == [(0, "proj"), (0, "qkv"),
                                                                             (1, "proj"), (1, "qkv")]
    if kw["scheme"] == "w4a4":
        for s in b:
            for layer in (0, 1):
                assert set(s.trace[layer]) == {"fc1", "fc2"} | DENSE
                qkv = s.trace[layer]["qkv"]
                assert qkv.bits.shape == (s.num_forwarded, 64 // 8)          # one row per token, no slot
                assert (qkv.global_scale is None) == (kw["weights"] == "mxfp4")
                if qkv.global_scale is not None:
                    assert qkv.global_scale.shape == (s.num_forwarded,)
    else:
        assert all(not s.trace for s in b)


def test_all_linears_finished_rows_under_w4a4(source_model):
    """Rows that stop early stay in the batch as inactive rows: zeroed before the attention linears'
    per-tensor amax, they change nothing (the eager step no longer holds their tokens)."""
    ps = prompts(5, 9, 3, 7, seed=7)
    kw = dict(weights="nvfp4", scheme="w4a4", targets="all_linears")
    free = engine(source_model, "eager", **kw).generate(ps, SamplingParams(temperature=0.0, max_new_tokens=8))
    sp = SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(free[0].tokens[2],))
    a = engine(source_model, "eager", **kw).generate(ps, sp)
    b = engine(source_model, "static", window=4, **kw).generate(ps, sp)
    assert a[0].finish_reason == "stop" and any(s.finish_reason == "length" for s in a)
    assert_same(a, b, min_byte_agreement=1.0)


def test_all_linears_mid_call_admission_under_w4a16(source_model):
    """More prompts than rows: admission waves refill finished rows (W4A16: tokens do not depend on the batch)."""
    ps = prompts(4, 11, 2, 9, 6, seed=5)
    sp = SamplingParams(temperature=1.0, max_new_tokens=5, seed=4)
    kw = dict(weights="nvfp4", scheme="w4a16", targets="all_linears", max_batch_size=2)
    ref = engine(source_model, "eager", **kw).generate(ps, sp)
    static = engine(source_model, "static", window=2, **kw)
    assert_same(ref, static.generate(ps, sp), trace=False)
    assert static._static_loop.stats["admission_waves"] >= 2


@pytest.mark.parametrize("fmt,kernels", [("nvfp4", "off"), ("mxfp4", "off"), ("nvfp4", "on")])
def test_dense_fp4_linear_matches_the_linears_own_hook(source_model, fmt, kernels):
    """Identical inputs: the runner against the eager engine's own linear (its FP4 input hook and, with
    kernels on, its w4a16_gemm) over the same rows, the inactive one zeroed (what the eager step, which lacks
    that row, quantizes with: the same amax); captures byte-identical to the hook's CaptureRecord; an
    inactive row's input moves nothing."""
    from megatron_qrl.models import capture_activations

    eng = engine(source_model, "static", kernels=kernels, weights=fmt, scheme="w4a4", targets="all_linears")
    eng.generate(prompts(3, seed=1), SamplingParams(temperature=0.0, max_new_tokens=2))   # builds the runners
    lin = eng.model.decoder.layers[1].self_attention.linear_qkv
    run = _runners(eng)[lin]
    assert run.capture and run.kernels == (kernels == "on")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 64, generator=g)
    active = torch.tensor([True, True, False, True, True, True])
    y, cap = run(x, active)
    with capture_activations(eng.model, {lin.site.name}) as records, torch.no_grad():
        y_ref, _ = lin(torch.where(active[:, None], x, 0.0).unsqueeze(1))
    (rec,) = records
    assert torch.equal(y[active], y_ref[active, 0])
    for name, ref in (("bits", rec.bits), ("scales", rec.scales), ("codes", rec.packed)):
        assert torch.equal(_raw(cap[name][active]), _raw(ref[active, 0])), name
    if fmt == "nvfp4":
        assert torch.equal(cap["global_scale"], rec.global_scale.reshape(1).expand(6))
    x2 = x.clone()
    x2[2] = 100.0
    y2, cap2 = run(x2, active)
    assert torch.equal(y2[active], y[active]) and torch.equal(cap2["bits"], cap["bits"])


@pytest.mark.parametrize("kw", [dict(weights="nvfp4", scheme="w4a16"), dict(weights="nvfp4", scheme="w4a4")],
                         ids=lambda kw: "-".join(kw.values()))
def test_all_linears_kernel_path_equals_eager_kernel_engine(source_model, kw):
    """qkv / proj on w4a16_gemm and the fused fake-quant kernel (Triton interpreter) against the eager engine
    on the same kernels; the GEMMs see other row counts, so values agree to bf16 round-off, which W4A4
    amplifies at FP4 rounding boundaries (the rules of test_kernel_path_equals_eager_kernel_engine). A weight
    update in place reaches the runners."""
    from megatron_qrl.quant import pack_state

    ps = prompts(5, 9, 3, seed=4)
    sp = SamplingParams(temperature=0.0, max_new_tokens=4)
    eager = engine(source_model, "eager", kernels="on", targets="all_linears", **kw)
    static = engine(source_model, "static", kernels="on", window=2, targets="all_linears", **kw)
    assert len(static.kernels.dense) == 4
    w4a4 = kw["scheme"] == "w4a4"
    tol = dict(logp_atol=5e-2 if w4a4 else BF16_FLIP_LOGP, min_byte_agreement=0, scale_rtol=None, routed_sets=True,
               logp_median_atol=None if w4a4 else ROUNDOFF_LOGP)
    assert_same(eager.generate(ps, sp), static.generate(ps, sp), **tol)
    assert all(r.kernels for r in _runners(static).values())
    with torch.no_grad():
        noisy = [(n, p + 0.05 * torch.randn_like(p)) for n, p in source_model.named_parameters()]
    for e in (eager, static):
        w, h = pack_state(noisy, e.format, lambda n: n in e.store.quantized)
        e.update_weights(w, 1, h)
    a, b = eager.generate(ps, sp), static.generate(ps, sp)
    assert_same(a, b, **tol)
    if w4a4:
        assert set(b[0].trace[1]) == {"fc1", "fc2"} | DENSE


def test_gpu_evidence_engine_takes_the_static_path():
    """configs/evidence/gpu_base.yaml (all_linears W4A4 NVFP4, FP4 KV cache, TRACE on all 4 layers, AQN, bf16):
    its engine now runs the static step (CUDA graphs on a GPU) and equals its eager engine bit for bit."""
    from megatron_qrl.config import load_config
    from megatron_qrl.models import build_model
    from megatron_qrl.rollout.decode_path import resolve_decode_mode
    from megatron_qrl.rollout.static_decode import unsupported_reason

    base = "configs/evidence/gpu_base.yaml"
    engines = {}
    torch.manual_seed(0)
    src = None
    for mode in ("eager", "static"):
        cfg = load_config(base, [f"rollout.decode={mode}", "rollout.max_batch_size=8"])
        e = EmbeddedEngine(cfg, keep_codes=True)
        assert e.decode_mode == mode
        src = src if src is not None else build_model(cfg)[0]
        e.sync_from_model(src, version=0)
        e.set_aqn_noise(1e-2, seed=5)
        engines[mode] = e
    eng = engines["static"]
    assert eng.cfg.quant.targets == "all_linears" and eng.trace_layers == [0, 1, 2, 3]
    assert eng.cache.kv_format == "fp4" and eng.scheme == "w4a4"
    assert unsupported_reason(eng.model, eng.cfg) is None
    assert resolve_decode_mode("auto", torch.device("cuda"), unsupported_reason(eng.model, eng.cfg)) == "graphs"
    ps = prompts(5, 9, 3, 7, seed=2)
    sp = SamplingParams(temperature=1.0, max_new_tokens=5, seed=1)
    a, b = engines["eager"].generate(ps, sp), eng.generate(ps, sp)
    assert_same(a, b, min_byte_agreement=1.0)
    assert set(b[0].trace[3]) == {"fc1", "fc2"} | DENSE
