"""The SGLang weight sync's Megatron -> Hugging Face (Qwen3-MoE) name map (rollout/sglang/names.py).

Expected HF names and shapes are derived here from the config.json that convert.hf_config_from_model writes
(as transformers' Qwen3MoeForCausalLM lays its tensors out), not from the converter's own shape table."""
import pytest
import torch

from megatron_qrl.config import load_config
from megatron_qrl.convert import qwen3_moe
from megatron_qrl.quant import FP4Tensor, pack_weight
from megatron_qrl.rollout.sglang.names import NameMapError, qwen3_moe_name_map


def hf_expected_shapes(hf: dict) -> dict:
    """Every weight of a Qwen3MoeForCausalLM with this config.json: name -> shape."""
    H, d, V, E = hf["hidden_size"], hf["head_dim"], hf["vocab_size"], hf["num_experts"]
    q, kv, F = hf["num_attention_heads"] * d, hf["num_key_value_heads"] * d, hf["moe_intermediate_size"]
    out = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not hf["tie_word_embeddings"]:
        out["lm_head.weight"] = (V, H)
    for L in range(hf["num_hidden_layers"]):
        p = f"model.layers.{L}."
        out.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                    p + "self_attn.q_proj.weight": (q, H), p + "self_attn.k_proj.weight": (kv, H),
                    p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, q),
                    p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                    p + "mlp.gate.weight": (E, H)})
        for e in range(E):
            out.update({f"{p}mlp.experts.{e}.gate_proj.weight": (F, H), f"{p}mlp.experts.{e}.up_proj.weight": (F, H),
                        f"{p}mlp.experts.{e}.down_proj.weight": (H, F)})
    return out


def megatron_parameters(cfg) -> dict:
    """name -> shape of the unsharded Megatron model the trainer builds (no initialisation: shapes only)."""
    from megatron_qrl.models import build_model
    from megatron_qrl.models.provider import transformer_config
    from megatron_qrl.platform import init_distributed
    from megatron_qrl.platform.distributed import teardown

    init_distributed(cfg)
    try:
        config = transformer_config(cfg)
        config.perform_initialization = False
        model = build_model(cfg, config)[0]
        return {n: tuple(p.shape) for n, p in model.named_parameters()}
    finally:
        teardown()


@pytest.mark.parametrize("config", ["configs/tiny_cpu.yaml", "configs/single_h200.yaml"])
def test_every_megatron_parameter_maps_to_the_hf_model(config):
    cfg = load_config(config, ["trainer.bf16=false", "trainer.use_distributed_optimizer=false"])
    params = megatron_parameters(cfg)
    expected = hf_expected_shapes(qwen3_moe.hf_config_from_model(cfg.model))
    to_hf = qwen3_moe_name_map(cfg.model)
    got = {}
    for name, shape in params.items():
        for hf_name, t in to_hf(name, torch.empty(shape)):
            assert hf_name not in got, f"{hf_name} produced twice"
            got[hf_name] = tuple(t.shape)
    assert got == expected


def _fp4_case(cfg, name, shape, seed):
    torch.manual_seed(seed)
    w = torch.randn(shape) * torch.linspace(0.1, 3.0, shape[0])[:, None]   # rows of different scale
    return name, pack_weight(w, "nvfp4")


@pytest.mark.parametrize("which", ["qkv", "fc1", "fc2"])
def test_fp4_splits_dequantize_to_the_split_of_the_fused_weight(which):
    cfg = load_config("configs/tiny_cpu.yaml", [])
    m = cfg.model
    d, H = m.head_dim, m.hidden_size
    name, shape = {"qkv": ("decoder.layers.1.self_attention.linear_qkv.weight",
                           ((m.num_attention_heads + 2 * m.num_query_groups) * d, H)),
                   "fc1": ("decoder.layers.2.mlp.experts.local_experts.5.linear_fc1.weight", (2 * m.moe_ffn_hidden_size, H)),
                   "fc2": ("decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight", (H, m.moe_ffn_hidden_size))}[which]
    name, fp4 = _fp4_case(cfg, name, shape, seed=len(which))
    parts = qwen3_moe_name_map(m)(name, fp4)
    rule = {r.mcore: r for r in qwen3_moe.tensor_rules(m)}[name]
    assert [n for n, _ in parts] == list(rule.hf)
    fused = fp4.dequantize(torch.float32)
    for (hf_name, part), want in zip(parts, qwen3_moe.split(rule, fused, m)):
        assert isinstance(part, FP4Tensor) and part.format == "nvfp4"
        assert part.packed.dtype == torch.uint8 and part.packed.shape == (want.shape[0], want.shape[1] // 2)
        assert part.scales.dtype == torch.float8_e4m3fn and part.scales.shape == (want.shape[0], want.shape[1] // 16)
        assert part.global_scale is fp4.global_scale                    # one weight_scale_2 for the fused parts
        assert torch.equal(part.dequantize(torch.float32), want), hf_name
    # and the parts' bytes put back together are the fused payload's, byte for byte
    assert torch.equal(qwen3_moe.merge(rule, [p.packed for _, p in parts], m), fp4.packed)
    assert torch.equal(qwen3_moe.merge(rule, [p.scales.view(torch.uint8) for _, p in parts], m),
                       fp4.scales.view(torch.uint8))


def test_an_unknown_parameter_is_named_in_the_error():
    to_hf = qwen3_moe_name_map(load_config("configs/tiny_cpu.yaml", []).model)
    with pytest.raises(NameMapError, match="decoder.layers.0.mlp.experts.weight1.*global names"):
        to_hf("decoder.layers.0.mlp.experts.weight1", torch.zeros(2))
