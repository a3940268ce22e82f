"""Our Megatron model in one process, and model-only checkpoints in the trainer's format.

A converted checkpoint is a Megatron dist checkpoint exactly as `Trainer.save` writes its model part
(`GPTModel.sharded_state_dict()` under the key "model", torch_dist backend, global-offset shards) plus a
`manifest.json`, so `Trainer.load(path, load_optimizer=False)` restores it under any TP/PP/EP layout.
It holds no optimizer, scheduler or RNG state: it is a starting point, not a run to resume.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from megatron_qrl.trainer.checkpoint import FORMAT, MANIFEST, _in_process_results_queue, read_manifest

from .errors import ConvertError

# Trainer.load restores RNG state only when the manifest layout equals the loading trainer's layout; a
# converted checkpoint has no RNG state, so its layout entry names its origin and never matches one.
CONVERTED_LAYOUT = {"origin": "qrl convert (unsharded, model only)"}


def start_single_process(cfg) -> None:
    """Megatron process groups for one unsharded process (conversions never run sharded)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        raise ConvertError(f"conversion runs in one process, but WORLD_SIZE={world} (torchrun/srun); run it as a "
                           "plain `qrl convert ...` / `qrl export-nvfp4 ...`: the checkpoint it reads or writes "
                           "is layout-independent")
    from megatron_qrl.platform import init_distributed

    init_distributed(cfg)


def build_unsharded_model(cfg) -> torch.nn.Module:
    """The GPTModel of `cfg` (TP=PP=EP=1 expected), in eval mode without gradients."""
    from megatron_qrl.models import build_model

    start_single_process(cfg)
    model = build_model(cfg)[0]
    model.eval()
    model.requires_grad_(False)
    return model


def save_model_checkpoint(model, cfg, directory: Path, extra: dict) -> None:
    """Write `model` as a model-only trainer checkpoint into the (empty) `directory`; manifest last."""
    import megatron.core
    from megatron.core import dist_checkpointing

    _in_process_results_queue()
    dist_checkpointing.save({"model": model.sharded_state_dict(), "step": 0, "extra_state": {}}, str(directory))
    manifest = {"format": FORMAT, "megatron_core": megatron.core.__version__, "step": 0,
                "layout": CONVERTED_LAYOUT, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "model": cfg.model.model_dump(), "quant": cfg.quant.model_dump(), "contents": ["model"],
                "params_dtype": str(next(model.parameters()).dtype).removeprefix("torch."), **extra,
                "files": sorted(os.listdir(directory))}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1))


def load_model_checkpoint(model, path: str | Path) -> None:
    """Load the model part of a trainer or converted checkpoint (any layout) into an unsharded model."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(Path(path).absolute()))
    model.load_state_dict(loaded["model"], strict=True)


def manifest_of(path: str | Path) -> dict:
    """The checkpoint's manifest (a clear error when `path` is not a complete checkpoint)."""
    path = Path(path)
    if not path.is_dir():
        raise ConvertError(f"checkpoint '{path}' does not exist or is not a directory; pass a directory written by "
                           "Trainer.save or `qrl convert hf-to-mcore`")
    return read_manifest(path)
