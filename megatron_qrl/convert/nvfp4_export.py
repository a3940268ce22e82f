"""`qrl export-nvfp4`: our checkpoint -> an HF NVFP4 checkpoint in ModelOpt's layout (SGLang/vLLM modelopt_fp4).

For every quantized linear X (routed experts; all attention/expert linears with quant.targets=all_linears,
the same choice the weight sync makes: `rollout.embedded.rollout_quantized`):
    X.weight          uint8 [N, K/2]          E2M1 codes, element 2i in the low nibble
    X.weight_scale    float8_e4m3fn [N, K/16] block scales
    X.weight_scale_2  float32 scalar          global scale amax(|W|)/(6*448)
    X.input_scale     float32 scalar          static activation scale amax(|x|)/(6*448) (calibration)
Everything else (embeddings, norms, router `mlp.gate`, `lm_head`, unquantized linears) stays in --dtype.
The bytes are `quant.wire.pack_weight` of the fused Megatron weight - exactly what the trainer's weight
sync sends - split by rows into HF's q/k/v and gate/up tensors (they share one weight_scale_2, which is what
fused kernels expect). hf_quant_config.json and config.json["quantization_config"] follow ModelOpt's exporter.
"""
from __future__ import annotations

import bisect
import json
from pathlib import Path
from typing import Iterable, Optional

import torch

from megatron_qrl.quant.blocks import NVFP4_BLOCK as GROUP_SIZE

from .calibration import activation_amax, fixed_amax, random_tokens, read_calibration_tokens
from .hf_config import copy_side_files, output_config, with_dtype
from .errors import ConvertError
from .export_hf import (DTYPES, checkpoint_config, dtype_name, load_checkpoint_model, trained_from,
                        write_hf_tensors)
from .qwen3_moe import split, tensor_rules
from .staging import require_new_output, staged_output

FP4_MAX, E4M3_MAX = 6.0, 448.0


def _producer() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return {"name": "megatron-qrl", "version": version("megatron-qrl")}
    except PackageNotFoundError:
        return {"name": "megatron-qrl", "version": "unknown"}


def quantized_linears(model, targets: str) -> dict:
    """{Megatron weight name: FP4 linear} of the linears exported in NVFP4 (the weight sync's choice)."""
    from megatron_qrl.models import fp4_linears
    from megatron_qrl.rollout.embedded import rollout_quantized

    names = {id(m): n for n, m in model.named_modules()}
    return {f"{names[id(lin)]}.weight": lin for lin in fp4_linears(model) if rollout_quantized(lin.site, targets)}


def input_scale(amax: float) -> torch.Tensor:
    return torch.tensor(amax / (FP4_MAX * E4M3_MAX), dtype=torch.float32)


def nvfp4_emitter(m, dtype: torch.dtype, amax: dict):
    """HF tensors of one parameter: NVFP4 (4 tensors per HF linear) when quantized, else plain."""
    from megatron_qrl.quant.wire import pack_weight

    def emit(rule, param):
        if rule.mcore not in amax:
            return [(n, t.to(dtype)) for n, t in zip(rule.hf, split(rule, param, m))]
        fp4 = pack_weight(param, "nvfp4")
        packed, scales = split(rule, fp4.packed, m), split(rule, fp4.scales, m)
        out = []
        for module, p, s in zip(rule.hf_modules(), packed, scales):
            out += [(f"{module}.weight", p), (f"{module}.weight_scale", s),
                    (f"{module}.weight_scale_2", fp4.global_scale.detach().clone().float()),
                    (f"{module}.input_scale", input_scale(amax[rule.mcore]))]
        return out

    return emit


def linear_modules(m) -> list[str]:
    """HF names of the Linear modules of Qwen3-MoE (what ModelOpt's exclude list talks about)."""
    return [mod for r in tensor_rules(m) for mod in r.hf_modules()
            if mod.endswith(("_proj", "mlp.gate", "lm_head"))]


def exclude_patterns(unquantized: list[str], quantized: list[str]) -> list[str]:
    """ModelOpt's exclude_modules summary: 'parent*' when that pattern matches no quantized module, else the
    exact name (e.g. 'model.layers.3.self_attn*', 'model.layers.3.mlp.gate', 'lm_head')."""
    ordered = sorted(quantized)

    def matches_quantized(prefix: str) -> bool:
        i = bisect.bisect_left(ordered, prefix)
        return i < len(ordered) and ordered[i].startswith(prefix)

    out = set()
    for name in unquantized:
        parent = name.rsplit(".", 1)[0] if "." in name else None
        out.add(parent + "*" if parent is not None and not matches_quantized(parent) else name)
    return sorted(out)


def hf_quant_config(exclude: list[str]) -> dict:
    """hf_quant_config.json. kv_cache_quant_algo is written as null: SGLang's loader requires the key."""
    return {"producer": _producer(),
            "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": GROUP_SIZE,
                             "exclude_modules": exclude}}


def config_quantization_entry(quant: dict) -> dict:
    """config.json["quantization_config"] as ModelOpt writes it (convert_hf_quant_config_format)."""
    q = quant["quantization"]
    fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": q["group_size"]}
    return {"config_groups": {"group_0": {"input_activations": dict(fp4), "weights": dict(fp4), "targets": ["Linear"]}},
            "ignore": list(q["exclude_modules"]), "quant_algo": q["quant_algo"], "producer": dict(quant["producer"]),
            "quant_method": "modelopt"}


def export_nvfp4(checkpoint: str | Path, out: str | Path, config: Optional[str] = None, overrides: Iterable[str] = (),
                 hf_config: Optional[str] = None, dtype: str = "bfloat16", max_shard_size: str | int = "5GB",
                 calib_tokens: Optional[str] = None, calib_samples: int = 8, calib_seq_len: int = 128,
                 input_amax: Optional[float] = None) -> Path:
    """Export; returns the output directory. Raises ConvertError / CheckpointError (nothing written)."""
    checkpoint, dst = Path(checkpoint).absolute(), require_new_output(out)
    dtype = dtype_name(dtype)
    cfg = checkpoint_config(checkpoint, config, overrides)
    base, side_dir = output_config(checkpoint, cfg.model, hf_config, trained_from(checkpoint))
    if input_amax is not None and input_amax <= 0:
        raise ConvertError(f"--input-amax must be > 0, got {input_amax}")
    _, model = load_checkpoint_model(checkpoint, cfg)
    linears = quantized_linears(model, cfg.quant.targets)
    if input_amax is not None:
        amax = fixed_amax(linears, input_amax)
    else:
        m = cfg.model
        seqs = (read_calibration_tokens(calib_tokens, m.vocab_size, m.max_sequence_length) if calib_tokens
                else random_tokens(calib_samples, min(calib_seq_len, m.max_sequence_length), m.vocab_size))
        amax = activation_amax(model, linears, seqs)
    modules = linear_modules(cfg.model)
    rules = {r.mcore: r for r in tensor_rules(cfg.model)}
    quantized = [mod for name in linears for mod in rules[name].hf_modules()]
    quant = hf_quant_config(exclude_patterns([x for x in modules if x not in set(quantized)], quantized))
    with staged_output(dst) as tmp:
        write_hf_tensors(model, cfg.model, tmp, nvfp4_emitter(cfg.model, DTYPES[dtype], amax), max_shard_size,
                         "export-nvfp4")
        copy_side_files(side_dir, tmp)
        (tmp / "hf_quant_config.json").write_text(json.dumps(quant, indent=4) + "\n")
        config_json = {**with_dtype(base, dtype), "quantization_config": config_quantization_entry(quant)}
        (tmp / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
        (tmp / "qrl_export.json").write_text(json.dumps(
            {"checkpoint": str(checkpoint), "quant_targets": cfg.quant.targets,
             "input_scale_source": ("fixed --input-amax" if input_amax is not None else
                                    f"calibration: {calib_tokens}" if calib_tokens else
                                    f"calibration: {calib_samples} random sequences of {calib_seq_len} tokens"),
             "input_amax": amax}, indent=1) + "\n")
    return dst
