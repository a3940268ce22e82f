"""What the pinned SGLang release's ModelOpt NVFP4 methods do to a layer's parameters after loading.

`process_weights_after_loading` turns the checkpoint layout into the kernels' layout once, at load time. A weight
update that only calls `load_weights` afterwards writes checkpoint-layout bytes into kernel-layout tensors (or,
on Hopper's Marlin path, fails on Parameters that lost their `weight_loader`). To re-run the processing for a
layer we need, per quantization method (facts of sglang 0.5.15.post1's modelopt_quant.py / marlin_utils_fp4.py,
checked by tests/test_sglang_reload_contract.py):

- `rewritten`: raw parameters the processing replaces or re-lays out (Marlin repack into new Parameters, scale
  swizzle written in place, scale_2 collapsed to bf16). They are rebuilt fresh in the checkpoint layout with the
  method's own `create_weights`, so the update must send every element of them;
- `read_only`: raw parameters the processing only reads (it derives alpha / global scales from them). They keep
  their identity and values; an update may overwrite them;
- `complete`: the rewritten ones whose every element must have been written before re-processing (filled with NaN
  first; fp4 codes have no NaN, but they arrive together with their block scales);
- `create_weights_kwargs`: the arguments the layer passed to `create_weights`, read back from the layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Fp4Layout:
    method: str
    rewritten: tuple[str, ...]
    read_only: tuple[str, ...]
    complete: tuple[str, ...]
    create_weights_kwargs: Callable[[object, Callable], dict]

    @property
    def raw_slots(self) -> tuple[str, ...]:
        """Every parameter a checkpoint (or an update) writes into."""
        return self.rewritten + self.read_only


def linear_create_weights_kwargs(layer, weight_loader) -> dict:
    """LinearBase subclasses call create_weights with these (ModelOptFp4LinearMethod ignores input/output_size)."""
    return {"layer": layer, "input_size_per_partition": layer.input_size_per_partition,
            "output_partition_sizes": list(layer.logical_widths), "input_size": layer.input_size,
            "output_size": layer.output_size, "params_dtype": layer.params_dtype, "weight_loader": weight_loader}


def fused_moe_create_weights_kwargs(layer, weight_loader) -> dict:
    """FusedMoE calls create_weights with these (num_experts = the layer's local experts)."""
    return {"layer": layer, "num_experts": layer.num_local_experts, "hidden_size": layer.hidden_size,
            "intermediate_size_per_partition": layer.intermediate_size_per_partition,
            "params_dtype": layer.params_dtype, "weight_loader": weight_loader}


MODELOPT_FP4_LINEAR = Fp4Layout(
    method="ModelOptFp4LinearMethod",
    rewritten=("weight", "weight_scale"),
    read_only=("input_scale", "weight_scale_2"),
    complete=("weight_scale",),
    create_weights_kwargs=linear_create_weights_kwargs,
)

MODELOPT_NVFP4_FUSED_MOE = Fp4Layout(
    method="ModelOptNvFp4FusedMoEMethod",
    rewritten=("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale", "w13_weight_scale_2",
               "w2_weight_scale_2"),
    read_only=("w13_input_scale", "w2_input_scale"),
    complete=("w13_weight_scale", "w2_weight_scale", "w13_weight_scale_2", "w2_weight_scale_2"),
    create_weights_kwargs=fused_moe_create_weights_kwargs,
)

LAYOUTS = {layout.method: layout for layout in (MODELOPT_FP4_LINEAR, MODELOPT_NVFP4_FUSED_MOE)}

# ModelOpt FP4 methods of the release the reload refuses, and why (qrl export-nvfp4 never selects them)
UNSUPPORTED = {
    "ModelOptNvFp4A16LinearMethod": "its processing deletes weight_scale_2 and input_scale, so no parameter keeps "
                                    "the layer's weight_loader (selected only by mixed-precision W4A16_NVFP4 "
                                    "checkpoints; qrl export-nvfp4 writes quant_algo NVFP4)",
}


def layout_of(module) -> Fp4Layout | None:
    """The layout of a module's quantization method, None if it has none we re-process (BF16, router, ...)."""
    method = getattr(module, "quant_method", None)
    if method is None:
        return None
    name = type(method).__name__
    if name in UNSUPPORTED:
        raise NotImplementedError(f"FP4 weight reload does not support {name}: {UNSUPPORTED[name]}")
    return LAYOUTS.get(name)
