"""The engine's GPU kernel path (rollout/kernel_linears.py) forced on the CPU through the Triton interpreter.

Tiny fp32 MoE (the test model of test_rollout_engine.py). The kernel path feeds bf16 activations to the
W4A16 kernels, so it matches the dequantize-then-matmul engine (kernels off) to bf16 precision, not
bit for bit; the W4A4 quantization of an expert's input uses that expert's own dynamic scale, so the first
layer's fc1 captures (identical inputs on both paths) must be byte-identical.
"""
import pytest
import torch

from megatron_qrl.rollout import EmbeddedEngine, SamplingParams
from megatron_qrl.rollout.capture import GroupedCaptureRecord, scatter_records
from megatron_qrl.models.fp4_linear import CaptureRecord

from test_rollout_engine import make_cfg, prompts


def built_model(cfg):
    """Generator body of a module-scoped model fixture: process group up, seed 0, the model, teardown after."""
    from megatron_qrl.platform import init_distributed, teardown

    init_distributed(cfg)
    from megatron_qrl.models import build_model

    torch.manual_seed(0)
    yield build_model(cfg)[0]
    teardown()


@pytest.fixture(scope="module")
def source_model():
    yield from built_model(make_cfg())


def pair(model, **kw):
    ref = EmbeddedEngine(make_cfg(**kw), kernels="off", keep_codes=True)
    ker = EmbeddedEngine(make_cfg(**kw), kernels="on", keep_codes=True)
    for e in (ref, ker):
        e.sync_from_model(model, version=0)
    return ref, ker


@pytest.mark.parametrize("weights", ["nvfp4", "mxfp4"])
def test_kernel_path_w4a16_matches_reference(source_model, weights):
    ref, ker = pair(source_model, weights=weights, scheme="w4a16")
    assert ker.kernels is not None and ref.kernels is None and ker.health()["fp4_kernels"]
    assert len(ker.kernels.grouped) == 2
    ps = prompts(5, 9, 3)
    sp = SamplingParams(temperature=0.0, max_new_tokens=4)
    a, b = ref.generate(ps, sp), ker.generate(ps, sp)
    for x, y in zip(a, b):
        assert x.tokens == y.tokens
        assert torch.equal(x.routed_experts, y.routed_experts)
        err = float((x.logprobs - y.logprobs).abs().max())
        assert err < 2e-2, err          # bf16 activations / outputs in the kernels (observed ~3e-3)


def test_kernel_path_w4a4_captures(source_model):
    ref, ker = pair(source_model, weights="nvfp4", scheme="w4a4")
    ps = prompts(6, 4)
    sp = SamplingParams(temperature=0.0, max_new_tokens=3)
    a, b = ref.generate(ps, sp), ker.generate(ps, sp)
    for x, y in zip(a, b):
        assert sorted(y.trace) == [0, 1] and set(y.trace[0]) == {"fc1", "fc2"}
        cx, cy = x.trace[0]["fc1"], y.trace[0]["fc1"]
        assert cy.bits.shape == (y.num_forwarded, 2, 8)
        if torch.equal(x.routed_experts[:, 0], y.routed_experts[:, 0]):
            assert torch.equal(cx.codes, cy.codes) and torch.equal(cx.bits, cy.bits)
            assert torch.equal(cx.scales.view(torch.uint8), cy.scales.view(torch.uint8))
            assert torch.equal(cx.global_scale, cy.global_scale)
        assert float((x.logprobs - y.logprobs).abs().max()) < 0.25


def test_scatter_grouped_equals_per_expert():
    g = torch.Generator().manual_seed(3)
    T, k, E, K = 5, 2, 4, 32
    routed = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).reshape(T, 1, k).to(torch.int16)
    flat = routed[:, 0, :].reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    n = T * k
    bits = torch.randint(0, 256, (n, K // 8), dtype=torch.uint8, generator=g)
    scales = torch.rand(n, K // 16, generator=g).to(torch.float8_e4m3fn)
    packed = torch.randint(0, 256, (n, K // 2), dtype=torch.uint8, generator=g)
    gs = torch.rand(n, generator=g)
    experts = flat[order]
    per_expert = []
    for e in range(E):
        rows = (experts == e).nonzero(as_tuple=True)[0]
        if rows.numel():
            per_expert.append(CaptureRecord(f"L0.fc1.E{e}", packed[rows], scales[rows], gs[rows][0], bits[rows]))
    # per-expert records carry one global scale each: give the grouped record the same per-row values
    gs_rows = torch.cat([torch.full((r.bits.shape[0],), float(r.global_scale)) for r in per_expert])
    grouped = GroupedCaptureRecord(0, "fc1", experts, packed, scales, gs_rows, bits)
    a = scatter_records(per_expert[::-1], routed, T, [0], "nvfp4", keep_codes=True)[0]["fc1"]
    b = scatter_records([grouped], routed, T, [0], "nvfp4", keep_codes=True)[0]["fc1"]
    assert torch.equal(a.bits, b.bits) and torch.equal(a.codes, b.codes) and torch.equal(a.global_scale, b.global_scale)
    # row i of the dispatch order lands at (token, slot) of the i-th sorted assignment
    t, j = order[0] // k, order[0] % k
    assert torch.equal(b.bits[t, j], bits[0])
    wrong = GroupedCaptureRecord(0, "fc1", experts.flip(0), packed, scales, gs_rows, bits)
    with pytest.raises(RuntimeError, match="do not follow the routed experts"):
        scatter_records([wrong], routed, T, [0], "nvfp4")
    with pytest.raises(RuntimeError, match="captured rows"):
        scatter_records([GroupedCaptureRecord(0, "fc1", experts[1:], packed[1:], scales[1:], gs_rows[1:], bits[1:])],
                        routed, T, [0], "nvfp4")


def _step_records(g, T, k, E, K, grouped: bool):
    """One forward's routed ids and capture records of layer 0 fc1 (per-expert or one grouped record)."""
    routed = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).reshape(T, 1, k).to(torch.int16)
    experts = torch.sort(routed[:, 0, :].reshape(-1).long(), stable=True).values
    n = T * k
    bits = torch.randint(0, 256, (n, K // 8), dtype=torch.uint8, generator=g)
    scales = torch.rand(n, K // 16, generator=g).to(torch.float8_e4m3fn)
    packed = torch.randint(0, 256, (n, K // 2), dtype=torch.uint8, generator=g)
    gs_e = torch.rand(E, generator=g)
    if grouped:
        return routed, [GroupedCaptureRecord(0, "fc1", experts, packed, scales, gs_e[experts], bits)]
    recs = []
    for e in range(E):
        rows = (experts == e).nonzero(as_tuple=True)[0]
        if rows.numel():
            recs.append(CaptureRecord(f"L0.fc1.E{e}", packed[rows], scales[rows], gs_e[e], bits[rows]))
    return routed, recs[::-1]


@pytest.mark.parametrize("grouped", [False, True])
def test_scatter_steps_equals_per_step_scatter(grouped):
    """One scatter over a whole generate() (what the engine now does at the end of the call) places every
    row exactly where scattering each forward on its own would, also when steps have different token counts."""
    from megatron_qrl.rollout.capture import scatter_steps

    g = torch.Generator().manual_seed(7)
    k, E, K = 2, 5, 32
    steps = [_step_records(g, T, k, E, K, grouped) for T in (6, 1, 3, 4)]
    per_step = [scatter_records(recs, routed, routed.shape[0], [0], "nvfp4", keep_codes=True)[0]["fc1"]
                for routed, recs in steps]
    routed_all = torch.cat([routed for routed, _ in steps])
    whole = scatter_steps([(recs, routed.shape[0]) for routed, recs in steps], routed_all, [0], "nvfp4",
                          keep_codes=True)[0]["fc1"]
    for attr in ("bits", "codes", "global_scale"):
        assert torch.equal(getattr(whole, attr), torch.cat([getattr(c, attr) for c in per_step])), attr
    assert torch.equal(whole.scales.view(torch.uint8), torch.cat([c.scales.view(torch.uint8) for c in per_step]))
    # rows of step 1 swapped with step 2's would still have the right experts but the wrong step: caught
    swapped = [(steps[0][1], 6), (steps[2][1], 1), (steps[1][1], 3), (steps[3][1], 4)]
    with pytest.raises(RuntimeError, match="do not follow the routed experts"):
        scatter_steps(swapped, routed_all, [0], "nvfp4")


def test_kernel_engine_keeps_no_dense_copy(source_model):
    """The FP4 kernels read their weights packed: the engine frees those parameters (no BF16 copy beside the FP4
    bytes), keeps them free through release/resume, generates the same after resume and refuses to sync from its
    own emptied model; a reference engine (kernels off) keeps every dense value."""
    ref, ker = pair(source_model, weights="nvfp4", scheme="w4a16", targets="all_linears")
    names = ker.kernels.packed_weights()
    params = dict(ker.model.named_parameters())
    assert names == ker.store.packed_only == set(ker.store.quantized)
    assert ker.health()["packed_only_weights"] == len(names) > 0
    assert any("local_experts" in n for n in names) and any("linear_qkv" in n for n in names)
    assert all(params[n].numel() == 0 for n in names)
    assert not ref.store.packed_only and all(p.numel() > 0 for p in ref.model.parameters())
    ps, sp = prompts(5, 9), SamplingParams(temperature=0.0, max_new_tokens=4)
    before = ker.generate(ps, sp)
    ker.release_memory()
    ker.resume_memory()
    assert all(params[n].numel() == 0 for n in names)
    assert all(params[n].numel() > 0 for n in params if n not in names)
    after = ker.generate(ps, sp)
    for x, y in zip(before, after):
        assert x.tokens == y.tokens and torch.equal(x.logprobs, y.logprobs)
    with pytest.raises(ValueError, match="sync from the trainer's model"):
        ker.sync_from_model(ker.model, version=1)
    ker.sync_from_model(source_model, version=1)       # from the trainer: in place, the same weights
    again = ker.generate(ps, sp)
    assert [s.tokens for s in again] == [s.tokens for s in before] and ker.version == 1


def test_seeded_weights_are_the_same_in_every_engine(source_model):
    """tools/seeded_weights.py (the benchmarks' weights): the kernel engine's packed-only payloads are byte for
    byte the reference engine's, and both generate the same tokens."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from seeded_weights import sync_seeded

    from megatron_qrl.platform.distributed import seed_everything

    engines = []
    for kernels in ("off", "on"):
        seed_everything(0)                              # the rest of the model: its own seeded init
        engines.append(EmbeddedEngine(make_cfg(), kernels=kernels, keep_codes=True))
    ref, ker = engines
    hashes = [sync_seeded(e, seed=5) for e in (ref, ker)]
    assert hashes[0] == hashes[1]
    name = sorted(ker.store.packed_only)[0]
    assert torch.equal(ref.store.entries[name].packed, ker.store.entries[name].packed)
    assert sync_seeded(ref, seed=6) != hashes[0]        # the seed changes the weights
    sync_seeded(ref, seed=5)
    ps, sp = prompts(4, 7), SamplingParams(temperature=0.0, max_new_tokens=3)
    assert [s.tokens for s in ref.generate(ps, sp)] == [s.tokens for s in ker.generate(ps, sp)]
