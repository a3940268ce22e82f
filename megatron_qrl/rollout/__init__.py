"""Rollout: the engine protocol, the embedded FP4 engine and its weight store (rollout/weights.py).

The FP4 wire format (FP4Tensor, pack_state / pack_weight, payload digests) lives in megatron_qrl.quant.
Importing this package does not import Megatron-Core; `EmbeddedEngine` does when it builds its model.
"""
from .embedded import EmbeddedEngine
from .protocol import (ActivationCapture, RolloutEngine, RolloutSample, SamplingParams, TraceCapture,
                       WeightUpdateError)

__all__ = ["ActivationCapture", "EmbeddedEngine", "RolloutEngine", "RolloutSample", "SamplingParams", "TraceCapture",
           "WeightUpdateError"]
