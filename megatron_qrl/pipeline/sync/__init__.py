"""Trainer -> engine weight sync: the `WeightSync` interface and one implementation per transport.

in_process.py  InProcessSync       the embedded engine of this rank (colocated), FP4 bytes + digests
broadcast.py   BroadcastSync       trainer rank 0 -> engine ranks (disaggregated), BroadcastReceiver there
lora.py        LoRASync            QeRL mode: the base linked once, adapters (+ norms) per step
sglang.py      SGLangSync          an in-process sglang.Engine per rank; SGLangServerSync: servers outside
The job picks one when it is built (pipeline/job.py); nothing else branches on the transport.
"""
from __future__ import annotations

from typing import Callable

from .base import WeightSync, aqn_seed, noise_free, step_aqn_sigma, unwrap
from .broadcast import BroadcastReceiver, BroadcastSync
from .in_process import InProcessSync
from .lora import LoRASync
from .payload import local_payload, qat_fp4_weights, quantized_weight_names, trainer_payload
from .sglang import SGLangServerSync, SGLangSync


def in_process_sync(cfg, trainer, engine: Callable[[], object]) -> WeightSync:
    """The WeightSync into an engine of this process: LoRA adapters, SGLang's Engine, or embedded FP4."""
    if cfg.lora.enabled:
        return LoRASync(cfg, trainer, engine)
    if cfg.rollout.engine == "sglang":
        return SGLangSync(cfg, trainer, engine)
    return InProcessSync(cfg, trainer, engine)


def sync_weights(engine, trainer, cfg, step: int, version: int) -> dict:
    """One push into `engine` (a script's or a test's engine of this process): in_process_sync's choice."""
    return in_process_sync(cfg, trainer, lambda: engine).push(step, version=version)


__all__ = ["BroadcastReceiver", "BroadcastSync", "InProcessSync", "LoRASync", "SGLangServerSync", "SGLangSync",
           "WeightSync", "aqn_seed", "in_process_sync", "local_payload", "noise_free", "qat_fp4_weights",
           "quantized_weight_names", "step_aqn_sigma", "sync_weights", "trainer_payload", "unwrap"]
