"""`qrl export-nvfp4` on the tiny Qwen3-MoE (see test_convert_qwen3_moe.py): ModelOpt's HF NVFP4 layout,
bytes identical to the trainer -> engine weight sync, values identical to our QAT fake quantization when
ModelOpt's own NVFP4QTensor dequantizes them.
"""
import json

import pytest
import torch
from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format
from modelopt.torch.export.quant_utils import _prefix_wildcard_summarize_exclude_modules
from modelopt.torch.quantization.qtensor import NVFP4QTensor

from megatron_qrl.convert import qwen3_moe
from megatron_qrl.convert.safetensors_io import SafetensorsReader
from test_convert_qwen3_moe import make_tiny_hf

FP4_SUFFIXES = ("weight", "weight_scale", "weight_scale_2", "input_scale")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(checkpoint, cfg, model loaded from it, exports by name)."""
    from megatron_qrl.convert import export_nvfp4, hf_to_mcore
    from megatron_qrl.convert.export_hf import load_checkpoint_model
    from megatron_qrl.platform import teardown

    root = tmp_path_factory.mktemp("nvfp4")
    make_tiny_hf(root / "hf", seed=11)
    ckpt = hf_to_mcore(root / "hf", root / "ckpt")
    exports = {"routed_experts": export_nvfp4(ckpt, root / "fp4_experts", calib_samples=4, calib_seq_len=32),
               "all_linears": export_nvfp4(ckpt, root / "fp4_all", overrides=["quant.targets=all_linears"],
                                           input_amax=1.0)}
    cfg, model = load_checkpoint_model(ckpt)
    yield ckpt, cfg, model, exports
    teardown()


def read(directory):
    with SafetensorsReader(directory) as r:
        return {n: r.get(n).clone() for n in r.names()}


def quantized_rules(cfg, targets):
    """Rules of the linears the weight sync packs in FP4: routed experts, plus attention with all_linears."""
    def quantized(rule):
        attention = rule.mcore.endswith(("linear_qkv.weight", "linear_proj.weight"))
        return ".local_experts." in rule.mcore or (targets == "all_linears" and attention)

    return [r for r in qwen3_moe.tensor_rules(cfg.model) if quantized(r)]


@pytest.mark.parametrize("targets", ["routed_experts", "all_linears"])
def test_bytes_equal_weight_sync(setup, targets):
    """Re-fusing the exported q/k/v and gate/up rows gives the exact payloads (and digests) the engine receives."""
    from megatron_qrl.quant import FP4Tensor, payload_digest
    from megatron_qrl.rollout import EmbeddedEngine

    _, cfg, model, exports = setup
    cfg = cfg.model_copy(update={"quant": cfg.quant.model_copy(update={"targets": targets})})
    engine = EmbeddedEngine(cfg)
    hashes = engine.sync_from_model(model, version=0)
    tensors = read(exports[targets])
    rules = quantized_rules(cfg, targets)
    assert {r.mcore for r in rules} == engine.store.quantized
    for rule in rules:
        mods = rule.hf_modules()
        sent = engine.store.entries[rule.mcore]
        packed = qwen3_moe.merge(rule, [tensors[f"{m}.weight"] for m in mods], cfg.model)
        scales = qwen3_moe.merge(rule, [tensors[f"{m}.weight_scale"] for m in mods], cfg.model)
        (gs,) = {tensors[f"{m}.weight_scale_2"].item() for m in mods}  # one global scale per fused weight
        assert packed.dtype == torch.uint8 and scales.dtype == torch.float8_e4m3fn
        assert torch.equal(packed, sent.packed) and torch.equal(scales.view(torch.uint8), sent.scales.view(torch.uint8))
        assert gs == sent.global_scale.item()
        exported = FP4Tensor("nvfp4", packed, scales, tensors[f"{mods[0]}.weight_scale_2"])
        assert payload_digest(exported) == hashes[rule.mcore]


def test_modelopt_dequantizes_to_our_fake_quant(setup):
    from megatron_qrl.quant import quant_dequant

    _, cfg, model, exports = setup
    params = dict(model.named_parameters())
    tensors = read(exports["all_linears"])
    checked = 0
    for rule in quantized_rules(cfg, "all_linears"):
        expected = qwen3_moe.split(rule, quant_dequant(params[rule.mcore].detach(), "nvfp4"), cfg.model)
        for mod, want in zip(rule.hf_modules(), expected):
            packed = tensors[f"{mod}.weight"]
            q = NVFP4QTensor(torch.Size((packed.shape[0], packed.shape[1] * 2)), torch.float32, packed)
            got = q.dequantize(dtype=torch.float32, scale=tensors[f"{mod}.weight_scale"],
                               double_scale=tensors[f"{mod}.weight_scale_2"], block_sizes={-1: 16})
            assert torch.equal(got, want), mod
            checked += 1
    assert checked == cfg.model.num_layers * (4 + 3 * cfg.model.num_experts)


@pytest.mark.parametrize("targets", ["routed_experts", "all_linears"])
def test_modelopt_layout_and_configs(setup, targets):
    _, cfg, model, exports = setup
    out = exports[targets]
    tensors = read(out)
    params = dict(model.named_parameters())
    quantized_modules, plain = [], []
    for rule in qwen3_moe.tensor_rules(cfg.model):
        if rule in quantized_rules(cfg, targets):
            for mod in rule.hf_modules():
                quantized_modules.append(mod)
                w, s = tensors[f"{mod}.weight"], tensors[f"{mod}.weight_scale"]
                assert w.dtype == torch.uint8 and s.dtype == torch.float8_e4m3fn
                assert s.shape == (w.shape[0], w.shape[1] * 2 // 16)
                for scalar in ("weight_scale_2", "input_scale"):
                    t = tensors[f"{mod}.{scalar}"]
                    assert t.dtype == torch.float32 and t.dim() == 0 and t.item() > 0
        else:  # high precision, in the export dtype (bf16)
            for name, want in zip(rule.hf, qwen3_moe.split(rule, params[rule.mcore].detach(), cfg.model)):
                assert torch.equal(tensors[name], want.to(torch.bfloat16))
                plain.append(name)
    expected_names = {f"{m}.{s}" for m in quantized_modules for s in FP4_SUFFIXES} | set(plain)
    assert set(tensors) == expected_names

    quant = json.loads((out / "hf_quant_config.json").read_text())
    q = quant["quantization"]
    assert (q["quant_algo"], q["group_size"], q["kv_cache_quant_algo"]) == ("NVFP4", 16, None)
    linear_names = [m for r in qwen3_moe.tensor_rules(cfg.model) for m in r.hf_modules()
                    if m.endswith(("_proj", "mlp.gate", "lm_head"))]
    unquantized = [m for m in linear_names if m not in quantized_modules]
    assert q["exclude_modules"] == sorted(_prefix_wildcard_summarize_exclude_modules(unquantized, quantized_modules))
    assert "lm_head" in q["exclude_modules"] and "model.layers.0.mlp.gate" in q["exclude_modules"]
    assert ("model.layers.0.self_attn*" in q["exclude_modules"]) == (targets == "routed_experts")

    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == convert_hf_quant_config_format(quant)
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]


def test_input_scales(setup):
    """Fixed --input-amax: amax/(6*448) everywhere. Calibrated: the recorded amax; the attention input's amax is
    the largest |RMSNorm(embedding)| over the calibration tokens; fc2's is the unscaled silu(gate)*up."""
    from megatron_qrl.convert.calibration import random_tokens

    ckpt, cfg, model, exports = setup
    fixed = read(exports["all_linears"])
    assert {t.item() for n, t in fixed.items() if n.endswith("input_scale")} == \
        {torch.tensor(1.0 / (6 * 448), dtype=torch.float32).item()}

    record = json.loads((exports["routed_experts"] / "qrl_export.json").read_text())
    amax = record["input_amax"]
    calibrated = read(exports["routed_experts"])
    for rule in quantized_rules(cfg, "routed_experts"):
        for mod in rule.hf_modules():
            assert calibrated[f"{mod}.input_scale"].item() == \
                torch.tensor(amax[rule.mcore] / (6 * 448), dtype=torch.float32).item()
    # gate and up of one expert share their input and therefore input_scale
    assert calibrated["model.layers.1.mlp.experts.3.gate_proj.input_scale"] == \
        calibrated["model.layers.1.mlp.experts.3.up_proj.input_scale"]
    from megatron_qrl.convert.calibration import activation_amax
    from megatron_qrl.convert.nvfp4_export import quantized_linears

    linears = quantized_linears(model, "all_linears")
    seqs = random_tokens(4, 32, cfg.model.vocab_size)
    got = activation_amax(model, linears, seqs)
    with torch.no_grad():
        emb = model.embedding.word_embeddings.weight
        want = max(model.decoder.layers[0].input_layernorm(emb[s]).abs().max().item() for s in seqs)
    assert got["decoder.layers.0.self_attention.linear_qkv.weight"] == pytest.approx(want, rel=1e-6)
    assert {k: v for k, v in got.items() if ".local_experts." in k} == amax  # same seeds as the export
    # fc2 sees the routing probability (< 1) multiplied in inside Megatron; the exported amax is larger
    scaled = {}

    def record_scaled(name):
        def hook(module, args):
            if args[0].numel():
                scaled[name] = max(scaled.get(name, 0.0), args[0].abs().max().item())
        return hook

    hooks = [m.register_forward_pre_hook(record_scaled(n)) for n, m in linears.items()
             if ".local_experts." in n and n.endswith("linear_fc2.weight")]
    with torch.no_grad():
        for s in seqs:
            model(s[None], torch.arange(len(s))[None], None)
    for h in hooks:
        h.remove()
    assert scaled and all(got[n] > v for n, v in scaled.items())


def test_calibration_file(setup, tmp_path):
    from megatron_qrl.convert.calibration import read_calibration_tokens

    ok = tmp_path / "calib.jsonl"
    ok.write_text('{"input_ids": [1, 2, 3]}\n[4, 5]\n')
    assert [t.tolist() for t in read_calibration_tokens(ok, 64, 128)] == [[1, 2, 3], [4, 5]]
    bad = tmp_path / "bad.json"
    bad.write_text("[[1, 2, 99]]")
    from megatron_qrl.convert import ConvertError

    with pytest.raises(ConvertError, match=r"outside \[0, 64\)"):
        read_calibration_tokens(bad, 64, 128)
