"""`qrl convert mcore-to-hf`: our Megatron checkpoint (any layout) -> a Qwen3-MoE (or dense Qwen3) HF
safetensors directory.

The checkpoint is loaded into one unsharded model (one copy of the weights; Megatron loads in place), then
HF tensors are produced rule by rule and streamed into bounded safetensors shards. Output dtype: --dtype,
else the source config's dtype, else bfloat16; float32 checkpoints of a bf16 source round-trip exactly.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from megatron_qrl.logging import progress_bar

from .configs import config_from_manifest, single_process
from .errors import ConvertError
from .hf_config import config_dtype, copy_side_files, output_config, with_dtype
from .mcore_io import build_unsharded_model, load_model_checkpoint, manifest_of
from .qwen3_moe import TensorRule, check_supported, split, tensor_rules
from .safetensors_io import ShardedSafetensorsWriter, parse_size
from .staging import require_new_output, staged_output

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}

# (rule, Megatron parameter) -> [(HF tensor name, tensor)]: how one parameter is written
TensorEmitter = Callable[[TensorRule, torch.Tensor], list]


def dtype_name(name: Optional[str]) -> Optional[str]:
    """Canonical HF dtype name ('bf16' -> 'bfloat16'); None stays None."""
    if name is None:
        return None
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        raise ConvertError(f"dtype '{name}' is not supported for HF weights; use one of {sorted(DTYPES)}")
    return name


def checkpoint_config(checkpoint: str | Path, config: Optional[str] = None, overrides: Iterable[str] = ()):
    """The run config of a checkpoint (its manifest + --config/overrides), checked to be Qwen3(-MoE)."""
    checkpoint = Path(checkpoint).absolute()
    manifest = manifest_of(checkpoint)
    cfg = config_from_manifest(manifest, f"'{checkpoint}/manifest.json'", config, overrides)
    check_supported(cfg.model)
    return cfg


def trained_from(checkpoint: str | Path) -> Optional[str]:
    """The model.hf_path a training run's checkpoint started from (its config, tokenizer), if any."""
    return (manifest_of(Path(checkpoint).absolute()).get("model") or {}).get("hf_path")


def load_checkpoint_model(checkpoint: str | Path, cfg=None):
    """(run config, unsharded model with the checkpoint's weights), in fp32 (exact for bf16 checkpoints)."""
    cfg = cfg or checkpoint_config(checkpoint)
    model = build_unsharded_model(single_process(cfg))
    load_model_checkpoint(model, Path(checkpoint).absolute())
    return cfg, model


def plain_emitter(m, dtype: torch.dtype) -> TensorEmitter:
    """HF tensors of a parameter in high precision (cast to the output dtype)."""
    def emit(rule, param):
        return [(name, t.to(dtype)) for name, t in zip(rule.hf, split(rule, param, m))]

    return emit


def write_hf_tensors(model, m, directory: Path, emit: TensorEmitter, max_shard_size: str | int,
                     desc: str) -> list[str]:
    """Stream every parameter's HF tensors into safetensors shards; returns the files written."""
    params = dict(model.named_parameters())
    writer = ShardedSafetensorsWriter(directory, parse_size(max_shard_size))
    for rule in progress_bar(tensor_rules(m), desc=desc, unit="tensor"):
        for name, tensor in emit(rule, params[rule.mcore].detach()):
            writer.add(name, tensor)
    return writer.close()


def mcore_to_hf(src: str | Path, dst: str | Path, hf_config: Optional[str] = None, dtype: Optional[str] = None,
                max_shard_size: str | int = "5GB") -> Path:
    """Convert; returns the output directory. Raises ConvertError / CheckpointError (nothing written)."""
    src, dst = Path(src).absolute(), require_new_output(dst)
    dtype = dtype_name(dtype)
    cfg = checkpoint_config(src)
    base, side_dir = output_config(src, cfg.model, hf_config, trained_from(src))
    source_dtype = DTYPE_ALIASES.get(config_dtype(base), config_dtype(base))
    out_dtype = dtype or (source_dtype if source_dtype in DTYPES else "bfloat16")
    _, model = load_checkpoint_model(src, cfg)
    with staged_output(dst) as tmp:
        write_hf_tensors(model, cfg.model, tmp, plain_emitter(cfg.model, DTYPES[out_dtype]), max_shard_size,
                         "mcore-to-hf")
        copy_side_files(side_dir, tmp)
        (tmp / "config.json").write_text(json.dumps(with_dtype(base, out_dtype), indent=2) + "\n")
    return dst
