"""The `WeightSync` interface (trainer weights -> rollout engine) and what every implementation shares.

One implementation per transport, chosen once when the job is built (pipeline/sync/__init__.py):
in-process FP4 (in_process.py), broadcast FP4 to engine ranks (broadcast.py), LoRA adapters (lora.py),
SGLang in-process or servers (sglang.py). The loop only calls `push`; the step guard calls `repush` after
it restarted a failed engine.

AQN noise (METHODS.md section 5) is drawn after each sync: the engine's norm weight = trainer weight +
fresh Z, never accumulating; with aqn.apply_to=both the trainer's norms get the same draw (same seed).
"""
from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

import torch

from megatron_qrl.models import clear_aqn_noise, set_aqn_noise
from megatron_qrl.rl import aqn_sigma


@runtime_checkable
class WeightSync(Protocol):
    """Trainer -> engine weights for one transport."""

    def push(self, step: int, *, version: Optional[int] = None, aqn: bool = True) -> dict:
        """Install the trainer's current weights (version defaults to `step`) and this step's AQN draw
        (none with aqn=False: evaluation scores the policy itself). Returns sync/* and aqn/sigma metrics."""
        ...

    def repush(self, step: int) -> dict:
        """After an engine restart: the same weights and AQN draw as this step's push, into the fresh engine."""
        ...


def unwrap(trainer_model: list) -> list[torch.nn.Module]:
    """Megatron DDP wrappers -> the GPTModel chunks (parameter names as the engine's model has them)."""
    from megatron.core.utils import unwrap_model

    return unwrap_model(list(trainer_model))   # DDP, then Float16Module (bf16 on GPU)


def is_sharded(cfg) -> bool:
    """The trainer holds shards (TP/PP/EP/ETP > 1): the engine needs the gathered full model."""
    t = cfg.trainer
    return t.tensor_parallel * t.pipeline_parallel * t.expert_parallel * t.expert_tensor_parallel != 1


def aqn_seed(run_seed: int, step: int) -> int:
    return (run_seed * 1_000_003 + step) % (2 ** 31)


def step_aqn_sigma(cfg, step: int) -> float:
    """This step's AQN noise std (0 when AQN is off)."""
    return aqn_sigma(step, cfg.run.total_steps, cfg.aqn) if cfg.aqn.enabled else 0.0


def noise_free(cfg):
    """The config with AQN off: evaluation scores the policy itself, as `qrl eval` of its checkpoint does."""
    return cfg.model_copy(update={"aqn": cfg.aqn.model_copy(update={"enabled": False})})


def aqn_config(cfg, aqn: bool):
    """`cfg` for a push with (aqn=True) or without (aqn=False) this step's AQN draw."""
    return cfg if aqn else noise_free(cfg)


def holds_digests(held, hashes) -> float:
    """The post-sync audit: 1.0 when the engine holds exactly the digests that were sent."""
    return float(held is not None and all(held.get(n) == h for n, h in hashes.items()))


def set_trainer_aqn(trainer, cfg, step: int) -> float:
    """The trainer's side of AQN for `step`: the engine's draw too (apply_to=both) or none; returns sigma."""
    sigma = step_aqn_sigma(cfg, step)
    if cfg.aqn.enabled and cfg.aqn.apply_to == "both":
        set_aqn_noise(unwrap(trainer.model), sigma, generator=torch.Generator().manual_seed(aqn_seed(cfg.run.seed, step)))
    else:
        clear_aqn_noise(unwrap(trainer.model))
    return sigma


def draw_engine_aqn(engine, cfg, step: int) -> None:
    """The engine's AQN draw for `step` through the engine protocol (RolloutEngine.set_aqn_noise)."""
    engine.set_aqn_noise(step_aqn_sigma(cfg, step), aqn_seed(cfg.run.seed, step))
