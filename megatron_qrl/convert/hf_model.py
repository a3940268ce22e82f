"""`model.hf_path`: the `model.*` config fields of a local Hugging Face model directory.

The directory's config.json defines the architecture (the fields qwen3_moe.DERIVED_FIELDS lists); a run
config that repeats one of them must agree with it, so a typo cannot silently build another model than the
weights on disk. `max_sequence_length` defaults to config.json's `max_position_embeddings` and may only be
lowered (beyond it RoPE would extrapolate untrained positions). The training choices (init_method_std,
moe_aux_loss_coeff) stay the run config's. Nothing is read from the network: the directory must be local.
"""
from __future__ import annotations

from pathlib import Path

from .errors import ConvertError
from .hf_config import read_hf_config
from .qwen3_moe import DERIVED_FIELDS, model_fields_from_hf

HF_PATH_FIELD = "hf_path"


def check_model_dir(path) -> Path:
    """The local HF model directory `path` (absolute), or an error saying what a model directory holds."""
    if not isinstance(path, (str, Path)) or not str(path):
        raise ConvertError(f"model.hf_path must be a directory path, got {path!r}")
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ConvertError(f"model.hf_path '{p}' is not a directory; set it to a local Hugging Face model directory "
                           "(config.json, generation_config.json, tokenizer files, *.safetensors). Hub names are not "
                           "downloaded: fetch the model first (e.g. `huggingface-cli download NAME --local-dir DIR`)")
    if not (p / "config.json").is_file():
        raise ConvertError(f"model.hf_path '{p}' has no config.json; it must be a Hugging Face model directory")
    return p.absolute()


def model_section_from_hf(section: dict) -> dict:
    """The raw `model:` mapping of a run config with `hf_path` set -> the mapping with config.json's fields.

    Raises ConvertError naming every field that disagrees (both values), an unsupported architecture, or
    a max_sequence_length beyond the model's context."""
    path = check_model_dir(section[HF_PATH_FIELD])
    try:
        fields = model_fields_from_hf(read_hf_config(path))
    except ConvertError as e:
        raise ConvertError(f"model.hf_path '{path}': {e}") from None
    fixed = set(DERIVED_FIELDS)
    conflicts = [f"model.{k}: {path}/config.json has {fields[k]!r}, the config says {section[k]!r}"
                 for k in sorted(fixed) if section.get(k) is not None and section[k] != fields[k]]
    if conflicts:
        raise ConvertError("the config disagrees with model.hf_path's config.json:\n    " + "\n    ".join(conflicts)
                           + "\n  remove these model fields (config.json defines them) or point model.hf_path at the "
                           "model you meant")
    context = fields["max_sequence_length"]
    wanted = section.get("max_sequence_length")
    if wanted is not None and wanted > context:
        raise ConvertError(f"model.max_sequence_length ({wanted}) exceeds the model's context "
                           f"(max_position_embeddings={context} in {path}/config.json); set it <= {context}")
    return {**fields, **{k: v for k, v in section.items() if v is not None}, HF_PATH_FIELD: str(path)}
