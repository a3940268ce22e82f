"""Build the Megatron-Core GPTModel (Qwen3-MoE style) for this rank from a QRLConfig.

`transformer_config(cfg)` maps cfg.model / cfg.trainer onto Megatron's TransformerConfig;
`build_model(cfg)` returns the list of model chunks of this pipeline stage (one chunk: no virtual
pipeline) with every quantized site, AQN norm and R3 router labelled with its *global* layer index (and
global expert index), so names agree across layouts, with the rollout engine and with TRACE caches.
Megatron's process groups must exist (megatron_qrl.platform.init_distributed).

Fixed choices (Qwen3-MoE): RMSNorm, SwiGLU (gated silu), RoPE, GQA, QK-norm, no biases, softmax top-k
router without pre-softmax, alltoall token dispatcher, untied embeddings by default, no dropout (RL
needs the train and rollout forwards to be the same function). calculate_per_token_loss=True so the
trainer's loss is an explicit sum (see megatron_qrl.trainer).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_qrl.platform import cpu as cpu_shim

from .aqn_norm import RMSNorm
from .fp4_linear import _FP4LinearMixin, site_name
from .r3_router import R3TopKRouter
from .spec import qwen3_moe_layer_spec, te_available


def sequence_parallel_enabled(cfg) -> bool:
    t = cfg.trainer
    if t.sequence_parallel is not None:
        return bool(t.sequence_parallel) and t.tensor_parallel > 1
    return t.tensor_parallel > 1 and cfg.model.num_experts > 0


def transformer_config(cfg) -> TransformerConfig:
    m, t = cfg.model, cfg.trainer
    dtype = torch.bfloat16 if t.bf16 else torch.float32
    moe = m.num_experts > 0
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.head_dim,
        ffn_hidden_size=m.ffn_hidden_size if not moe else m.moe_ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=m.norm_epsilon,
        qk_layernorm=m.qk_layernorm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=m.init_method_std,
        # MoE
        num_moe_experts=m.num_experts or None,
        moe_router_topk=m.moe_router_topk if moe else 2,
        moe_ffn_hidden_size=m.moe_ffn_hidden_size if moe else None,
        moe_shared_expert_intermediate_size=(m.moe_shared_expert_ffn_hidden_size or None) if moe else None,
        moe_router_load_balancing_type="aux_loss" if m.moe_aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=m.moe_aux_loss_coeff,
        moe_token_dispatcher_type="alltoall",
        moe_router_dtype="fp32",
        moe_router_score_function="softmax",
        moe_router_pre_softmax=False,
        moe_grouped_gemm=False,
        # parallelism
        tensor_model_parallel_size=t.tensor_parallel,
        pipeline_model_parallel_size=t.pipeline_parallel,
        expert_model_parallel_size=t.expert_parallel,
        expert_tensor_parallel_size=t.expert_tensor_parallel,
        sequence_parallel=sequence_parallel_enabled(cfg),
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=t.bf16,
        calculate_per_token_loss=True,
        # kernels/fusions that need CUDA extensions stay off; the math is the same
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        moe_permute_fusion=False,
        cross_entropy_loss_fusion=False,
        attention_softmax_in_fp32=True,
        transformer_impl="transformer_engine" if te_available() else "local",
        deallocate_pipeline_outputs=False,
    )


def assign_sites(chunks: list, cfg) -> None:
    """Label quantized linears, AQN norms and routers with global layer/expert indices."""
    ep_rank = ps.get_expert_model_parallel_rank()
    for chunk in chunks:
        decoder = chunk.decoder
        for layer in decoder.layers:
            idx = layer.layer_number - 1  # Megatron's layer_number is global and 1-based
            layer.input_layernorm.aqn_layer = idx
            layer.input_layernorm.aqn_role = "input_layernorm"
            layer.pre_mlp_layernorm.aqn_layer = idx
            layer.pre_mlp_layernorm.aqn_role = "pre_mlp_layernorm"
            attn = layer.self_attention
            _label(attn.linear_qkv, idx, "qkv")
            _label(attn.linear_proj, idx, "proj")
            mlp = layer.mlp
            router = getattr(mlp, "router", None)
            if isinstance(router, R3TopKRouter):
                router.layer_index = idx
            experts = getattr(mlp, "experts", None)
            if experts is not None:
                n_local = experts.num_local_experts
                for j, expert in enumerate(experts.local_experts):
                    e = ep_rank * n_local + j
                    _label(expert.linear_fc1, idx, "fc1", e)
                    _label(expert.linear_fc2, idx, "fc2", e)
                shared = getattr(mlp, "shared_experts", None)
                if shared is not None:
                    _label(shared.linear_fc1, idx, "shared_fc1")
                    _label(shared.linear_fc2, idx, "shared_fc2")
            else:
                _label(mlp.linear_fc1, idx, "fc1")
                _label(mlp.linear_fc2, idx, "fc2")


def _label(linear, layer: int, role: str, expert: Optional[int] = None) -> None:
    if isinstance(linear, _FP4LinearMixin):
        linear.site.name = site_name(layer, role, expert)
        linear.site.layer, linear.site.role, linear.site.expert = layer, role, expert


def build_model(cfg, config: Optional[TransformerConfig] = None) -> list:
    """Model chunks for this pipeline stage (a list with one GPTModel), on this rank's device."""
    cpu_shim.install()
    if not ps.model_parallel_is_initialized():
        raise RuntimeError("Megatron process groups are not initialised: call "
                           "megatron_qrl.platform.init_distributed(cfg) first")
    config = config or transformer_config(cfg)
    layer_spec = qwen3_moe_layer_spec(cfg)
    n_local = get_num_layers_to_build(config)
    block = TransformerBlockSubmodules(layer_specs=[layer_spec] * n_local, layer_norm=RMSNorm)
    model = GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=cfg.model.vocab_size,
        max_sequence_length=cfg.model.max_sequence_length,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=not cfg.model.untie_embeddings_and_output_weights,
        position_embedding_type="rope",
        rotary_base=cfg.model.rotary_base,
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    chunks = [model]
    assign_sites(chunks, cfg)
    if cfg.lora.enabled:  # adapters initialised per site, everything else frozen (models/lora.py)
        from .lora import prepare_lora_model

        prepare_lora_model(chunks, cfg)
    return chunks
