"""Checkpoint conversion (Qwen3-MoE HF <-> our Megatron dist checkpoints) and NVFP4 export for SGLang/vLLM.

    hf_to_mcore(src_hf_dir, dst_ckpt, config=None, overrides=())   -> Trainer.load(dst, load_optimizer=False)
    mcore_to_hf(src_ckpt, dst_hf_dir, hf_config=None, dtype=None)
    export_nvfp4(src_ckpt, dst_hf_dir, config=None, overrides=(), calib_tokens=None, ...)

All three check their inputs before writing, stream tensors one at a time, and write into a temporary
directory beside the destination that is renamed into place at the end (see docs/convert.md).
"""
from .errors import ConvertError


def hf_to_mcore(*args, **kwargs):
    from .import_hf import hf_to_mcore as impl

    return impl(*args, **kwargs)


def mcore_to_hf(*args, **kwargs):
    from .export_hf import mcore_to_hf as impl

    return impl(*args, **kwargs)


def export_nvfp4(*args, **kwargs):
    from .nvfp4_export import export_nvfp4 as impl

    return impl(*args, **kwargs)


__all__ = ["ConvertError", "export_nvfp4", "hf_to_mcore", "mcore_to_hf"]
