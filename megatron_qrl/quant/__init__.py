"""The FP4 facade (METHODS.md sections 1-3): one definition of FP4 bytes for trainer, engine and export.

- formats.py: the format objects (`fp4_format`, NVFP4, MXFP4: block size, quantize, fake_quant, guided),
  each call dispatched once to the Triton codec or the torch reference;
- nvfp4.py, mxfp4.py, e2m1.py, qat.py: the torch reference codec (the definition of the bytes);
- wire.py, digest.py: the wire format of weight syncs and exports (FP4Tensor, packing, payload digests);
- blocks.py: the block sizes; sites.py: the names of quantized activation sites (both torch-free).

Names are imported lazily (PEP 562): `megatron_qrl.quant.blocks` and `.sites` load without torch, and no
submodule imports this package's namespace (no cycle through __init__). No exported name may equal a
submodule's name (importing the submodule would bind the module over it).
"""
from importlib import import_module

_MODULES = {
    "e2m1": ("E2M1_VALUES", "canonical", "code_values", "mantissa_bits", "pack_bits", "pack_nibbles",
             "round_guided", "round_nearest", "round_stochastic", "unpack_bits", "unpack_nibbles"),
    "qat": ("GuidedRounding", "fake_quant", "quant_dequant"),
    "formats": ("FP4_FORMATS", "MXFP4", "NVFP4", "Encoding", "FP4Format", "fp4_format"),
    "blocks": ("BLOCK_SIZES", "block_size"),
    "mxfp4": ("mxfp4_dequantize", "mxfp4_quantize"),
    "nvfp4": ("nvfp4_block_scales", "nvfp4_codes", "nvfp4_dequantize", "nvfp4_global_scale",
              "nvfp4_global_scales", "nvfp4_quantize", "nvfp4_scaled"),
    "digest": ("tensor_digest", "tensor_digests"),
    "sites": ("SiteId", "parse_site_name", "site_name"),
    "wire": ("FP4Tensor", "Payload", "pack_state", "pack_weight", "pack_weights", "payload_digest",
             "payload_digests", "payload_nbytes"),
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}
assert not set(_EXPORTS) & set(_MODULES), "an exported name shadows a submodule"

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
