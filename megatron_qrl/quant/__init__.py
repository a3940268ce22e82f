"""The FP4 codec (METHODS.md sections 1-3): one definition of FP4 bytes for trainer, engine and export,
and the wire format of weight syncs (wire.py: FP4Tensor, packing; digest.py: payload digests)."""
from .e2m1 import (E2M1_VALUES, canonical, code_values, mantissa_bits, pack_bits, pack_nibbles,
                   round_guided, round_nearest, round_stochastic, unpack_bits, unpack_nibbles)
from .fake_quant import GuidedRounding, fake_quant, quant_dequant
from .mxfp4 import mxfp4_dequantize, mxfp4_quantize
from .nvfp4 import (nvfp4_block_scales, nvfp4_codes, nvfp4_dequantize, nvfp4_global_scale, nvfp4_global_scales,
                    nvfp4_quantize, nvfp4_scaled)
from .digest import tensor_digest, tensor_digests
from .wire import FP4Tensor, pack_weight, pack_weights, payload_digest, payload_digests

__all__ = [
    "E2M1_VALUES", "FP4Tensor", "GuidedRounding", "canonical", "code_values", "fake_quant", "mantissa_bits",
    "mxfp4_dequantize", "mxfp4_quantize", "nvfp4_block_scales", "nvfp4_codes", "nvfp4_dequantize",
    "nvfp4_global_scale", "nvfp4_global_scales", "nvfp4_quantize", "nvfp4_scaled", "pack_bits", "pack_nibbles",
    "pack_weight", "pack_weights", "payload_digest", "payload_digests", "quant_dequant", "round_guided",
    "round_nearest", "round_stochastic", "tensor_digest", "tensor_digests", "unpack_bits", "unpack_nibbles",
]
