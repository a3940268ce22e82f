"""The QRLConfig a conversion runs with: model fields from the checkpoint, the rest from --config/overrides.

The checkpoint (HF config.json or our manifest) defines the architecture; a --config file and dotted
overrides supply everything else (quant.*, trainer.*, ...). A config that states an architecture field
with another value than the checkpoint is refused instead of silently building a different model.
The conversion itself always runs in one process with an unsharded model (TP=PP=EP=ETP=1): the Megatron
dist checkpoint it reads or writes is layout-independent.
"""
from __future__ import annotations

from typing import Iterable, Optional

from megatron_qrl.config import ConfigError, QRLConfig, apply_overrides, from_dict, read_config_file

from .errors import ConvertError


def _user_data(config_path: Optional[str], overrides: Iterable[str]) -> dict:
    try:
        data = read_config_file(config_path) if config_path is not None else {}
    except ConfigError as e:   # a conversion's errors are ConvertErrors
        raise ConvertError(str(e)) from None
    return apply_overrides(data, list(overrides))


def conversion_config(checkpoint_fields: dict, source: str, config_path: Optional[str] = None,
                      overrides: Iterable[str] = (), defaults: Optional[dict] = None,
                      fixed: Iterable[str] = ()) -> QRLConfig:
    """Merge: `defaults` (sections) < user config/overrides < `checkpoint_fields` (model.*).

    `fixed` names the model fields the checkpoint determines; the user may repeat them only with the same
    value. Other checkpoint fields (e.g. max_sequence_length) are defaults the user may change.
    """
    user = _user_data(config_path, overrides)
    user_model = user.get("model") or {}
    user_model.pop("hf_path", None)   # a run recipe's model directory: the conversion's source is explicit
    user.pop("data", None)            # ... and its prompts / chat template: conversions read no data
    fixed = set(fixed)
    conflicts = [f"model.{k}: {source} has {checkpoint_fields[k]!r}, your config/overrides say {user_model[k]!r}"
                 for k in sorted(fixed) if k in user_model and k in checkpoint_fields
                 and user_model[k] != checkpoint_fields[k]]
    if conflicts:
        raise ConvertError("the config disagrees with the checkpoint's architecture:\n  " + "\n  ".join(conflicts)
                           + "\nremove these fields from --config/overrides (the checkpoint defines them)")
    data = {k: dict(v) for k, v in (defaults or {}).items()}
    if checkpoint_fields.get("num_experts") == 0:   # a dense model has no routed experts to quantize
        data.setdefault("quant", {}).setdefault("targets", "all_linears")
    for section, values in user.items():
        if isinstance(values, dict):
            data.setdefault(section, {}).update(values)
        else:
            data[section] = values
    model = {**{k: v for k, v in checkpoint_fields.items() if k not in fixed}, **user_model,
             **{k: v for k, v in checkpoint_fields.items() if k in fixed}}
    data["model"] = {**data.get("model", {}), **model}
    try:
        return from_dict(data)
    except ConfigError as e:
        raise ConvertError(f"the conversion config is invalid: {e}") from None


def single_process(cfg: QRLConfig, bf16: bool = False) -> QRLConfig:
    """The same run config with an unsharded layout (and the parameter dtype the conversion holds)."""
    trainer = cfg.trainer.model_copy(update={"tensor_parallel": 1, "pipeline_parallel": 1, "expert_parallel": 1,
                                             "expert_tensor_parallel": 1, "sequence_parallel": None,
                                             "bf16": bf16})
    return cfg.model_copy(update={"trainer": trainer})


def config_from_manifest(manifest: dict, source: str, config_path: Optional[str] = None,
                         overrides: Iterable[str] = ()) -> QRLConfig:
    """Run config for reading a checkpoint: its manifest's model (fixed) and quant (default) sections."""
    from .qwen3_moe import DERIVED_FIELDS

    fields = dict(manifest.get("model") or {})
    fields.pop("hf_path", None)   # the manifest holds the resolved fields; the directory may have moved
    if not fields:
        raise ConvertError(f"{source} has no model config; it was not written by Trainer.save or qrl convert")
    return conversion_config(fields, source, config_path, overrides, defaults={"quant": manifest.get("quant") or {}},
                             fixed=DERIVED_FIELDS)
