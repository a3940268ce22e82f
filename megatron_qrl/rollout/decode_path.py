"""Which decode path the embedded engine runs, chosen once per engine, and the builder of the static one.

rollout.decode:
- "auto":   CUDA graphs of the static decode step on a GPU when the model is supported
            (static_decode.unsupported_reason), else the eager Megatron loop;
- "graphs": the same, but an unsupported model or a machine without CUDA is an error;
- "static": the static decode step run eagerly, without graphs (how the CPU tests check it);
- "eager":  the eager loop: Megatron's forward per engine step (the reference).
"""
from __future__ import annotations

import logging
from typing import Optional

_log = logging.getLogger(__name__)
DECODE_MODES = ("auto", "graphs", "static", "eager")


def resolve_decode_mode(setting: str, device, reason: Optional[str]) -> str:
    """'graphs', 'static' or 'eager' for rollout.decode = setting on this device and model."""
    if setting not in DECODE_MODES:
        raise ValueError(f"rollout.decode={setting!r}: use one of {DECODE_MODES}")
    cuda = device.type == "cuda"
    if setting == "eager":
        return "eager"
    if reason is not None:
        if setting == "auto":
            _log.info("rollout: eager decode (the static decode step does not support %s)", reason)
            return "eager"
        raise ValueError(f"rollout.decode={setting}: the static decode step does not support {reason}; "
                         "use rollout.decode=eager")
    if setting == "auto":
        return "graphs" if cuda else "eager"
    if setting == "graphs" and not cuda:
        raise ValueError("rollout.decode=graphs needs a CUDA device; use rollout.decode=static (same step, no "
                         "graphs) or eager")
    return setting


def build_graph_loop(engine, mode: str):
    """The static decode loop over the engine's model, cache, FP4 attention linears and (if any) FP4 kernel
    weights. QeRL mode: LoRA attention linears and, on the kernel path, LoRA experts over an FP4 base
    (decode_lora.py); elsewhere LoRA experts run as the model's own (the reference, not capturable)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from .decode_experts import FP4KernelExperts, GroupedBF16Experts, MegatronExperts
    from .decode_linears import dense_fp4_linears
    from .decode_lora import LoRAKernelExperts, lora_dense_linears, lora_experts
    from .kernel_linears import _glu_is_swiglu
    from .graph_decode import GraphDecodeLoop
    from .static_decode import DecodeModel

    model, cuda = engine.model, engine.device.type == "cuda"
    grouped = engine.kernels.grouped if engine.kernels is not None else {}
    names = {id(m): n for n, m in model.named_modules()}
    experts = {}
    for i, layer in enumerate(model.decoder.layers):
        if not isinstance(layer.mlp, MoELayer):
            continue
        mlp = layer.mlp.experts
        capture = layer.layer_number - 1 in engine.trace_layers
        runner = grouped.get(names[id(mlp)])
        if lora_experts(mlp):
            on_kernels = engine.kernels is not None and _glu_is_swiglu(mlp.config)
            experts[i] = (LoRAKernelExperts(mlp, engine.format, engine.scheme == "w4a4", capture, engine.keep_codes)
                          if on_kernels else MegatronExperts(mlp, capture, engine.keep_codes))
        elif runner is not None:
            experts[i] = FP4KernelExperts(runner, engine.format, engine.scheme == "w4a4", capture, engine.keep_codes)
        elif cuda and engine.format == "bf16":
            experts[i] = GroupedBF16Experts(mlp)
        else:
            experts[i] = MegatronExperts(mlp, capture, engine.keep_codes)
    step = DecodeModel(model, engine.cache, experts, kernel_attention=cuda or engine.kernels is not None,
                       linears={**dense_fp4_linears(engine), **lora_dense_linears(engine)})
    return GraphDecodeLoop(engine, step, window=engine.cfg.rollout.decode_window, use_graphs=mode == "graphs")
