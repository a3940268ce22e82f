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
  captured graphs. The pre-MLP norm of an MoE layer also writes the router's input in the router dtype and
  the grouped expert kernels' fp16 operand, so neither needs a conversion launch.
- per-layer launches that only move data are gone (a graph step is bound by the gaps between launches,
  not by bytes; tools/count_decode_launches.py lists them): the routing kernel writes each layer's R3 ids
  into the step's int16 record, and the router GEMM reads a weight kept in the router dtype (Megatron's
  gating casts the whole weight at every call), refreshed in place at every generate call.
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
    from megatron_qrl.quant.formats import FP4_FORMATS

    if any(lin.site.expert is not None and lin.base_format not in FP4_FORMATS
           for lin in fp4_linears(model) if is_lora_linear(lin)):
        return "LoRA routed experts over a bf16 base (lora.base_format=bf16)"
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
        self._active, self._records, self._rows = None, None, None   # of the step being run (set by forward)
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
        self.moe_index = {i: j for j, i in enumerate(i for i, m in enumerate(self.moe) if m)}   # layer -> R3 column
        self.dtype = model.embedding.word_embeddings.weight.dtype
        self.router_weights = {i: self._router_weight(self.layers[i].mlp.router) for i in self.moe_index}
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

    def _router_dtype(self) -> torch.dtype:
        """The dtype of Megatron's router GEMM (Router.gating): moe_router_dtype, else the input's."""
        return {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, self.dtype)

    def _router_weight(self, router) -> Optional[torch.Tensor]:
        """The router weight in the router dtype, for the step to compute the logits itself (None: it calls
        router.gating). Without Transformer Engine, Megatron's gating (router_gating_linear) casts the input
        and the whole weight to the router dtype at every call and then runs one mm: two cast launches and
        E*H*4 bytes per layer and step under moe_router_dtype=fp32. The step casts the weight once (a copy,
        refreshed by `refresh_weights` at every generate call; the parameter itself when no cast is needed)
        and runs the same mm on the same values, so the logits are the same bits."""
        from megatron.core.transformer.moe import moe_utils
        from megatron.core.transformer.moe.router import Router

        dtype = self._router_dtype()
        if (type(router).gating is not Router.gating or router.bias is not None
                or (moe_utils.te_general_gemm is not None and dtype != torch.float64)):
            return None
        w = router.weight
        return w if w.dtype == dtype else w.detach().to(dtype)

    def refresh_weights(self) -> None:
        """Copy the router weights into the step's cast copies, in place (captured graphs read them): weight
        updates write the parameters in place, so this runs before every generate call."""
        for i, w in self.router_weights.items():
            param = self.layers[i].mlp.router.weight
            if w is not None and w is not param:
                w.copy_(param.detach())

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
        B = tokens.shape[0]
        # the R3 record [B, num_moe_layers, k]: each MoE layer's routing writes its column (no cast, no stack)
        routed = (torch.empty((B, len(self.moe_index), self.config.moe_router_topk), dtype=torch.int16,
                              device=tokens.device) if self.moe_index else None)
        # packed cache: the staging rows of the fused QK-norm/RoPE write (_kv_destination), one arange per step
        self._rows = torch.arange(B, device=tokens.device) if self.fused_qkv and self.cache.packed else None
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
            extra = self._moe_inputs(i, h)
            x, h = self._add_norm(layer.pre_mlp_layernorm, h, self._linear(att.linear_proj, o), *extra)
            if self.moe[i]:
                delta, cap = self._moe(i, layer.mlp, x, active, routed[:, self.moe_index[i]], *extra)
                if cap is not None:
                    records.trace.setdefault(layer.layer_number - 1, {}).update(cap)
            else:
                delta, _ = layer.mlp(x)
        x, _ = self._add_norm(self.final_norm, h, delta)
        logits = F.linear(x, self.output_weight())
        records.routed = routed
        self._active = self._records = self._rows = None
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

    def _add_norm(self, norm, h: torch.Tensor, delta: Optional[torch.Tensor], wide: Optional[torch.Tensor] = None,
                  f16_operand: Optional[torch.Tensor] = None):
        """(norm(h + delta), h + delta), or (norm(h), h) without delta: the residual add and the norm after it.
        A delta [B, k, H] holds an MoE layer's slot outputs: their fp32 sum in slot order is the delta.
        wide / f16_operand (fused norms only, from _moe_inputs): the same launch also writes the normed rows
        there (the router's input, the expert kernels' fp16 operand)."""
        if self.fused_norms:
            if delta is None:
                return self._fused.add_rmsnorm(h, norm.weight, norm.aqn_noise, norm.eps, wide=wide,
                                               f16_operand=f16_operand)
            return self._fused.add_rmsnorm(delta, norm.weight, norm.aqn_noise, norm.eps, residual=h,
                                           slots=delta.dim() == 3, wide=wide, f16_operand=f16_operand)
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
        return k.expand(shape), torch.empty_like(k).expand(shape), self._rows

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

    def _moe_inputs(self, i: int, h: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Buffers like h [B, H] that the pre-MLP norm of layer i fills besides its output (fused norms, MoE
        layers): the router's input in the router dtype when that is not the model's, and the grouped expert
        kernels' fp16 operand when they convert their input. Each saves that conversion's launch (same values)."""
        if not (self.fused_norms and self.moe[i]) or h.dtype != torch.bfloat16:
            return None, None             # the norm writes the extra outputs for bfloat16 models only
        w, takes = self.router_weights[i], getattr(self.experts[i], "takes_fp16_operand", None)
        wide = torch.empty(h.shape, dtype=w.dtype, device=h.device) if w is not None and w.dtype != h.dtype else None
        f16 = (torch.empty(h.shape, dtype=torch.float16, device=h.device)
               if takes is not None and takes(h.shape[0] * self.layers[i].mlp.router.topk) else None)
        return wide, f16

    def _router_logits(self, i: int, router, x: torch.Tensor, x_router: Optional[torch.Tensor]) -> torch.Tensor:
        """router.gating(x), bit for bit: with the weight kept in the router dtype (_router_weight) the same mm
        on the same values (x_router: x already in that dtype, written by the norm)."""
        w = self.router_weights[i]
        if w is None:
            return router.gating(x)
        return torch.mm(x_router if x_router is not None else x.to(w.dtype), w.t())

    def _moe(self, i: int, mlp, x: torch.Tensor, active: torch.Tensor, routed: torch.Tensor,
             x_router: Optional[torch.Tensor] = None, x_operand: Optional[torch.Tensor] = None):
        """The MoE block of layer i -> (expert output(s), TRACE capture or None); routed: int16 [B, k], the
        layer's column of the step's R3 record, which gets the router's top-k ids."""
        from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

        r, mc = mlp.router, self.config
        logits = self._router_logits(i, r, x, x_router)
        experts = self.experts[i]
        if hasattr(experts, "route"):
            # kernel experts: top-k, probabilities and their expert alignment in two launches, the second also
            # writing the R3 ids (slots in descending score order; Megatron's top-k order is unspecified, the
            # set is the same)
            probs, ids, routing = experts.route(logits, r.topk, pre_softmax=mc.moe_router_pre_softmax,
                                                scaling_factor=mc.moe_router_topk_scaling_factor, routed=routed)
            return experts(x, ids, probs, active, routing=routing, x_operand=x_operand)
        probs, ids = topk_routing_with_score_function(
            logits, r.topk, use_pre_softmax=mc.moe_router_pre_softmax, num_groups=mc.moe_router_num_groups,
            group_topk=mc.moe_router_group_topk, scaling_factor=mc.moe_router_topk_scaling_factor,
            score_function=r.score_function, expert_bias=r.expert_bias, fused=mc.moe_router_fusion,
            dense_output=True)
        routed.copy_(ids)
        return experts(x, ids, probs, active)
