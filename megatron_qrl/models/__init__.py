"""The policy model: Megatron-Core GPTModel (Qwen3-MoE style) with FP4 QAT linears, AQN norms, R3 router.

Importing this package imports Megatron-Core; keep it out of code paths that must stay light.
"""
from .aqn_norm import RMSNorm, aqn_norms, clear_aqn_noise, set_aqn_noise
from .fp4_linear import (CaptureRecord, FP4ColumnParallelLinear, FP4RowParallelLinear, QuantSettings, QuantSite,
                         capture_activations, fp4_linears, guided_fallback_stats, quantize_dequantize,
                         set_guide_provider, site_name)
from .provider import build_model, count_parameters, sequence_parallel_enabled, transformer_config
from .r3_router import R3TopKRouter, clear_replay, pop_router_agreement, r3_routers
from .spec import qwen3_moe_layer_spec

__all__ = [
    "CaptureRecord", "FP4ColumnParallelLinear", "FP4RowParallelLinear", "QuantSettings", "QuantSite", "R3TopKRouter",
    "RMSNorm", "aqn_norms", "build_model", "capture_activations", "clear_aqn_noise", "clear_replay",
    "count_parameters", "fp4_linears", "guided_fallback_stats", "pop_router_agreement", "quantize_dequantize",
    "qwen3_moe_layer_spec", "r3_routers", "sequence_parallel_enabled", "set_aqn_noise", "set_guide_provider",
    "site_name", "transformer_config",
]
