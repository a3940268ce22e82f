"""QeRL mode (LoRA adapters over a frozen FP4 base) on the static decode step (rollout/decode_lora.py).

The adapters are made non-zero in the trainer before the sync (B = 0 at init would hide them). Reference path
(kernels off): LoRA attention linears through their runner, experts as the model's own: tokens, log-probs, R3
ids and every TRACE byte equal the eager engine's. Kernel path (Triton interpreter): the grouped FP4 kernels
over the stacked base plus the stacked adapters against the eager engine on the same kernels, and, on
identical inputs, against the model's own LoRA experts. An adapters-only sync reaches the static runners.
"""
import itertools

import pytest
import torch

from megatron_qrl.config import load_config
from megatron_qrl.kernels.decode_fused import sum_slots
from megatron_qrl.rollout import SamplingParams

from test_lora import LORA, TINY
from test_rollout_engine import prompts
from test_rollout_static import _raw, assert_same

FRESH_SEEDS = itertools.count(100)
W4A4 = ["quant.scheme=w4a4", "rollout.scheme=w4a4", "trace.enabled=true", "trace.num_cached_layers=2"]


def lora_cfg(scheme: str, decode: str, extra=()):
    over = TINY + LORA + (W4A4 if scheme == "w4a4" else []) + [f"rollout.decode={decode}", "rollout.decode_window=3",
                                                                 "rollout.max_batch_size=4", *extra]
    return load_config(None, over)


def perturb_adapters(trainer, seed: int) -> None:
    from megatron_qrl.models.lora import lora_linears

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for lin in lora_linears(trainer.unwrapped):
            for p in (lin.lora_A, lin.lora_B):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


@pytest.fixture(scope="module")
def trainers():
    """One trainer per activation scheme, adapters non-zero (the engines link their frozen base)."""
    from megatron_qrl.platform import teardown
    from megatron_qrl.trainer import Trainer

    out = {}
    for scheme in ("w4a16", "w4a4"):
        torch.manual_seed(0)
        out[scheme] = Trainer(lora_cfg(scheme, "eager"))
        perturb_adapters(out[scheme], seed=1)
    yield out
    teardown()


def make_engine(trainers, scheme, decode, kernels="off"):
    from megatron_qrl.pipeline.sync import sync_weights
    from megatron_qrl.rollout.embedded import EmbeddedEngine

    cfg = lora_cfg(scheme, decode)
    eng = EmbeddedEngine(cfg, keep_codes=True, kernels=kernels)
    sync_weights(eng, trainers[scheme], cfg, 0, version=0)
    return eng


@pytest.mark.parametrize("scheme", ["w4a16", "w4a4"])
def test_lora_static_equals_eager(trainers, scheme):
    from megatron_qrl.rollout.decode_lora import LoRADenseLinear

    ps = prompts(5, 9, 3, 7, seed=2)
    sp = SamplingParams(temperature=0.0, max_new_tokens=6)
    eager, static = make_engine(trainers, scheme, "eager"), make_engine(trainers, scheme, "static")
    assert static.decode_mode == "static"
    a, b = eager.generate(ps, sp), static.generate(ps, sp)
    assert_same(a, b, min_byte_agreement=1.0)
    runners = static._static_loop.model.linears
    assert len(runners) == 4 and all(isinstance(r, LoRADenseLinear) for r in runners.values())
    if scheme == "w4a4":
        assert set(b[0].trace[1]) == {"qkv", "proj", "fc1", "fc2"}
    # without the adapters the engine computes something else: they are on the path
    base_only = make_engine(trainers, scheme, "eager")
    for lin in base_only.model.modules():
        if hasattr(lin, "lora_B") and lin.lora_B is not None:
            lin.lora_B.data.zero_()
    c = base_only.generate(ps, sp)
    assert any(x.tokens != y.tokens or float((x.logprobs - y.logprobs).abs().max()) > 1e-2 for x, y in zip(a, c))


@pytest.mark.parametrize("scheme", ["w4a16", "w4a4"])
def test_lora_kernel_path_equals_eager_kernel_engine(trainers, scheme):
    from megatron_qrl.rollout.decode_lora import LoRAKernelExperts

    ps = prompts(5, 9, 3, seed=4)
    sp = SamplingParams(temperature=0.0, max_new_tokens=4)
    eager = make_engine(trainers, scheme, "eager", kernels="on")
    static = make_engine(trainers, scheme, "static", kernels="on")
    a, b = eager.generate(ps, sp), static.generate(ps, sp)
    assert all(isinstance(x, LoRAKernelExperts) for x in static._static_loop.model.experts.values())
    w4a4 = scheme == "w4a4"
    assert_same(a, b, logp_atol=5e-2 if w4a4 else 2e-2, min_byte_agreement=0, scale_rtol=None, routed_sets=True)


@pytest.mark.parametrize("scheme", ["w4a16", "w4a4"])
@pytest.mark.parametrize("deltas", ["grouped", "dense"])
def test_lora_kernel_experts_match_the_models_own(trainers, scheme, deltas, monkeypatch):
    """Identical inputs: stacked base + stacked adapters on the grouped kernels against the LoRA experts'
    own forward, expert by expert, with either form of the adapter deltas; inactive rows change nothing; an
    adapters-only sync reaches the stacks."""
    from megatron_qrl.pipeline.sync import sync_weights
    from megatron_qrl.rollout import decode_lora
    from megatron_qrl.rollout.decode_experts import MegatronExperts
    from megatron_qrl.rollout.decode_lora import LoRAKernelExperts

    monkeypatch.setattr(decode_lora, "GROUPED_BELOW", 1e9 if deltas == "grouped" else 0.0)

    eng = make_engine(trainers, scheme, "static", kernels="on")
    mlp = eng.model.decoder.layers[1].mlp.experts
    w4a4 = scheme == "w4a4"
    ref = MegatronExperts(mlp, capture=w4a4, keep_codes=True)
    ker = LoRAKernelExperts(mlp, "nvfp4", w4a4, capture=w4a4, keep_codes=True)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 64, generator=g)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2], [1, 3]])
    probs = torch.softmax(torch.randn(6, 2, generator=g), -1)
    active = torch.tensor([True, True, False, True, True, True])

    def check():
        (y_ref, c_ref), (y_ker, c_ker) = ref(x, ids, probs, active), ker(x, ids, probs, active)
        assert y_ker.shape == (6, 2, 64)
        y = sum_slots(y_ker)
        err = float((y_ref[active] - y[active]).norm() / y_ref[active].norm())
        assert err < 2e-2, err
        if w4a4:
            for n in ("bits", "scales", "codes", "global_scale"):
                assert torch.equal(_raw(c_ref["fc1"][n][active]), _raw(c_ker["fc1"][n][active])), n
        return y

    before = check()
    x2 = x.clone()
    x2[2] = 100.0                       # an inactive row's input moves no one's scale or output
    assert torch.equal(sum_slots(ker(x2, ids, probs, active)[0])[active], before[active])
    perturb_adapters(trainers[scheme], seed=next(FRESH_SEEDS))     # new values whatever ran before
    sync_weights(eng, trainers[scheme], eng.cfg, 1, version=1)       # adapters only, in place
    after = check()
    assert float((after[active] - before[active]).abs().max()) > 1e-2


def test_bf16_base_lora_experts_keep_the_eager_loop():
    from megatron_qrl.models import build_model
    from megatron_qrl.platform import init_distributed, teardown
    from megatron_qrl.rollout.static_decode import unsupported_reason

    cfg = load_config(None, TINY + ["lora.enabled=true", "lora.rank=4", "lora.base_format=bf16", "quant.qat=false",
                                    "trace.enabled=false", "rollout.weights=bf16"])
    init_distributed(cfg)
    try:
        model = build_model(cfg)[0]
        assert unsupported_reason(model, cfg) == "LoRA routed experts over a bf16 base (lora.base_format=bf16)"
        fp4 = lora_cfg("w4a16", "auto")
        assert unsupported_reason(build_model(fp4)[0], fp4) is None
    finally:
        teardown()
