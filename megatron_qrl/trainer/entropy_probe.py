"""The policy's per-token entropy during the trainer's update pass, taken from the output layer's logits by a
forward hook: the labels path of GPTModel returns only the chosen tokens' NLL, so the full distribution is
visible only there. Off (a no-op) unless the trainer arms it around a training pass; detached, no gradient."""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core import parallel_state as ps

from megatron_qrl.rl.entropy import token_aligned, vocab_parallel_entropy


class EntropyProbe:
    """`take()` after a forward: the entropy [b, s] aligned with the tokens like the log-probs (column t is the
    distribution token t was drawn from; column 0 is 0), or None (not armed, or not the last pipeline stage)."""

    def __init__(self, chunks: list):
        self.armed = False
        self._last: Optional[torch.Tensor] = None
        model = chunks[-1] if chunks else None
        while model is not None and not hasattr(model, "output_layer"):   # Float16Module / DDP wrappers
            model = getattr(model, "module", None)
        layer = getattr(model, "output_layer", None)
        if layer is not None:
            layer.register_forward_hook(self._hook)

    def _hook(self, _module, _inputs, output) -> None:
        if not self.armed:
            return
        logits = output[0] if isinstance(output, tuple) else output      # [s, b, V / TP]
        with torch.no_grad():
            h = vocab_parallel_entropy(logits.detach(), ps.get_tensor_model_parallel_group())
        self._last = token_aligned(h.transpose(0, 1))

    def take(self) -> Optional[torch.Tensor]:
        out, self._last = self._last, None
        return out
