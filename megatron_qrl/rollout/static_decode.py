"""One decode step of the engine's Megatron model with static shapes: the body of the CUDA-graph decode.

`DecodeModel.forward(tokens, positions, slots, active)` runs one new token per row through the same
weights, norms, router and codec as the eager engine (rollout/model_runner.py), built as plain tensor code
so that a CUDA graph can capture it: no Megatron token dispatcher, no host synchronisation, no shape that
depends on data. What it reuses and what it replaces (DESIGN.md "GPU execution"):
- reused: the model's parameter tensors (no copies; in-place weight updates reach captured graphs), its
  RMSNorm modules (AQN noise included), Megatron's RoPE function and top-k routing function, the KV cache;
- replaced: core attention (a decode kernel over the cache: kernels/cache_attention.py for a dequantized
  cache, kernels/kv_decode_attention.py straight from a packed fp4 / fp8 one; or the eager engine's own
  `attend` over `cache.read` on the reference path), the MoE dispatcher and experts (decode_experts.py), the
  FP4 attention linears of quant.targets=all_linears (decode_linears.py: W4A4 input quantization over the
  active rows, TRACE capture as tensors, the W4A16 kernel or a matmul over the dequantized weight);
- fused on the kernel path (kernels/decode_fused.py, same numerics as the torch code it replaces): each
  residual add with the RMSNorm after it, the embedding gather with the first norm, and QK-norm + RoPE +
  the K/V cache write in one launch (bf16 cache; a packed cache takes the roped K and raw V through a
  per-step staging buffer, then one quantize-write launch, kernels/kv_quant_write.py). The norms' weights
  and AQN noise are read from the modules at every call, so in-place updates and fresh AQN draws reach
  captured graphs.
The eager engine's Megatron forward stays the reference; tests/test_rollout_static.py checks tokens,
log-probs, routed experts and TRACE captures against it.

Rows whose `active` is False (finished sequences, bucket padding) still run but write their K/V to the
cache's scratch slot and never influence active rows (decode_experts.py, decode_linears.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from .attention import StepBatch, attend, softmax_scale_of
from .kv_cache import KVCache


@dataclass
class StepRecords:
    """What one decode step records besides logits: R3 ids and the TRACE captures of the cached layers."""

    routed: Optional[torch.Tensor] = None                          # int16 [B, num_moe_layers, k]
    trace: dict[int, dict[str, dict[str, torch.Tensor]]] = field(default_factory=dict)


def unsupported_reason(model, cfg) -> Optional[str]:
    """Why the static decode step cannot run this engine model (None: it can)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_qrl.models.lora import is_lora_linear
    from megatron_qrl.models import fp4_linears

    if cfg.lora.enabled or any(is_lora_linear(lin) for lin in fp4_linears(model)):
        return "LoRA adapters (QeRL mode)"
    mc = model.config
    if getattr(mc, "apply_rope_fusion", False):
        return "fused RoPE"
    fp4_dense = cfg.quant.targets == "all_linears" and cfg.rollout.weights != "bf16"
    for layer in model.decoder.layers:
        att = layer.self_attention
        if att.linear_qkv.bias is not None or att.linear_proj.bias is not None:
            return "biased attention linears"
        mlp = layer.mlp
        if fp4_dense and not isinstance(mlp, MoELayer):
            return "FP4 dense MLP layers (quant.targets=all_linears on a model without routed experts)"
        if isinstance(mlp, MoELayer):
            if mlp.shared_experts is not None:
                return "shared experts"
            if mlp.router.score_function != "softmax" or mc.moe_router_num_groups:
                return "router other than top-k softmax"
            if mc.moe_expert_capacity_factor is not None or mc.moe_router_force_load_balancing:
                return "expert capacity / forced load balancing"
    return None


class DecodeModel:
    """Static-shape decode step over a (TP=1, single-stage) GPTModel and the engine's KV cache."""

    def __init__(self, model, cache: KVCache, experts: dict[int, object], *, kernel_attention: bool,
                 linears: Optional[dict] = None):
        from megatron.core.transformer.moe.moe_layer import MoELayer

        if cache.scratch_slot is None:
            raise ValueError("the static decode step needs a KV cache with a scratch slot (KVCache(scratch=True))")
        self.model, self.cache, self.experts = model, cache, experts
        self.linears = linears or {}             # FP4 attention linear -> its runner (decode_linears.py)
        self._active, self._records = None, None   # of the step being run (set by forward)
        self.kernel_attention = kernel_attention
        mc = model.config
        self.config = mc
        self.layers = list(model.decoder.layers)
        self.final_norm = model.decoder.final_layernorm
        self.heads = mc.num_attention_heads
        self.groups = mc.num_query_groups
        self.head_dim = mc.kv_channels or mc.hidden_size // mc.num_attention_heads
        self.scales = [softmax_scale_of(layer.self_attention.core_attention, self.head_dim) for layer in self.layers]
        self.rope = model.rotary_pos_emb(cache.max_len)                    # [max_len, 1, 1, rot_dim] float32
        self.moe = [isinstance(layer.mlp, MoELayer) for layer in self.layers]
        self.fused_norms, self.fused_qkv = self._fusable() if kernel_attention else (False, False)
        if self.fused_norms or self.fused_qkv:
            from megatron_qrl.kernels import decode_fused

            self._fused = decode_fused
        if self.fused_qkv:                          # cos/sin once, in the model dtype (as RoPE casts them)
            self.cos, self.sin = decode_fused.rope_tables(self.rope, model.embedding.word_embeddings.weight.dtype)

    def _fusable(self) -> tuple[bool, bool]:
        """(norms, QK-norm + RoPE + cache write): which parts the fused kernels can take over."""
        from megatron_qrl.models.aqn_norm import RMSNorm

        norms = [self.final_norm] + [n for lay in self.layers for n in (lay.input_layernorm, lay.pre_mlp_layernorm)]
        fused_norms = all(isinstance(n, RMSNorm) for n in norms)
        qk = [(lay.self_attention.q_layernorm, lay.self_attention.k_layernorm) for lay in self.layers]
        qk_ok = all((q is None and k is None) or (isinstance(q, RMSNorm) and isinstance(k, RMSNorm) and q.eps == k.eps)
                    for q, k in qk)
        writable = self.cache.kv_format == "bf16" or self.cache.packed      # dequantized fp8/fp4: torch writes
        fused_qkv = (qk_ok and writable and not self.config.rotary_interleaved
                     and not getattr(self.config, "multi_latent_attention", False))
        return fused_norms, fused_qkv

    def output_weight(self) -> torch.Tensor:
        m = self.model
        return m.shared_embedding_or_output_weight() if m.share_embeddings_and_output_weights else m.output_layer.weight

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, active: torch.Tensor
                ) -> tuple[torch.Tensor, StepRecords]:
        """tokens / positions / slots long [B], active bool [B] -> (logits [B, V] in the model dtype, records).
        The logits stay in the model dtype: the sampling kernels and the torch sampling both read them in
        float32 (an exact conversion), so no [B, V] float32 copy is made (55 us per step at B = 256 on an H200)."""
        records = StepRecords()
        self._active, self._records = active, records
        routed = []
        emb = self.model.embedding.word_embeddings.weight
        if self.fused_norms:
            first = self.layers[0].input_layernorm
            x, h = self._fused.embed_rmsnorm(tokens, emb, first.weight, first.aqn_noise, first.eps)
        else:
            h = F.embedding(tokens, emb)                                            # [B, hidden]
        freqs = None if self.fused_qkv else self.rope[positions]                   # [B, 1, 1, rot_dim]
        lens = positions + 1
        delta = None                                # the last block's output, added to h by the next norm
        for i, layer in enumerate(self.layers):
            att = layer.self_attention
            if i > 0 or not self.fused_norms:
                x, h = self._add_norm(layer.input_layernorm, h, delta)
            q = self._attention_input(i, att, x, positions, slots, freqs)
            o = self._attend(i, q, slots, lens, positions)
            x, h = self._add_norm(layer.pre_mlp_layernorm, h, self._linear(att.linear_proj, o))
            if self.moe[i]:
                delta, ids, cap = self._moe(i, layer.mlp, x, active)
                routed.append(ids.to(torch.int16))
                if cap is not None:
                    records.trace.setdefault(layer.layer_number - 1, {}).update(cap)
            else:
                delta, _ = layer.mlp(x)
        x, _ = self._add_norm(self.final_norm, h, delta)
        logits = F.linear(x, self.output_weight())
        if routed:
            records.routed = torch.stack(routed, dim=1)
        self._active = self._records = None
        return logits, records

    def _linear(self, lin, x: torch.Tensor) -> torch.Tensor:
        """A dense linear of the step: its FP4 runner (capture into the step's records), else x @ W^T."""
        run = self.linears.get(lin)
        if run is None:
            return F.linear(x, lin.weight)
        y, cap = run(x, self._active)
        if cap is not None:
            self._records.trace.setdefault(run.site.layer, {})[run.site.role] = cap
        return y

    def _add_norm(self, norm, h: torch.Tensor, delta: Optional[torch.Tensor]):
        """(norm(h + delta), h + delta), or (norm(h), h) without delta: the residual add and the norm after it.
        A delta [B, k, H] holds an MoE layer's slot outputs: their fp32 sum in slot order is the delta."""
        if self.fused_norms:
            if delta is None:
                return self._fused.add_rmsnorm(h, norm.weight, norm.aqn_noise, norm.eps)
            return self._fused.add_rmsnorm(delta, norm.weight, norm.aqn_noise, norm.eps, residual=h,
                                           slots=delta.dim() == 3)
        if delta is not None and delta.dim() == 3:
            from megatron_qrl.kernels.decode_fused import sum_slots   # grouped experts run on the kernel path

            delta = sum_slots(delta)
        if delta is not None:
            h = h + delta
        return norm(h), h

    def _attention_input(self, i: int, att, x: torch.Tensor, positions, slots, freqs) -> torch.Tensor:
        """QKV linear, QK-norm, RoPE and the K/V cache write of layer i; returns q [B, heads, head_dim]."""
        from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

        if self.fused_qkv:
            mixed = self._linear(att.linear_qkv, x)
            qn, kn = att.q_layernorm, att.k_layernorm
            norm = qn is not None
            k_dst, v_dst, rows = self._kv_destination(i, slots, mixed.dtype)
            q = self._fused.qk_norm_rope_cache(
                mixed, qn.weight if norm else None, kn.weight if norm else None, qn.eps if norm else 0.0, self.cos,
                self.sin, positions, rows, k_dst, v_dst, self.heads, self.groups,
                self.head_dim, q_noise=qn.aqn_noise if norm else None, k_noise=kn.aqn_noise if norm else None)
            if self.cache.packed:
                self._write_cache(i, slots, positions, k_dst[:, 0], v_dst[:, 0])
            return q
        q, k, v = self._qkv(att, x)
        q = apply_rotary_pos_emb(q.unsqueeze(1), freqs, config=self.config).squeeze(1)
        k = apply_rotary_pos_emb(k.unsqueeze(1), freqs, config=self.config).squeeze(1)
        self._write_cache(i, slots, positions, k, v)
        return q

    def _qkv(self, att, x: torch.Tensor):
        """Megatron's fused QKV layout: per query group [heads/groups queries, one key, one value]."""
        B, hpg, D = x.shape[0], self.heads // self.groups, self.head_dim
        mixed = self._linear(att.linear_qkv, x).view(B, self.groups, (hpg + 2) * D)
        q = mixed[..., :hpg * D].reshape(B, self.heads, D)
        k = mixed[..., hpg * D:(hpg + 1) * D]
        v = mixed[..., (hpg + 1) * D:]
        if att.q_layernorm is not None:
            q = att.q_layernorm(q)
        if att.k_layernorm is not None:
            k = att.k_layernorm(k)
        return q, k, v

    def _kv_destination(self, layer: int, slots, dtype):
        """Where the fused QK-norm/RoPE kernel writes K and V, and its slot ids: the cache itself (dequantized
        storage) or, for a packed cache, a staging buffer [B, 1, G, D] expanded over max_len with a zero
        position stride (row b lands at [b, 0]) that _write_cache then quantizes into the cache."""
        c = self.cache
        if not c.packed:
            return c.keys[layer], c.values[layer], slots
        B = slots.shape[0]
        shape = (B, c.max_len, self.groups, self.head_dim)
        k = torch.empty((B, 1) + shape[2:], dtype=dtype, device=slots.device)
        rows = torch.arange(B, device=slots.device)
        return k.expand(shape), torch.empty_like(k).expand(shape), rows

    def _write_cache(self, layer: int, slots, positions, k, v) -> None:
        c = self.cache
        if c.packed and self.kernel_attention:       # one quantize-write launch for K and V
            from megatron_qrl.kernels.kv_quant_write import quantize_write

            quantize_write(k, v, slots, positions, c.keys[layer], c.values[layer])
        else:
            c.write(layer, slots, positions, k, v, check=False)

    def _attend(self, layer: int, q, slots, lens, positions) -> torch.Tensor:
        B = q.shape[0]
        c = self.cache
        if self.kernel_attention and c.packed:
            from megatron_qrl.kernels.kv_decode_attention import packed_decode_attention

            return packed_decode_attention(q, c.keys[layer], c.values[layer], slots, lens,
                                           self.scales[layer]).reshape(B, -1)
        if self.kernel_attention:
            from megatron_qrl.kernels.cache_attention import cache_decode_attention

            return cache_decode_attention(q, c.keys[layer], c.values[layer], slots, lens,
                                          self.scales[layer]).reshape(B, -1)
        # reference: the eager engine's attention over the rows' cached prefixes
        ar = torch.arange(B, device=q.device)
        batch = StepBatch(token_ids=ar, positions=positions, token_row=ar, token_col=torch.zeros_like(ar),
                          slots=slots, kv_lens=lens, last_index=ar, row_starts=list(range(B)), row_lens=[1] * B)
        keys, values = c.read(layer, slots, int(lens.max()))
        return attend(q, keys, values, batch, self.scales[layer])

    def _moe(self, i: int, mlp, x: torch.Tensor, active: torch.Tensor):
        from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

        r, mc = mlp.router, self.config
        logits = r.gating(x)
        experts = self.experts[i]
        if hasattr(experts, "route"):
            # kernel experts: top-k, probabilities and their expert alignment in one or two launches
            # (slots in descending score order; Megatron's top-k order is unspecified, the set is the same)
            probs, ids, routing = experts.route(logits, r.topk, pre_softmax=mc.moe_router_pre_softmax,
                                                scaling_factor=mc.moe_router_topk_scaling_factor)
            y, cap = experts(x, ids, probs, active, routing=routing)
            return y, ids, cap
        probs, ids = topk_routing_with_score_function(
            logits, r.topk, use_pre_softmax=mc.moe_router_pre_softmax, num_groups=mc.moe_router_num_groups,
            group_topk=mc.moe_router_group_topk, scaling_factor=mc.moe_router_topk_scaling_factor,
            score_function=r.score_function, expert_bias=r.expert_bias, fused=mc.moe_router_fusion,
            dense_output=True)
        y, cap = experts(x, ids, probs, active)
        return y, ids, cap
