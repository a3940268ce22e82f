"""Trainer -> engine weight sync: the codec's FP4 bytes with a digest per tensor, then a fresh AQN draw.

The engine refuses an update whose bytes do not hash to the sent digests (nothing changes then); after a
successful install we audit that the engine holds exactly the digests we sent (sync/hash_ok). AQN noise
(METHODS.md section 5) is drawn after each sync: the engine's norm weight = trainer weight + fresh Z, never
accumulating; with aqn.apply_to=both the trainer's norms get the same draw (same seed).
"""
from __future__ import annotations

import time

import torch

from megatron_qrl.models import clear_aqn_noise, set_aqn_noise
from megatron_qrl.rl import aqn_sigma


def unwrap(trainer_model: list) -> list[torch.nn.Module]:
    """Megatron DDP wrappers -> the GPTModel chunks (parameter names as the engine's model has them)."""
    return [getattr(c, "module", c) for c in trainer_model]


def check_rl_layout(cfg) -> None:
    if cfg.lora.enabled and cfg.rollout.placement == "disaggregated":
        raise ValueError("lora.enabled with rollout.placement=disaggregated is not implemented (the adapters-only "
                         "sync runs in-process): use rollout.placement=colocated for QeRL mode")
    t = cfg.trainer
    if t.tensor_parallel * t.pipeline_parallel * t.expert_parallel != 1:
        raise ValueError(
            "the embedded engine holds an unsharded model and syncs from the trainer's local replica: with "
            f"trainer.tensor_parallel={t.tensor_parallel}, pipeline_parallel={t.pipeline_parallel}, "
            f"expert_parallel={t.expert_parallel} that replica is a shard. Use data parallelism only "
            "(tensor/pipeline/expert_parallel=1) for RL runs with the embedded engine; sharded trainers need "
            "a gathering sync (not implemented yet, docs/rollout.md)")


def aqn_seed(run_seed: int, step: int) -> int:
    return (run_seed * 1_000_003 + step) % (2 ** 31)


def set_trainer_aqn(trainer, cfg, step: int) -> float:
    """The trainer's side of AQN for `step`: the engine's draw too (apply_to=both) or none; returns sigma."""
    sigma = aqn_sigma(step, cfg.run.total_steps, cfg.aqn) if cfg.aqn.enabled else 0.0
    if cfg.aqn.enabled and cfg.aqn.apply_to == "both":
        set_aqn_noise(unwrap(trainer.model), sigma, generator=torch.Generator().manual_seed(aqn_seed(cfg.run.seed, step)))
    else:
        clear_aqn_noise(unwrap(trainer.model))
    return sigma


def quantized_weight_names(chunks: list[torch.nn.Module], cfg) -> set[str]:
    """Parameter names the engine holds in FP4 (EmbeddedEngine._configure_linears' rule, from the trainer's side)."""
    from megatron_qrl.models import fp4_linears
    from megatron_qrl.rollout.embedded import rollout_quantized
    from megatron_qrl.rollout.weights import FP4_FORMATS

    if cfg.rollout.weights not in FP4_FORMATS:
        return set()
    out = set()
    for chunk in chunks:
        names = {id(m): n for n, m in chunk.named_modules()}
        out |= {f"{names[id(lin)]}.weight" for lin in fp4_linears(chunk) if rollout_quantized(lin.site, cfg.quant.targets)}
    return out


def trainer_payload(trainer, cfg):
    """(weights, digests) for an engine elsewhere: the codec's FP4 bytes of the quantized linears, the rest as is."""
    from megatron_qrl.rollout.weights import pack_state

    chunks = unwrap(trainer.model)
    quantized = quantized_weight_names(chunks, cfg)
    named = [(n, p) for c in chunks for n, p in c.named_parameters()]
    return pack_state(named, cfg.rollout.weights, lambda n: n in quantized)


def sync_weights(engine, trainer, cfg, step: int, version: int) -> dict:
    """Install the trainer's weights in the engine and draw this step's AQN noise; returns metrics."""
    if cfg.lora.enabled:  # QeRL mode: base linked once, adapters (+ norms) per step
        from .lora_sync import sync_lora

        return sync_lora(engine, trainer, cfg, step, version)
    t0 = time.perf_counter()
    hashes = engine.sync_from_model(unwrap(trainer.model), version)
    held = getattr(getattr(engine, "store", None), "digests", None)
    hash_ok = float(held is not None and all(held.get(n) == h for n, h in hashes.items()))
    sigma = set_trainer_aqn(trainer, cfg, step)
    engine.set_aqn_noise(sigma, aqn_seed(cfg.run.seed, step))
    store = getattr(engine, "store", None)
    return {"sync/s": time.perf_counter() - t0, "sync/hash_ok": hash_ok, "sync/tensors": float(len(hashes)),
            "sync/bytes": float(store.nbytes()) if store is not None else float("nan"), "aqn/sigma": sigma}
