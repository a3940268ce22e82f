"""Megatron-Core trainer: Trainer(cfg).logprobs / train_step / save / load. See trainer.py and batch.py."""
from .batch import BatchError, shard
from .checkpoint import CheckpointError, read_manifest
from .trainer import Trainer, token_logprobs

__all__ = ["BatchError", "CheckpointError", "Trainer", "read_manifest", "shard", "token_logprobs"]
