"""Seeded random weights for an embedded engine without a trainer (benchmarks, launch counts, tests).

A GPU FP4 engine keeps no dense copy of the weights its kernels read (EmbeddedEngine._free_dense_copies), so
it cannot sync from its own model. `sync_seeded` gives every FP4-linear weight (qkv, proj, routed and shared
experts) normal(0, std) values generated on the engine's device from (seed, name) -- engines of different
schemes built from the same seed run the same linears -- and keeps the engine model's own seeded init for the
rest (embeddings, norms, routers, LM head). Packed-only weights are generated and packed one tensor at a time:
peak memory is one float32 tensor beside the FP4 payloads (48 layers of the Qwen3-30B-A3B shape fit an 80 GB
GPU), the sync itself is the engine's normal one (codec payloads + digests through update_weights).
"""
from __future__ import annotations

import zlib

import torch


def linear_weight_names(model: torch.nn.Module) -> set[str]:
    """Parameter names of every FP4 linear's weight (the sites QAT and the engines may quantize)."""
    from megatron_qrl.models import fp4_linears

    names = {id(m): n for n, m in model.named_modules()}
    return {f"{names[id(lin)]}.weight" for lin in fp4_linears(model)}


def seeded_value(name: str, shape, dtype: torch.dtype, device: torch.device, seed: int, std: float) -> torch.Tensor:
    """normal(0, std) from a generator seeded by (seed, name): the same tensor in every engine and process."""
    # 32 bits: the CPU generator (mt19937) ignores the high half of a 64-bit seed
    g = torch.Generator(device=device).manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
    return torch.randn(tuple(shape), generator=g, device=device, dtype=torch.float32).mul_(std).to(dtype)


def sync_seeded(engine, seed: int = 0, std: float = 0.02, version: int = 0) -> dict[str, str]:
    """Install seeded random linear weights into `engine` through its weight sync; returns the digests."""
    from megatron_qrl.quant.wire import pack_state, pack_weight

    store, model = engine.store, engine.model
    generated = linear_weight_names(model)
    prepacked = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name not in generated:
                continue
            value = seeded_value(name, store.shapes[name], p.dtype, p.device, seed, std)
            if name in store.packed_only:
                prepacked[name] = pack_weight(value, engine.format)
            else:
                p.copy_(value)
    weights, hashes = pack_state(list(model.named_parameters()), engine.format,
                                 lambda n: n in store.quantized, prepacked)
    engine.update_weights(weights, version, hashes)
    return hashes


__all__ = ["linear_weight_names", "seeded_value", "sync_seeded"]
