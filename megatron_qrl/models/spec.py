"""The Megatron layer spec of the Qwen3-MoE-style policy, with FP4-aware linears.

One TransformerLayer spec, mirroring Megatron's `get_gpt_layer_local_spec` for a Qwen3-MoE layer:
    input_layernorm   RMSNorm (AQN site)
    self_attention    SelfAttention(linear_qkv, core_attention, linear_proj, q/k RMSNorm)  GQA + RoPE
    pre_mlp_layernorm RMSNorm (AQN site)
    mlp               MoELayer(R3TopKRouter, SwiGLU experts as grouped GEMMs (QATGroupedMLP) or one after
                      another (QATSequentialMLP, trainer.moe_experts=sequential), optional shared expert)
                      or a dense SwiGLU MLP when model.num_experts == 0.
Every linear is our FP4ColumnParallelLinear / FP4RowParallelLinear subclass bound to the QAT settings of
its role (quant.targets: routed_experts -> only expert fc1/fc2; all_linears -> also qkv, proj, the shared
expert and dense MLPs; quant.scheme w4a4 / w4a16; quant.qat off -> no fake quant). The router and the
output layer (LM head) always stay in high precision.

Transformer Engine: when TE imports on a CUDA machine, core attention is TEDotProductAttention (fused
attention kernels); otherwise Megatron's local DotProductAttention. TE's fused LayerNormLinear and
grouped-GEMM experts are not used because the QAT, TRACE and AQN hooks live in our linears and norms
and must not depend on TE (TE's own NVFP4 recipe also needs Blackwell); the grouped experts use
torch._grouped_mm instead (models/grouped_experts.py).
"""
from __future__ import annotations

from functools import partial

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from .experts import QATSequentialMLP
from .grouped_experts import QATGroupedMLP
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from .aqn_norm import RMSNorm
from .fp4_linear import (OFF, FP4ColumnParallelLinear, FP4RowParallelLinear, QuantSettings,
                         fp4_linear_class)
from .r3_router import R3TopKRouter


class AQNRMSNorm(RMSNorm):
    """RMSNorm in front of quantized linears: carries AQN noise."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **kwargs):
        super().__init__(config, hidden_size, eps, **kwargs)
        self.aqn_site = True


def quant_settings(quant_cfg, role: str, fallback_shift: float = 0.25) -> QuantSettings:
    """QAT settings for a linear of `role` ('expert' or 'dense') from cfg.quant."""
    if not quant_cfg.qat or quant_cfg.format == "bf16":
        return OFF
    if role == "dense" and quant_cfg.targets != "all_linears":
        return OFF
    return QuantSettings(format=quant_cfg.format, weights=True, activations=quant_cfg.scheme == "w4a4",
                         fallback_shift=fallback_shift)


def expert_mlp_class(cfg) -> type:
    """The routed-expert MLP of `cfg.trainer.moe_experts`: grouped GEMMs (default; the same numbers, fewer and
    larger launches) or Megatron's one-expert-after-another SequentialMLP, the reference. QeRL mode (LoRA)
    keeps the per-expert path: its adapters live in the expert linears."""
    if cfg.trainer.moe_experts == "sequential" or cfg.lora.enabled:
        return QATSequentialMLP
    return QATGroupedMLP


def te_available() -> bool:
    """TE is used only on CUDA machines where it imports."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return bool(HAVE_TE)


def core_attention_class(use_te: bool):
    if use_te:
        from megatron.core.extensions.transformer_engine import TEDotProductAttention

        return TEDotProductAttention
    return DotProductAttention


def qwen3_moe_layer_spec(cfg, use_te: bool | None = None) -> ModuleSpec:
    """TransformerLayer ModuleSpec for `cfg` (a QRLConfig)."""
    use_te = te_available() if use_te is None else use_te
    shift = cfg.trace.fallback_shift
    dense_q = quant_settings(cfg.quant, "dense", shift)
    expert_q = quant_settings(cfg.quant, "expert", shift)
    column = fp4_linear_class(FP4ColumnParallelLinear, dense_q)
    row = fp4_linear_class(FP4RowParallelLinear, dense_q)
    linears = {"linear_qkv": column, "linear_proj": row, "linear_fc1": column, "linear_fc2": row,
               "experts.linear_fc1": fp4_linear_class(FP4ColumnParallelLinear, expert_q),
               "experts.linear_fc2": fp4_linear_class(FP4RowParallelLinear, expert_q)}
    if cfg.lora.enabled:  # QeRL mode: frozen (packed) base + adapters (models/lora.py)
        from .lora import lora_linear_class

        linears = {name: lora_linear_class(cls, name, cfg) for name, cls in linears.items()}
    dense_mlp = MLPSubmodules(linear_fc1=linears["linear_fc1"], linear_fc2=linears["linear_fc2"])

    if cfg.model.num_experts:
        experts = MLPSubmodules(linear_fc1=linears["experts.linear_fc1"], linear_fc2=linears["experts.linear_fc2"])
        shared = (partial(SharedExpertMLP, submodules=dense_mlp)
                  if cfg.model.moe_shared_expert_ffn_hidden_size else None)
        mlp = partial(MoELayer, submodules=MoESubmodules(
            experts=partial(expert_mlp_class(cfg), submodules=experts), shared_experts=shared, router=R3TopKRouter))
    else:
        mlp = partial(MLP.as_mlp_submodule, submodules=dense_mlp)

    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=AQNRMSNorm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=linears["linear_qkv"],
                    core_attention=core_attention_class(use_te),
                    linear_proj=linears["linear_proj"],
                    q_layernorm=RMSNorm if cfg.model.qk_layernorm else None,
                    k_layernorm=RMSNorm if cfg.model.qk_layernorm else None,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=AQNRMSNorm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
        ),
    )
