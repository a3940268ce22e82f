"""Megatron -> Hugging Face (Qwen3-MoE) names for the weight sync: the NameMap SGLangEngine applies.

SGLang loads an update with the served model's own `load_weights`, which reads checkpoint (HF) names:
q_proj/k_proj/v_proj instead of the fused linear_qkv, gate_proj/up_proj instead of fc1, `mlp.experts.E`
instead of `mlp.experts.local_experts.E`. The mapping is the converter's (megatron_qrl.convert.qwen3_moe:
`tensor_rules` + `split`), so what the sync sends is what `qrl export-nvfp4` writes:
- plain tensors are split by rows (views of the trainer's tensor, no copy of the values);
- an FP4 payload is split the same way, codes and block scales by rows (both have one row per output
  row), while the per-tensor global scale (weight_scale_2) is shared by the parts, as in the export.
Every split is a pure rearrangement of bytes, so the digests checked on the fused Megatron payload cover
the parts sent.
"""
from __future__ import annotations

from megatron_qrl.quant.wire import FP4Tensor, Payload

from .engine import NameMap


class NameMapError(KeyError):
    """A parameter the Megatron -> HF mapping does not know (the message names it and the fix)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def split_payload(rule, payload: Payload, model_cfg) -> list[Payload]:
    """One Megatron payload -> the payloads of rule.hf, in order (FP4: rows split, global scale shared)."""
    from megatron_qrl.convert import qwen3_moe

    if isinstance(payload, FP4Tensor):
        packed = qwen3_moe.split(rule, payload.packed, model_cfg)
        scales = qwen3_moe.split(rule, payload.scales, model_cfg)
        return [FP4Tensor(payload.format, p, s, payload.global_scale) for p, s in zip(packed, scales)]
    return qwen3_moe.split(rule, payload, model_cfg)


def qwen3_moe_name_map(model_cfg) -> NameMap:
    """The NameMap for our GPTModel served as Qwen3MoeForCausalLM (raises ConvertError for other models)."""
    from megatron_qrl.convert import qwen3_moe

    rules = {r.mcore: r for r in qwen3_moe.tensor_rules(model_cfg)}

    def to_hf(name: str, payload: Payload) -> list[tuple[str, Payload]]:
        rule = rules.get(name)
        if rule is None:
            raise NameMapError(f"'{name}' has no Hugging Face (Qwen3-MoE) name: the SGLang sync expects the "
                               "parameters of an unsharded megatron_qrl model (convert/qwen3_moe.py tensor_rules); "
                               "send global names (pipeline/gather_weights.global_names)")
        return list(zip(rule.hf, split_payload(rule, payload, model_cfg)))

    return to_hf
