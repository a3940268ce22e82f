"""The policy model: Megatron-Core GPTModel (Qwen3-MoE style) with FP4 QAT linears, AQN norms, R3 router.

Names are imported lazily (PEP 562) so that `megatron_qrl.models.sizes` and config tooling do not pull
in Megatron-Core; touching any other name imports it.
"""
from importlib import import_module

_EXPORTS = {
    "RMSNorm": "aqn_norm", "aqn_norms": "aqn_norm", "clear_aqn_noise": "aqn_norm", "set_aqn_noise": "aqn_norm",
    "CaptureRecord": "fp4_linear", "FP4ColumnParallelLinear": "fp4_linear", "FP4RowParallelLinear": "fp4_linear",
    "QuantSettings": "fp4_linear", "QuantSite": "fp4_linear", "capture_activations": "fp4_linear",
    "fp4_linears": "fp4_linear", "guided_fallback_stats": "fp4_linear", "quantize_dequantize": "fp4_linear",
    "set_guide_provider": "fp4_linear", "site_name": "fp4_linear", "weights_changed": "fp4_linear",
    "QATSequentialMLP": "experts", "QATGroupedMLP": "grouped_experts", "grouped_expert_modules": "grouped_experts",
    "build_model": "provider", "sequence_parallel_enabled": "provider", "transformer_config": "provider",
    "R3TopKRouter": "r3_router", "clear_replay": "r3_router", "pop_router_agreement": "r3_router",
    "r3_routers": "r3_router",
    "qwen3_moe_layer_spec": "spec",
    "count_parameters": "sizes",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
