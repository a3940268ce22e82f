"""Trainer -> engine sync in QeRL mode (lora.enabled): the frozen base once, then only adapters (+ norms).

First sync: every engine LoRA linear is pointed at the trainer's packed base buffers (the same tensors when
trainer and engine share a device -- colocated placement holds ONE copy of the base -- a copy otherwise),
their digests are recorded, and every parameter (adapters, embeddings, LM head, router, norms, bf16-base
linears) goes through the engine's digest-checked `update_weights` once, so the engine refuses nothing
partial. Every later sync sends only the parameters that train (lora_A / lora_B, and the RMSNorm weights
with lora.train_norms) with a digest each; `sync/base_ok` checks that no base tensor was replaced or written
since the first sync (its storage and version counter), tests/test_lora.py checks the bytes by hash.
The engine applies adapters as a separate low-rank path (docs/lora.md says why not merged). AQN noise is
drawn exactly as in the FP4 syncs (engine norm = trainer norm + fresh Z; the trainer too with apply_to=both).
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from megatron_qrl.models.lora import BASE_BUFFERS, lora_linears
from megatron_qrl.rollout.protocol import WeightUpdateError
from megatron_qrl.quant import payload_digest, payload_nbytes, tensor_digest

from .base import aqn_config, aqn_seed, holds_digests, set_trainer_aqn


def named_lora_linears(chunks: list) -> dict:
    out = {}
    for chunk in chunks:
        names = {id(m): n for n, m in chunk.named_modules()}
        out.update({names[id(lin)]: lin for lin in lora_linears(chunk)})
    return out


def base_digests(chunks: list) -> dict[str, str]:
    """sha256 of every packed base tensor ('<linear>.base_packed', ...): the frozen-base fingerprint."""
    return {f"{name}.{key}": tensor_digest(t) for name, lin in named_lora_linears(chunks).items()
            for key, t in lin.base_tensors().items() if key in BASE_BUFFERS}


def link_base(engine, chunks: list) -> dict[str, str]:
    """Give the engine's LoRA linears the trainer's packed base (shared storage on the same device)."""
    src, dst = named_lora_linears(chunks), named_lora_linears([engine.model])
    if set(src) != set(dst):
        raise WeightUpdateError(f"trainer and engine LoRA linears differ ({len(src)} vs {len(dst)}); build both "
                                "from the same config")
    digests, state = {}, []
    for name, s in src.items():
        d = dst[name]
        if (s.base_format, s.lora_rank) != (d.base_format, d.lora_rank):
            raise WeightUpdateError(f"'{name}': trainer base {s.base_format}/rank {s.lora_rank}, engine "
                                    f"{d.base_format}/rank {d.lora_rank}")
        for key, t in s.base_tensors().items():
            if key not in BASE_BUFFERS:
                continue  # a bf16 base is a (frozen) parameter: it travels with the first update_weights
            device = getattr(d, key).device
            shared = t if t.device == device else t.to(device)
            digest = tensor_digest(t)
            if shared is not t and tensor_digest(shared) != digest:
                raise WeightUpdateError(f"'{name}.{key}': base bytes changed in transfer")
            setattr(d, key, shared)
            d._base_cache = None
            digests[f"{name}.{key}"] = digest
            state.append((shared, shared.data_ptr(), shared._version))
    engine.lora_base_digests = digests
    engine.lora_base_state = state
    return digests


def base_unchanged(engine) -> bool:
    """Cheap per-sync audit: no base tensor was swapped or written in place since it was linked."""
    return all(t.data_ptr() == ptr and t._version == v for t, ptr, v in engine.lora_base_state)


class LoRASync:
    """WeightSync in QeRL mode: adapters (+ norms) with digests, the base linked once; then this step's AQN draw."""

    def __init__(self, cfg, trainer, engine: Callable[[], object]):
        self.cfg, self.trainer, self.engine = cfg, trainer, engine

    def push(self, step: int, *, version: Optional[int] = None, aqn: bool = True) -> dict:
        cfg, engine = aqn_config(self.cfg, aqn), self.engine()
        if not hasattr(engine, "model") or not hasattr(engine, "store"):
            raise ValueError("lora.enabled syncs into an in-process embedded engine (rollout.engine=embedded, "
                             "rollout.placement=colocated)")
        t0 = time.perf_counter()
        chunks = list(self.trainer.unwrapped)
        first = getattr(engine, "lora_base_digests", None) is None   # a fresh (or restarted) engine
        if first:
            link_base(engine, chunks)
        named = [(n, p) for c in chunks for n, p in c.named_parameters() if first or p.requires_grad]
        weights = {n: p.detach() for n, p in named}
        hashes = {n: payload_digest(w) for n, w in weights.items()}
        engine.update_weights(weights, step if version is None else version, hashes)
        hash_ok = holds_digests(engine.store.digests, hashes)
        sigma = set_trainer_aqn(self.trainer, cfg, step)
        engine.set_aqn_noise(sigma, aqn_seed(cfg.run.seed, step))
        base_bytes = sum(t.numel() * t.element_size() for t, _, _ in engine.lora_base_state)
        return {"sync/s": time.perf_counter() - t0, "sync/hash_ok": hash_ok, "sync/tensors": float(len(hashes)),
                "sync/bytes": float(sum(payload_nbytes(w) for w in weights.values())),
                "sync/base_bytes": float(base_bytes), "sync/base_ok": float(base_unchanged(engine)),
                "aqn/sigma": sigma}

    def repush(self, step: int) -> dict:
        return self.push(step)   # a restarted engine gets the base linked again, then every parameter
