"""config.json handling: read a source config, pick the config and side files written next to exported weights.

Exports (mcore-to-hf, export-nvfp4) write the source model's own config.json when it is known, so the
round trip returns the same file content, and copy its side files (tokenizer files, chat template,
generation_config.json), so the output directory loads with transformers / SGLang as it is. The source, in
this order: `--hf-config DIR`; the config and side files `qrl convert hf-to-mcore` keeps inside the
checkpoint (`hf_config.json`, `hf_files/`); the `model.hf_path` directory a training run started from (in
the checkpoint manifest's model config). Only without any of them is a Qwen3(-MoE) config generated from the
checkpoint's model config (and no tokenizer is written).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

from .errors import ConvertError
from .qwen3_moe import DERIVED_FIELDS, hf_config_from_model, model_fields_from_hf

STORED_CONFIG = "hf_config.json"       # the source config.json, kept inside converted checkpoints
STORED_FILES = "hf_files"              # ... and its side files (tokenizer, chat template, generation config)
DTYPE_KEYS = ("torch_dtype", "dtype")  # transformers 4 / 5 spell the weight dtype differently
# files an HF directory holds besides weights/config that exports carry over (tokenizer, generation config)
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def read_hf_config(path: str | Path) -> dict:
    """config.json of an HF checkpoint directory (or the file itself)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ConvertError(f"'{file}' does not exist; pass a Hugging Face checkpoint directory with config.json")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ConvertError(f"'{file}' is not valid JSON ({e}); re-save the config") from None
    if not isinstance(data, dict):
        raise ConvertError(f"'{file}' must hold a JSON object")
    return data


def config_dtype(hf: dict) -> Optional[str]:
    for key in DTYPE_KEYS:
        if isinstance(hf.get(key), str):
            return hf[key]
    return None


def with_dtype(hf: dict, dtype: str) -> dict:
    """The config with its weight dtype entry (whichever spelling it uses) set to `dtype`."""
    out = dict(hf)
    keys = [k for k in DTYPE_KEYS if k in out] or ["torch_dtype"]
    for k in keys:
        out[k] = dtype
    return out


def output_config(checkpoint: Path, model_cfg, hf_config: Optional[str],
                  trained_from: Optional[str] = None) -> tuple[dict, Optional[Path]]:
    """(config.json for the export, directory whose side files to copy or None).

    Order: --hf-config, the checkpoint's stored source config (+ stored side files), `trained_from` (the
    manifest's model.hf_path), a generated config. A given config must describe the checkpoint's architecture.
    """
    side_dir = None
    if hf_config is not None:
        base = read_hf_config(hf_config)
        side_dir = Path(hf_config) if Path(hf_config).is_dir() else None
        origin = f"--hf-config {hf_config}"
    elif (checkpoint / STORED_CONFIG).is_file():
        base = read_hf_config(checkpoint / STORED_CONFIG)
        side_dir = checkpoint / STORED_FILES if (checkpoint / STORED_FILES).is_dir() else None
        origin = f"{checkpoint / STORED_CONFIG}"
    elif trained_from is not None:
        if not (Path(trained_from) / "config.json").is_file():
            raise ConvertError(f"the checkpoint was trained from model.hf_path '{trained_from}', which has no "
                               "config.json any more; pass --hf-config DIR (that model directory) so the export "
                               "gets its config, tokenizer and generation config")
        base, side_dir, origin = read_hf_config(trained_from), Path(trained_from), f"model.hf_path {trained_from}"
    else:
        return hf_config_from_model(model_cfg), None
    fields = model_fields_from_hf(base)
    mine = model_cfg.model_dump()
    mine["kv_channels"] = model_cfg.head_dim
    diff = [f"{k} ({fields[k]!r} vs checkpoint {mine[k]!r})" for k in DERIVED_FIELDS if fields[k] != mine[k]]
    if diff:
        raise ConvertError(f"{origin} describes another model than the checkpoint: {', '.join(diff)}; pass the "
                           "config.json of the model this checkpoint was converted from, or leave out --hf-config")
    return base, side_dir


def copy_side_files(src: Optional[Path], dst: Path) -> list[str]:
    """Copy tokenizer / generation config files (not weights, not config.json) from an HF directory."""
    if src is None:
        return []
    dst.mkdir(exist_ok=True)
    copied = []
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name != "config.json" and not f.name.endswith(WEIGHT_FILES) \
                and f.name != "hf_quant_config.json":
            shutil.copy2(f, dst / f.name)
            copied.append(f.name)
    return copied
