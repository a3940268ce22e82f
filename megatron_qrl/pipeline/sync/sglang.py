"""WeightSync into SGLang (rollout.engine=sglang): an in-process sglang.Engine per rank, or servers outside
the job that trainer rank 0 alone talks to.

What a sync sends: the codec's FP4 bytes and plain tensors under Megatron names with their digests;
SGLangEngine.update_weights checks the digests on exactly these payloads, maps the names to Hugging Face
(rollout/sglang/names.py, row splits only) and sends buckets. AQN: SGLang's norms have no noise buffer, so
the step's draw Z goes into the payload instead -- the two AQN norms of each layer are sent as w + Z (the
embedded engine's effective weight, same seed, same draw order) and their digests are recomputed.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_qrl.quant.wire import payload_digest, payload_nbytes

from .base import aqn_config, aqn_seed, holds_digests, set_trainer_aqn
from .payload import local_payload, trainer_payload


def add_aqn_noise(weights: dict, hashes: dict, cfg, sigma: float, seed: int) -> None:
    """The engine's AQN draw folded into the sent norm weights: w + Z for every (layer, AQN norm), drawn in
    models.set_aqn_noise's order from the same seed; digests of the changed payloads recomputed."""
    from megatron_qrl.models.aqn_norm import AQN_ROLES
    from megatron_qrl.rl.aqn import aqn_noise

    if sigma <= 0:
        return
    generator = torch.Generator().manual_seed(int(seed))
    for layer in range(cfg.model.num_layers):
        for role in AQN_ROLES:
            z = aqn_noise(cfg.model.hidden_size, sigma, generator=generator)
            name = f"decoder.layers.{layer}.{role}.weight"
            w = weights[name]
            weights[name] = w + z.to(device=w.device, dtype=w.dtype)
            hashes[name] = payload_digest(weights[name])


def install(engine, weights: dict, hashes: dict, version: int, sigma: float, t0: float) -> dict:
    """SGLangEngine.update_weights and its audit as metrics."""
    engine.update_weights(weights, version, hashes)
    audit = engine.last_audit
    return {"sync/s": time.perf_counter() - t0, "sync/hash_ok": holds_digests(engine.digests, hashes),
            "sync/tensors": float(len(hashes)), "sync/wire_tensors": float(audit.get("wire_tensors", 0)),
            "sync/buckets": float(audit.get("buckets", 0)),
            "sync/bytes": float(sum(payload_nbytes(w) for w in weights.values())),
            "aqn/sigma": sigma}


class SGLangSync:
    """Colocated: each rank packs its own unsharded trainer weights (no communication), adds the AQN draw,
    installs them into its in-process sglang.Engine."""

    def __init__(self, cfg, trainer, engine: Callable[[], object]):
        self.cfg, self.trainer, self.engine = cfg, trainer, engine

    def push(self, step: int, *, version: Optional[int] = None, aqn: bool = True) -> dict:
        cfg, engine = aqn_config(self.cfg, aqn), self.engine()
        t0 = time.perf_counter()
        sigma = set_trainer_aqn(self.trainer, cfg, step)
        weights, hashes = local_payload(self.trainer, cfg)
        add_aqn_noise(weights, hashes, cfg, sigma, aqn_seed(cfg.run.seed, step))
        return install(engine, weights, hashes, step if version is None else version, sigma, t0)

    def repush(self, step: int) -> dict:
        return self.push(step)   # a restarted Engine holds the checkpoint's weights: a full sync again


class SGLangServerSync:
    """Servers outside the job: every trainer rank joins the payload gather (a sharded trainer's weights),
    trainer rank 0 sends. The step's update is kept from its push to the end of its generation, so that a
    restarted server gets the same bytes again without another (collective) gather (`repush`)."""

    def __init__(self, cfg, trainer, engine: Callable[[], object]):
        self.cfg, self.trainer, self.engine = cfg, trainer, engine

    def push(self, step: int, *, version: Optional[int] = None, aqn: bool = True) -> dict:
        cfg = aqn_config(self.cfg, aqn)
        t0 = time.perf_counter()
        sigma = set_trainer_aqn(self.trainer, cfg, step)
        weights, hashes = trainer_payload(self.trainer, cfg)        # collective over the trainer ranks
        if dist.get_rank() != 0:
            return {"aqn/sigma": sigma}
        add_aqn_noise(weights, hashes, cfg, sigma, aqn_seed(cfg.run.seed, step))
        engine = self.engine()
        engine.retained_update = (weights, hashes, step)      # for a restart during this step's generation
        return install(engine, weights, hashes, step if version is None else version, sigma, t0)

    def repush(self, step: int) -> dict:
        """Trainer rank 0, after a server restart: re-send the step's retained update (the trainer has not
        changed since the step's push)."""
        t0 = time.perf_counter()
        sigma = set_trainer_aqn(self.trainer, self.cfg, step)
        engine = self.engine()
        if engine.retained_update is None:
            raise RuntimeError("no retained weight update to re-send to the SGLang servers: a disaggregated "
                               "engine is synced by SGLangServerSync.push (all trainer ranks), not here")
        weights, hashes, _ = engine.retained_update
        return install(engine, weights, hashes, step, sigma, t0)

    def drop_retained(self) -> None:
        """The trainer's turn: the step's payload is not kept (rank 0 holds it; other ranks hold no engine)."""
        engine = self.engine()
        if engine is not None:
            engine.retained_update = None
