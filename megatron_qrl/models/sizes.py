"""Analytic parameter counts of a config's model (no Megatron import): total and active per token."""
from __future__ import annotations


def count_parameters(cfg) -> dict:
    """{'total', 'active', 'experts'} of the full (unsharded) model described by cfg.model."""
    m = cfg.model
    h, d = m.hidden_size, m.head_dim
    attn = h * d * (m.num_attention_heads + 2 * m.num_query_groups) + m.num_attention_heads * d * h
    attn += (2 * d if m.qk_layernorm else 0) + 2 * h  # QK-norms, input and pre-MLP norms
    if m.num_experts:
        expert = 3 * h * m.moe_ffn_hidden_size  # SwiGLU: gate, up, down
        shared = 3 * h * m.moe_shared_expert_ffn_hidden_size
        router = m.num_experts * h
        experts = m.num_layers * m.num_experts * expert
        mlp_total = m.num_experts * expert + shared + router
        mlp_active = m.moe_router_topk * expert + shared + router
    else:
        experts = 0
        mlp_total = mlp_active = 3 * h * m.ffn_hidden_size
    emb = m.vocab_size * h * (2 if m.untie_embeddings_and_output_weights else 1) + h  # + final norm
    return {"total": m.num_layers * (attn + mlp_total) + emb, "active": m.num_layers * (attn + mlp_active) + emb,
            "experts": experts}
