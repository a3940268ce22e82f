"""In-process FP4 sync: the embedded engine of this rank installs the trainer's FP4 bytes directly.

Unsharded trainer: this rank's payload (EmbeddedEngine.sync_from_model's, with the QAT quantizer's expert
bytes reused), no communication. A colocated engine beside a sharded trainer: every rank gathers the full
model (trainer_payload(everywhere=True), collective over the trainer ranks). The engine refuses an update
whose bytes do not hash to the sent digests (nothing changes then); after a successful install we audit
that the engine holds exactly the digests we sent (sync/hash_ok).
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from .base import aqn_config, aqn_seed, holds_digests, set_trainer_aqn
from .payload import trainer_payload


class InProcessSync:
    """WeightSync into this rank's embedded engine (`engine()` returns it ready: memory resumed)."""

    def __init__(self, cfg, trainer, engine: Callable[[], object]):
        self.cfg, self.trainer, self.engine = cfg, trainer, engine

    def push(self, step: int, *, version: Optional[int] = None, aqn: bool = True) -> dict:
        cfg, engine = aqn_config(self.cfg, aqn), self.engine()
        t0 = time.perf_counter()
        weights, hashes = trainer_payload(self.trainer, self.cfg, everywhere=True)   # unsharded: local_payload
        engine.update_weights(weights, step if version is None else version, hashes)
        hash_ok = holds_digests(getattr(getattr(engine, "store", None), "digests", None), hashes)
        sigma = set_trainer_aqn(self.trainer, cfg, step)
        engine.set_aqn_noise(sigma, aqn_seed(cfg.run.seed, step))
        store = getattr(engine, "store", None)
        return {"sync/s": time.perf_counter() - t0, "sync/hash_ok": hash_ok, "sync/tensors": float(len(hashes)),
                "sync/bytes": float(store.nbytes()) if store is not None else float("nan"), "aqn/sigma": sigma}

    def repush(self, step: int) -> dict:
        return self.push(step)   # the trainer has not changed since the step's push
