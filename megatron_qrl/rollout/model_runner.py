"""One engine step through the trainer's Megatron GPTModel: embedding -> decoder -> LM head, with a KV cache.

We call GPTModel's own submodules (`embedding`, `decoder` = TransformerBlock with all its layers, norms,
FP4 linears, router and experts, `output_layer`) and replace only two things for the step:
- RoPE: Megatron derives rotary angles from the sequence length (one shared offset in its static
  inference context); we pass the table rows of each token's own position;
- core attention: `CachedAttention` (see attention.py).
Everything else -- including QK-norm, the FP4 activation hooks, R3 routing records and AQN norms -- is the
model code the trainer runs. tests/test_rollout_engine.py checks the result against a full
GPTModel.forward without cache.
"""
from __future__ import annotations

from typing import Optional

import torch

from .attention import CachedAttention, StepBatch, StepState, cached_attention, softmax_scale_of
from .kv_cache import KVCache


class ModelRunner:
    """Runs packed steps of a (single-stage, TP=1) GPTModel against a KVCache; returns next-token logits."""

    def __init__(self, model: torch.nn.Module, cache: KVCache):
        for attr in ("embedding", "decoder", "output_layer", "rotary_pos_emb"):
            if getattr(model, attr, None) is None:
                raise ValueError(f"the rollout engine needs a whole GPTModel with RoPE (model.{attr} is missing); "
                                 "pipeline stages and other position embeddings are not supported")
        cfg = model.config
        unsupported = [n for n in ("multi_latent_attention", "use_mup", "mtp_num_layers", "window_size")
                       if getattr(cfg, n, None)]
        if getattr(cfg, "softmax_type", "vanilla") != "vanilla":
            unsupported.append("softmax_type")
        if unsupported:
            raise NotImplementedError(f"the rollout engine does not support model config {unsupported}")
        self.model, self.cache = model, cache
        self.layers = list(model.decoder.layers)
        self.state = StepState()
        head_dim = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
        self.attention = [CachedAttention(layer.layer_number - 1, cache, self.state,
                                          softmax_scale_of(layer.self_attention.core_attention, head_dim))
                          for layer in self.layers]
        self._rope = None

    def rope_table(self) -> torch.Tensor:
        """RoPE angles [max_len, 1, 1, rot_dim] from the model's own RotaryEmbedding."""
        if self._rope is None:
            self._rope = self.model.rotary_pos_emb(self.cache.max_len)
        return self._rope

    def output_weight(self):
        m = self.model
        return m.shared_embedding_or_output_weight() if m.share_embeddings_and_output_weights else None

    @torch.no_grad()
    def forward(self, batch: StepBatch, logit_index: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits (float32) at the last token of each row [B, V], or at the packed indices `logit_index`."""
        m = self.model
        self.state.batch = batch
        try:
            with cached_attention(self.layers, self.attention):
                hidden = m.embedding(input_ids=batch.token_ids.unsqueeze(0),
                                     position_ids=batch.positions.unsqueeze(0))       # [T, 1, h]
                rope = self.rope_table()[batch.positions]                                # [T, 1, 1, d]
                hidden = m.decoder(hidden_states=hidden, attention_mask=None, rotary_pos_emb=rope)
                last = hidden[batch.last_index if logit_index is None else logit_index]  # [B, 1, h]
                logits, _ = m.output_layer(last, weight=self.output_weight(), runtime_gather_output=True)
        finally:
            self.state.batch = None
        return logits[:, 0].float()
