"""Megatron-Core trainer: Trainer(cfg).logprobs / train_step / save / load. See trainer.py and batch.py.

Names are imported lazily (PEP 562): `megatron_qrl.trainer.batch` stays free of Megatron imports.
"""
from importlib import import_module

_EXPORTS = {"BatchError": "batch", "shard": "batch", "CheckpointError": "checkpoint", "read_manifest": "checkpoint",
            "Trainer": "trainer", "token_logprobs": "batch"}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
