"""Rollout: the engine protocol, the embedded FP4 engine, FP4 weight sync (store + digests).

Importing this package does not import Megatron-Core; `EmbeddedEngine` does when it builds its model.
"""
from .embedded import EmbeddedEngine
from .protocol import (ActivationCapture, RolloutEngine, RolloutSample, SamplingParams, TraceCapture,
                       WeightUpdateError)
from .weights import FP4Tensor, pack_state, pack_weight, payload_digest, tensor_digest

__all__ = [
    "ActivationCapture", "EmbeddedEngine", "FP4Tensor", "RolloutEngine", "RolloutSample", "SamplingParams",
    "TraceCapture", "WeightUpdateError", "pack_state", "pack_weight", "payload_digest", "tensor_digest",
]
