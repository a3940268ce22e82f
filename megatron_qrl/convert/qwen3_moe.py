"""Qwen3-MoE (and dense Qwen3) <-> our Megatron model: config fields and the tensor-by-tensor name/shape mapping.

Megatron names are those of an unsharded model (TP=PP=EP=1) built by `megatron_qrl.models.build_model`
(our layer spec: separate RMSNorm modules, FP4 linears, SequentialMLP experts). One `TensorRule` maps
one Megatron parameter to the HF tensor(s) it is made of:

    HF (h = model.layers.L.)              Megatron (m = decoder.layers.L.)        every name ends in .weight
    model.embed_tokens                    embedding.word_embeddings
    h.input_layernorm                     m.input_layernorm
    h.self_attn.{q,k,v}_proj              m.self_attention.linear_qkv                    (qkv)
    h.self_attn.o_proj                    m.self_attention.linear_proj
    h.self_attn.{q,k}_norm                m.self_attention.{q,k}_layernorm
    h.post_attention_layernorm            m.pre_mlp_layernorm
    h.mlp.gate                            m.mlp.router
    h.mlp.experts.E.{gate,up}_proj        m.mlp.experts.local_experts.E.linear_fc1       (gate_up)
    h.mlp.experts.E.down_proj             m.mlp.experts.local_experts.E.linear_fc2
    model.norm                            decoder.final_layernorm
    lm_head                               output_layer        (absent when embeddings are tied)
Dense Qwen3 (Qwen3ForCausalLM, model.num_experts=0) has the same attention and, instead of router + experts,
    h.mlp.{gate,up}_proj                  m.mlp.linear_fc1                               (gate_up)
    h.mlp.down_proj                       m.mlp.linear_fc2

qkv: Megatron's fused QKV rows are grouped per KV head (query group): [q heads of group 0, k_0, v_0,
q heads of group 1, k_1, v_1, ...], each head `head_dim` rows. gate_up: fc1 = [gate; up] (Megatron's GLU
applies silu to the first half). Merges and splits work on rows only, so they apply unchanged to FP4
packed weights and their block scales (NVFP4 export).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import ConvertError

ARCHITECTURE = "Qwen3MoeForCausalLM"
MODEL_TYPE = "qwen3_moe"
DENSE_ARCHITECTURE, DENSE_MODEL_TYPE = "Qwen3ForCausalLM", "qwen3"   # the MoE-less sibling: num_experts=0
# HF tensors that carry no weights (older exports save RoPE's inverse frequencies); skipped on import.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ----------------------------------------------------------------------------------------- config
def _rope_theta(hf: dict) -> float:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ConvertError(f"config.json uses RoPE scaling '{rope_type}'; our model implements plain RoPE only "
                           "(Megatron rotary_base). Convert a checkpoint without rope_scaling")
    theta = params.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise ConvertError("config.json has no rope_theta (or rope_parameters.rope_theta); add it")
    if float(theta) != int(theta):
        raise ConvertError(f"rope_theta={theta} is not an integer; model.rotary_base is an int")
    return theta


def _require(hf: dict, key: str, expected, why: str, missing=None) -> None:
    """config.json[key] must equal `expected`; an absent/null key means `missing` (default: `expected`)."""
    value = hf.get(key)
    if value is None:
        value = expected if missing is None else missing
    if value != expected:
        shown = hf.get(key, f"<absent, which transformers reads as {missing!r}>")
        raise ConvertError(f"config.json has {key}={shown!r}; our Qwen3-MoE model needs {key}={expected!r} "
                           f"({why})")


# why a near relative cannot be expressed by our layer spec (megatron_qrl/models/spec.py, provider.py)
UNSUPPORTED = {
    "Qwen2ForCausalLM": "Qwen2 / Qwen2.5 have a bias on q/k/v and no q/k RMSNorm; our layer spec builds "
                        "neither (add_qkv_bias=False, QK-norm on)",
    "Qwen2MoeForCausalLM": "Qwen1.5/Qwen2-MoE have q/k/v biases and a gated shared expert, which our spec lacks",
}


def model_fields_from_hf(hf: dict) -> dict:
    """config.json of a Qwen3-MoE (or dense Qwen3) checkpoint -> the `model.*` fields of a QRLConfig."""
    arch = hf.get("architectures") or []
    if arch not in ([ARCHITECTURE], [DENSE_ARCHITECTURE]):
        why = "".join(f" ({UNSUPPORTED[a]})" for a in arch if a in UNSUPPORTED)
        raise ConvertError(f"config.json architectures={arch} is not supported{why}; this converter handles "
                           f"['{ARCHITECTURE}'] (Qwen3-MoE) and ['{DENSE_ARCHITECTURE}'] (dense Qwen3). Other "
                           "families need their own mapping (docs/convert.md, 'Limits')")
    moe = arch == [ARCHITECTURE]
    need = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size") + \
        (("moe_intermediate_size", "num_experts_per_tok") if moe else ("intermediate_size",))
    missing = [k for k in need if k not in hf]
    if missing:
        raise ConvertError(f"config.json lacks {missing}; re-save the config with transformers")
    _require(hf, "hidden_act", "silu", "SwiGLU MLPs")
    _require(hf, "attention_bias", False, "linears have no bias: add_bias_linear=False")
    _require(hf, "use_sliding_window", False, "full causal attention")
    if moe:
        _require(hf, "norm_topk_prob", True, "Megatron's top-k router renormalises the chosen probabilities",
                 missing=False)
        _require(hf, "decoder_sparse_step", 1, "every layer is an MoE layer in our spec")
        _require(hf, "mlp_only_layers", [], "every layer is an MoE layer in our spec")
        num_experts = hf.get("num_experts", hf.get("num_local_experts"))
        if not num_experts:
            raise ConvertError("config.json has no num_experts (or num_local_experts); a Qwen3-MoE config needs it")
        ffn = hf.get("intermediate_size", hf["moe_intermediate_size"])
        experts = {"num_experts": num_experts, "moe_router_topk": hf["num_experts_per_tok"],
                   "moe_ffn_hidden_size": hf["moe_intermediate_size"]}
    else:   # the MoE fields mean nothing to a dense model; fixed so that a config cannot pretend otherwise
        ffn = hf["intermediate_size"]
        experts = {"num_experts": 0, "moe_router_topk": 1, "moe_ffn_hidden_size": ffn}
    heads = hf["num_attention_heads"]
    return {
        "num_layers": hf["num_hidden_layers"],
        "hidden_size": hf["hidden_size"],
        "num_attention_heads": heads,
        "num_query_groups": hf["num_key_value_heads"],
        "kv_channels": hf.get("head_dim") or hf["hidden_size"] // heads,
        "ffn_hidden_size": ffn,
        **experts,
        "moe_shared_expert_ffn_hidden_size": 0,
        "qk_layernorm": True,
        "rotary_base": int(_rope_theta(hf)),
        "norm_epsilon": hf.get("rms_norm_eps", 1e-6),
        "vocab_size": hf["vocab_size"],
        "max_sequence_length": hf.get("max_position_embeddings", 4096),
        "untie_embeddings_and_output_weights": not hf.get("tie_word_embeddings", False),
    }


# model.* fields a Qwen3-MoE config.json determines. max_sequence_length (from max_position_embeddings) is
# only a default: runs may use shorter sequences. The remaining fields are training choices.
DERIVED_FIELDS = (
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size",
    "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_ffn_hidden_size", "qk_layernorm",
    "rotary_base", "norm_epsilon", "vocab_size", "untie_embeddings_and_output_weights")


def check_supported(m) -> None:
    """Our model config must be expressible as Qwen3-MoE (mcore-to-hf / export direction)."""
    problems = []
    if m.moe_shared_expert_ffn_hidden_size:
        problems.append("Qwen3-MoE has no shared expert (model.moe_shared_expert_ffn_hidden_size must be 0)")
    if not m.qk_layernorm:
        problems.append("Qwen3-MoE always has q_norm/k_norm (model.qk_layernorm must be true)")
    if problems:
        raise ConvertError(f"this checkpoint's model cannot be written as {architecture(m)}: " + "; ".join(problems))


def architecture(m) -> str:
    """The HF architecture our model config corresponds to."""
    return ARCHITECTURE if m.num_experts else DENSE_ARCHITECTURE


def hf_config_from_model(m, dtype: str = "bfloat16") -> dict:
    """A Qwen3-MoE / Qwen3 config.json for our model config (used when the source's config.json is not at hand)."""
    check_supported(m)
    if not m.num_experts:
        return {
            "architectures": [DENSE_ARCHITECTURE], "model_type": DENSE_MODEL_TYPE,
            "hidden_size": m.hidden_size, "intermediate_size": m.ffn_hidden_size, "num_hidden_layers": m.num_layers,
            "num_attention_heads": m.num_attention_heads, "num_key_value_heads": m.num_query_groups,
            "head_dim": m.head_dim, "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
            "rms_norm_eps": m.norm_epsilon, "rope_theta": float(m.rotary_base), "rope_scaling": None,
            "max_position_embeddings": m.max_sequence_length, "vocab_size": m.vocab_size,
            "tie_word_embeddings": not m.untie_embeddings_and_output_weights, "use_sliding_window": False,
            "sliding_window": None, "initializer_range": m.init_method_std, "use_cache": True, "torch_dtype": dtype,
        }
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "hidden_size": m.hidden_size, "intermediate_size": m.ffn_hidden_size,
        "moe_intermediate_size": m.moe_ffn_hidden_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads, "num_key_value_heads": m.num_query_groups,
        "head_dim": m.head_dim, "num_experts": m.num_experts, "num_experts_per_tok": m.moe_router_topk,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu",
        "attention_bias": False, "attention_dropout": 0.0, "rms_norm_eps": m.norm_epsilon,
        "rope_theta": float(m.rotary_base), "rope_scaling": None,
        "max_position_embeddings": m.max_sequence_length, "vocab_size": m.vocab_size,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights, "use_sliding_window": False,
        "sliding_window": None, "router_aux_loss_coef": m.moe_aux_loss_coeff, "output_router_logits": False,
        "initializer_range": m.init_method_std, "use_cache": True, "torch_dtype": dtype,
    }


# ----------------------------------------------------------------------------------------- tensors
@dataclass(frozen=True)
class TensorRule:
    """One Megatron parameter (unsharded name) and the HF tensors it is made of, in merge order."""

    mcore: str
    hf: tuple
    kind: str = "copy"   # "copy" | "qkv" | "gate_up"

    def hf_modules(self) -> list[str]:
        """HF module names (tensor names without '.weight'), e.g. for NVFP4 scale tensors."""
        return [n.removesuffix(".weight") for n in self.hf]


def tensor_rules(m) -> list[TensorRule]:
    """Every parameter of our model, in HF checkpoint order."""
    check_supported(m)
    rules = [TensorRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",))]
    for L in range(m.num_layers):
        hf, mc = f"model.layers.{L}.", f"decoder.layers.{L}."
        attn = hf + "self_attn."
        rules += [
            TensorRule(mc + "input_layernorm.weight", (hf + "input_layernorm.weight",)),
            TensorRule(mc + "self_attention.linear_qkv.weight",
                       (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"), "qkv"),
            TensorRule(mc + "self_attention.linear_proj.weight", (attn + "o_proj.weight",)),
            TensorRule(mc + "self_attention.q_layernorm.weight", (attn + "q_norm.weight",)),
            TensorRule(mc + "self_attention.k_layernorm.weight", (attn + "k_norm.weight",)),
            TensorRule(mc + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",)),
        ]
        if not m.num_experts:
            rules += [TensorRule(mc + "mlp.linear_fc1.weight", (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"),
                                 "gate_up"),
                      TensorRule(mc + "mlp.linear_fc2.weight", (hf + "mlp.down_proj.weight",))]
            continue
        rules.append(TensorRule(mc + "mlp.router.weight", (hf + "mlp.gate.weight",)))
        for e in range(m.num_experts):
            he, me = f"{hf}mlp.experts.{e}.", f"{mc}mlp.experts.local_experts.{e}."
            rules += [TensorRule(me + "linear_fc1.weight", (he + "gate_proj.weight", he + "up_proj.weight"), "gate_up"),
                      TensorRule(me + "linear_fc2.weight", (he + "down_proj.weight",))]
    rules.append(TensorRule("decoder.final_layernorm.weight", ("model.norm.weight",)))
    if m.untie_embeddings_and_output_weights:
        rules.append(TensorRule("output_layer.weight", ("lm_head.weight",)))
    return rules


def hf_shapes(rule: TensorRule, m) -> list[tuple]:
    """Expected shapes of the rule's HF tensors."""
    H, d, V = m.hidden_size, m.head_dim, m.vocab_size
    name = rule.hf[0]
    F = m.moe_ffn_hidden_size if ".experts." in name else m.ffn_hidden_size
    if rule.kind == "qkv":
        return [(m.num_attention_heads * d, H), (m.num_query_groups * d, H), (m.num_query_groups * d, H)]
    if rule.kind == "gate_up":
        return [(F, H)] * 2
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return [(V, H)]
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return [(d,)]
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return [(H,)]
    if name.endswith("o_proj.weight"):
        return [(H, m.num_attention_heads * d)]
    if name.endswith("mlp.gate.weight"):
        return [(m.num_experts, H)]
    if name.endswith("down_proj.weight"):
        return [(H, F)]
    raise AssertionError(f"no shape rule for {name}")


def _qkv_row_sizes(m) -> tuple[int, int, int]:
    heads_per_group = m.num_attention_heads // m.num_query_groups
    return heads_per_group * m.head_dim, m.head_dim, m.head_dim


def merge(rule: TensorRule, tensors: list[torch.Tensor], m) -> torch.Tensor:
    """HF tensors -> the Megatron parameter (rows rearranged; trailing dims untouched)."""
    if rule.kind == "copy":
        return tensors[0]
    if rule.kind == "gate_up":
        return torch.cat(tensors, dim=0)
    G = m.num_query_groups
    q, k, v = (t.reshape(G, -1, *t.shape[1:]) for t in tensors)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tensors[0].shape[1:])


def split(rule: TensorRule, tensor: torch.Tensor, m) -> list[torch.Tensor]:
    """The Megatron parameter (or any tensor with its rows, e.g. FP4 packed bytes) -> the HF tensors."""
    if rule.kind == "copy":
        return [tensor]
    if rule.kind == "gate_up":
        return list(tensor.chunk(2, dim=0))
    G = m.num_query_groups
    grouped = tensor.reshape(G, -1, *tensor.shape[1:])
    return [p.reshape(-1, *tensor.shape[1:]) for p in grouped.split(_qkv_row_sizes(m), dim=1)]
