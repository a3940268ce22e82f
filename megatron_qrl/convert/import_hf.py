"""`qrl convert hf-to-mcore`: a Qwen3-MoE (or dense Qwen3) HF safetensors directory -> our Megatron dist checkpoint.

Everything is checked before anything is built or written: the architecture and config.json features,
then the tensor set (missing, unexpected) and every shape against the mapping. The model is built once,
unsharded, in this process; tensors stream from the memory-mapped shards one rule at a time into its
parameters; the checkpoint is written into a temporary directory and renamed into place.
Parameters are kept in bf16 when every source tensor is bf16 (exact, half the memory), else in fp32.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional

import torch

from megatron_qrl.logging import progress_bar

from .configs import conversion_config, single_process
from .errors import ConvertError
from .hf_config import STORED_CONFIG, STORED_FILES, copy_side_files, read_hf_config
from .mcore_io import build_unsharded_model, save_model_checkpoint
from .qwen3_moe import (DERIVED_FIELDS, IGNORED_SUFFIXES, architecture, hf_shapes, merge, model_fields_from_hf,
                        tensor_rules)
from .safetensors_io import SafetensorsReader
from .staging import require_new_output, staged_output

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
QUANTIZED_SUFFIXES = ("weight_scale", "weight_scale_inv", "weight_scale_2", "input_scale", "weight_packed")


def _examples(names, n: int = 4) -> str:
    names = sorted(names)
    return ", ".join(names[:n]) + (f", ... ({len(names)} in all)" if len(names) > n else "")


def check_hf_tensors(reader: SafetensorsReader, rules: list, m, src: Path) -> None:
    """Missing / unexpected tensors, shapes, dtypes: one clear error per kind of problem."""
    expected = {name: shape for r in rules for name, shape in zip(r.hf, hf_shapes(r, m))}
    present = {n: i for n, i in reader.info.items() if not n.endswith(IGNORED_SUFFIXES)}
    shape_hint = (f"config.json says num_hidden_layers={m.num_layers}, num_experts={m.num_experts}, "
                  f"tie_word_embeddings={not m.untie_embeddings_and_output_weights}")
    extra = set(present) - set(expected)
    if extra:
        quantized = [n for n in extra if n.endswith(QUANTIZED_SUFFIXES)]
        fix = ("it is a quantized (FP8/FP4) checkpoint: convert the BF16 release instead" if quantized else
               f"the weights do not belong to this config.json ({shape_hint}); fix config.json or remove them")
        raise ConvertError(f"{len(extra)} unexpected tensor(s) in '{src}': {_examples(extra)}; {fix}")
    missing = set(expected) - set(present)
    if missing:
        raise ConvertError(f"{len(missing)} tensor(s) missing from '{src}': {_examples(missing)}; the checkpoint is "
                           f"incomplete or does not match config.json ({shape_hint}): re-download the shards or "
                           "fix config.json")
    wrong = [f"{n} has {list(present[n].shape)}, expected {list(s)}" for n, s in expected.items()
             if tuple(present[n].shape) != tuple(s)]
    if wrong:
        raise ConvertError(f"shape mismatch in '{src}' ({len(wrong)} tensor(s)): {'; '.join(wrong[:3])}; config.json "
                           "(hidden_size, head_dim, heads, moe_intermediate_size, vocab_size) and the weights disagree")
    odd = [f"{n} ({present[n].dtype})" for n in expected if present[n].dtype not in FLOAT_DTYPES]
    if odd:
        raise ConvertError(f"tensor(s) with a non-float dtype in '{src}': {', '.join(odd[:3])}; convert a "
                           "BF16/FP16/FP32 checkpoint")


def check_model_covered(model, rules: list) -> None:
    """Every parameter of the built model has exactly one rule (else it would keep its random init)."""
    params = {n for n, _ in model.named_parameters()}
    targets = {r.mcore for r in rules}
    if params != targets:
        raise ConvertError(f"the Qwen3 mapping does not match the model our layer spec builds (parameters without "
                           f"a rule: {_examples(params - targets)}; rules without a parameter: "
                           f"{_examples(targets - params)}); update megatron_qrl/convert/qwen3_moe.py")


@torch.no_grad()
def fill_model(model, reader: SafetensorsReader, rules: list, m) -> None:
    """Copy the HF tensors into the model's parameters, one rule (a few tensors) at a time."""
    params = dict(model.named_parameters())
    for rule in progress_bar(rules, desc="hf-to-mcore", unit="tensor"):
        value = merge(rule, [reader.get(n) for n in rule.hf], m)
        params[rule.mcore].copy_(value)


def hf_to_mcore(src: str | Path, dst: str | Path, config: Optional[str] = None,
                overrides: Iterable[str] = ()) -> Path:
    """Convert; returns the checkpoint path. Raises ConvertError (nothing written) on bad input."""
    src, dst = Path(src), require_new_output(dst)
    if not src.is_dir():
        raise ConvertError(f"source '{src}' is not a directory; pass a Hugging Face checkpoint directory "
                           "(config.json + *.safetensors)")
    hf = read_hf_config(src)
    fields = model_fields_from_hf(hf)
    cfg = conversion_config(fields, f"'{src}/config.json'", config, overrides, fixed=DERIVED_FIELDS)
    rules = tensor_rules(cfg.model)
    with SafetensorsReader(src) as reader:
        check_hf_tensors(reader, rules, cfg.model, src)
        all_bf16 = all(reader.info[n].dtype == torch.bfloat16 for r in rules for n in r.hf)
        model = build_unsharded_model(single_process(cfg, bf16=all_bf16))
        check_model_covered(model, rules)
        fill_model(model, reader, rules, cfg.model)
    with staged_output(dst) as tmp:
        save_model_checkpoint(model, cfg, tmp, {"source": {"format": "hf", "path": str(src.absolute()),
                                                           "architecture": architecture(cfg.model)}})
        (tmp / STORED_CONFIG).write_text(json.dumps(hf, indent=2) + "\n")
        copy_side_files(src, tmp / STORED_FILES)   # tokenizer, chat template, generation config: for exports
    return dst
