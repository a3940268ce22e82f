"""RMSNorm with an AQN noise buffer (METHODS.md section 5) that also works under sequence parallelism.

RMSNorm_noise(x) = (w + Z) * x / sqrt(mean(x^2) + eps). Z is a non-persistent buffer (zeros by default),
so the noise never enters the parameter, the optimizer or a checkpoint; `set_aqn_noise` overwrites it
with a fresh draw, `clear_aqn_noise` zeros it. Only the norms in front of quantized linears carry noise:
the attention input norm (shared by Q, K, V) and the pre-MLP norm (shared by router and expert
gate/up); QK-norms and the final norm use the same class with `aqn_site=False`.

Why our own norm: Megatron's torch-norm wrapper refuses sequence parallelism, which Megatron requires
for MoE with TP>1; this norm marks its weight `sequence_parallel` so finalize_model_grads all-reduces
its gradient over the TP group (each rank saw only its sequence shard).

Noise draws are layout-invariant: `set_aqn_noise` draws one [hidden] vector per (global layer, norm) in
global order from the generator, whatever pipeline stage owns the layer, so every rank (and the
rollout engine using the same seed) adds the same Z to the same norm.
"""
from __future__ import annotations

from typing import Optional

import torch

AQN_ROLES = ("input_layernorm", "pre_mlp_layernorm")


class RMSNorm(torch.nn.Module):
    """Megatron LayerNormBuilder-compatible RMSNorm with an additive AQN noise buffer."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.register_buffer("aqn_noise", torch.zeros(hidden_size, dtype=torch.float32), persistent=False)
        self.aqn_site = False       # set by the spec for input_layernorm / pre_mlp_layernorm
        self.aqn_layer = -1         # global layer index, set by assign_sites
        self.aqn_role = ""
        self.sequence_parallel = bool(config.sequence_parallel)
        setattr(self.weight, "sequence_parallel", self.sequence_parallel)

    def effective_weight(self) -> torch.Tensor:
        """w + Z; the engine reads this for its norm weights."""
        return self.weight + self.aqn_noise.to(self.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.effective_weight().float()).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, aqn_site={self.aqn_site}"


def aqn_norms(model) -> list[RMSNorm]:
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [m for c in chunks for m in c.modules() if isinstance(m, RMSNorm) and m.aqn_site]


def set_aqn_noise(model, sigma: float, generator: Optional[torch.Generator] = None,
                  num_layers: Optional[int] = None) -> int:
    """Draw a fresh Z ~ N(0, sigma^2) for every AQN norm (replacing, never accumulating). Returns #norms.

    Draws happen for all `num_layers` x 2 norms in global order (default: the model config's num_layers)
    so pipeline stages consume the generator identically; each rank keeps the draws of its own layers.
    """
    from megatron_qrl.rl.aqn import aqn_noise

    norms = aqn_norms(model)
    if not norms:
        return 0
    if sigma < 0:
        raise ValueError(f"AQN sigma must be >= 0, got {sigma}")
    hidden = norms[0].weight.shape[0]
    if num_layers is None:
        num_layers = 1 + max(n.aqn_layer for n in norms)
        chunks = model if isinstance(model, (list, tuple)) else [model]
        cfg = getattr(chunks[0], "config", None)
        num_layers = max(num_layers, getattr(cfg, "num_layers", 0) or 0)
    by_key = {(n.aqn_layer, n.aqn_role): n for n in norms}
    if any(layer < 0 for layer, _ in by_key):
        raise RuntimeError("AQN norms have no layer index; build the model with megatron_qrl.models.provider")
    for layer in range(num_layers):
        for role in AQN_ROLES:
            z = aqn_noise(hidden, sigma, generator=generator)
            norm = by_key.get((layer, role))
            if norm is not None:
                norm.aqn_noise.copy_(z.to(norm.aqn_noise.device))
    return len(norms)


def clear_aqn_noise(model) -> None:
    """Zero every AQN noise buffer (the noise-free policy)."""
    for n in aqn_norms(model):
        n.aqn_noise.zero_()
