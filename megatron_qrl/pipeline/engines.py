"""This rank's embedded engine, built (and run) in the one-rank Megatron world it needs."""
from __future__ import annotations


class InEngineWorld:
    """An engine whose every method call runs in its own Megatron world (platform.engine_world): the
    colocated engine beside a sharded trainer builds and runs the whole model as a one-rank world."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        from megatron_qrl.platform import engine_world

        attr = getattr(self._engine, name)
        if not callable(attr):
            return attr

        def in_world(*args, **kwargs):
            with engine_world():
                return attr(*args, **kwargs)
        return in_world


def build_engine(cfg):
    """The embedded engine of this rank (built in its Megatron world; see InEngineWorld)."""
    from megatron_qrl.platform import engine_world
    from megatron_qrl.platform.distributed import engine_world_active
    from megatron_qrl.rollout.embedded import EmbeddedEngine

    with engine_world():
        engine = EmbeddedEngine(engine_config(cfg))
    return InEngineWorld(engine) if engine_world_active() else engine


def engine_config(cfg):
    """The engine builds the whole model: the same config with a 1x1x1 trainer layout (the model definition
    reads its pipeline split from the config)."""
    one = {"tensor_parallel": 1, "pipeline_parallel": 1, "expert_parallel": 1, "expert_tensor_parallel": 1}
    return cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update=one)})
