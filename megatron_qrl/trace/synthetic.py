"""A toy FP4 engine capture with known codes, for tests and size/transport benchmarks.

It mimics what the engine does per forward iteration: iteration 0 prefills positions 0..P-1 of every
sample, iteration t >= 1 decodes position P-1+t of every sample; per (layer, site, iteration, expert)
the rows routed there are quantized in one `nvfp4_quantize(..., capture=True)` call, so rows from
different iterations carry different global scales, as in the real engine. Captures use the rollout
protocol's layout (rollout.protocol.ActivationCapture: bits [N, k, K/8], global_scale [N, k]).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from megatron_qrl.quant import nvfp4_quantize, unpack_nibbles

from .builder import TraceCacheBuilder
from .cache import BLOCK, TraceCache


@dataclass
class Capture:
    """Duck type of megatron_qrl.rollout.protocol.ActivationCapture."""

    format: str
    bits: torch.Tensor
    scales: torch.Tensor
    global_scale: Optional[torch.Tensor]


@dataclass
class SyntheticRollout:
    num_samples: int
    seq_len: int                       # forwarded positions per sample (N = P + T - 1)
    prompt_len: int
    layers: list[int]
    routed_sites: dict[str, int]       # site -> K, routed experts
    dense_sites: dict[str, int]        # site -> K, dense/attention (expert -1)
    num_experts: int
    topk: int
    routed: torch.Tensor = None        # int64 [S, N, num_layers, k] (R3 ids, indexed by layer)
    x: dict = field(default_factory=dict)      # (layer, site) -> [S, N, k, K] or [S, N, K] fp32
    codes: dict = field(default_factory=dict)  # (layer, site) -> the engine's codes, same shape as x
    captures: list = field(default_factory=list)  # per sample: {layer: {site: Capture}}

    def builder(self, weight_version: int = 0, step: int = 0, fingerprint: str = "synthetic"):
        b = TraceCacheBuilder(weight_version, step, fingerprint)
        for s in range(self.num_samples):
            b.add_sample(s, self.captures[s], routed_experts=self.routed[s])
        return b

    def build(self, weight_version: int = 0, step: int = 0, fingerprint: str = "synthetic") -> TraceCache:
        return self.builder(weight_version, step, fingerprint).build()


def make_rollout(num_samples: int = 8, seq_len: int = 16, prompt_len: int = 6, layers=(2, 3),
                 routed_sites: Optional[dict] = None, dense_sites: Optional[dict] = None,
                 num_experts: int = 8, topk: int = 2, num_layers: Optional[int] = None,
                 seed: int = 0) -> SyntheticRollout:
    """Random activations (varied row scales, some outliers), random top-k routing, engine captures."""
    routed_sites = {"fc1": 64, "fc2": 32} if routed_sites is None else dict(routed_sites)
    dense_sites = {} if dense_sites is None else dict(dense_sites)
    g = torch.Generator().manual_seed(seed)
    S, N, k = num_samples, seq_len, topk
    L = (max(layers) + 1) if num_layers is None else num_layers
    scores = torch.rand(S, N, L, num_experts, generator=g)
    routed = torch.argsort(scores, dim=-1)[..., :k]
    ro = SyntheticRollout(S, N, prompt_len, list(layers), routed_sites, dense_sites, num_experts, k, routed)
    iteration = torch.clamp(torch.arange(N) - prompt_len + 1, min=0)  # 0 = prefill, then one per decode step
    per_sample: list[dict] = [dict() for _ in range(S)]
    for layer in layers:
        for site, K in list(routed_sites.items()) + list(dense_sites.items()):
            is_routed = site in routed_sites
            shape = (S, N, k, K) if is_routed else (S, N, K)
            row_scale = torch.exp(torch.randn(*shape[:-1], 1, generator=g))
            x = torch.randn(*shape, generator=g) * row_scale
            x = x + (torch.rand(*shape, generator=g) < 0.002) * torch.randn(*shape, generator=g) * 20
            rows = x.reshape(-1, K)
            n = rows.shape[0]
            it = iteration.view(1, N, *([1] if is_routed else [])).expand(shape[:-1]).reshape(-1)
            ex = routed[:, :, layer, :].reshape(-1) if is_routed else torch.full((n,), -1)
            codes = torch.zeros(n, K, dtype=torch.uint8)
            bits = torch.zeros(n, K // 8, dtype=torch.uint8)
            scales = torch.zeros(n, K // BLOCK, dtype=torch.uint8)
            gs = torch.zeros(n)
            call = it * (num_experts + 1) + (ex + 1)
            for c in torch.unique(call).tolist():
                sel = torch.nonzero(call == c).reshape(-1)
                packed, sc, gsc, bt = nvfp4_quantize(rows.index_select(0, sel), capture=True)
                codes.index_copy_(0, sel, unpack_nibbles(packed))
                bits.index_copy_(0, sel, bt)
                scales.index_copy_(0, sel, sc.view(torch.uint8))
                gs.index_fill_(0, sel, float(gsc))
            ro.x[(layer, site)] = x
            ro.codes[(layer, site)] = codes.reshape(shape)
            view = (S, N, k) if is_routed else (S, N)
            b3, s3, g3 = bits.reshape(*view, -1), scales.reshape(*view, -1), gs.reshape(view)
            for s in range(S):
                per_sample[s].setdefault(layer, {})[site] = Capture(
                    "nvfp4", b3[s], s3[s].view(torch.float8_e4m3fn), g3[s])
    ro.captures = per_sample
    return ro
