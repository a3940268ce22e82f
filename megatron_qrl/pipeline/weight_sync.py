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


def check_colocated_layout(cfg) -> None:
    if cfg.rollout.placement != "colocated":
        raise ValueError("rollout.placement=disaggregated is not implemented by the RL loop yet (the TRACE "
                         "transport and the engine protocol support it; the loop's rank split does not): "
                         "use rollout.placement=colocated")
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


def sync_weights(engine, trainer, cfg, step: int, version: int) -> dict:
    """Install the trainer's weights in the engine and draw this step's AQN noise; returns metrics."""
    t0 = time.perf_counter()
    hashes = engine.sync_from_model(unwrap(trainer.model), version)
    held = getattr(getattr(engine, "store", None), "digests", None)
    hash_ok = float(held is not None and all(held.get(n) == h for n, h in hashes.items()))
    sigma = aqn_sigma(step, cfg.run.total_steps, cfg.aqn) if cfg.aqn.enabled else 0.0
    seed = aqn_seed(cfg.run.seed, step)
    engine.set_aqn_noise(sigma, seed)
    if cfg.aqn.enabled and cfg.aqn.apply_to == "both":
        set_aqn_noise(unwrap(trainer.model), sigma, generator=torch.Generator().manual_seed(seed))
    else:
        clear_aqn_noise(unwrap(trainer.model))
    store = getattr(engine, "store", None)
    return {"sync/s": time.perf_counter() - t0, "sync/hash_ok": hash_ok, "sync/tensors": float(len(hashes)),
            "sync/bytes": float(store.nbytes()) if store is not None else float("nan"), "aqn/sigma": sigma}
