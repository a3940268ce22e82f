"""`model.hf_path` weights: the model directory's safetensors straight into a (sharded) trainer's parameters.

No intermediate Megatron checkpoint: each trainer rank walks its own parameters, names each by its unsharded
name (global layer and expert index, pipeline/gather_weights.py's rule), builds the full tensor with the
converter's Qwen3 mapping (convert/qwen3_moe.py: q/k/v grouped per KV head, [gate; up]) from the
memory-mapped shards, and keeps its tensor-parallel slice - the inverse of gather_weights:
- tensor parallel: the slice `rank` of `partition_dim` (the expert-TP group for routed experts); gated fc1
  weights hold [gate_shard; up_shard] per rank;
- pipeline / expert parallel: a rank holds only its layers / experts and reads only their tensors.
The HF tensor set and every shape are checked first (import_hf.check_hf_tensors), so a wrong directory fails
before any parameter changes. Afterwards the optimizer's main copies are reloaded and the FP4 weight caches
dropped, as after a checkpoint load.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from .errors import ConvertError
from .import_hf import check_hf_tensors
from .qwen3_moe import merge, tensor_rules
from .safetensors_io import SafetensorsReader

EMBEDDING = "embedding.word_embeddings.weight"


def _tp_group(name: str):
    from megatron.core import parallel_state as ps

    return ps.get_expert_tensor_parallel_group() if ".experts." in name else ps.get_tensor_model_parallel_group()


def local_slice(full: torch.Tensor, param: torch.nn.Parameter, name: str, gated: bool) -> torch.Tensor:
    """This rank's tensor-parallel part of the unsharded tensor `full` of parameter `name`."""
    group = _tp_group(name)
    size = dist.get_world_size(group) if group is not None else 1
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    rank, dim = dist.get_rank(group), getattr(param, "partition_dim", 0)
    if full.shape[dim] % size:
        raise ConvertError(f"'{name}' has {full.shape[dim]} rows/columns along its tensor-parallel dimension, not "
                           f"divisible by the tensor-parallel size {size}; choose another trainer.tensor_parallel")
    if gated and name.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2, dim=dim)
        return torch.cat([gate.chunk(size, dim=dim)[rank], up.chunk(size, dim=dim)[rank]], dim=dim)
    return full.chunk(size, dim=dim)[rank]


def _rule_of(global_name: str, rules: dict, tied: bool):
    if global_name in rules:
        return rules[global_name]
    if tied and global_name == "output_layer.weight":   # last pipeline stage's copy of the tied embedding
        return rules[EMBEDDING]
    raise ConvertError(f"parameter '{global_name}' has no Qwen3 mapping rule; update "
                       "megatron_qrl/convert/qwen3_moe.py")


@torch.no_grad()
def load_hf_weights(trainer, hf_dir: str | Path) -> int:
    """Fill every parameter of `trainer` (any TP/PP/EP layout) from the safetensors of `hf_dir`; returns the
    number of parameters set on this rank. Raises ConvertError before changing anything on bad input."""
    from megatron_qrl.models import weights_changed
    from megatron_qrl.pipeline.gather_weights import _global_name

    cfg, hf_dir = trainer.cfg, Path(hf_dir)
    if cfg.lora.enabled:
        raise ConvertError("model.hf_path weights cannot initialise a LoRA model (its base is packed FP4); convert "
                           "with `qrl convert hf-to-mcore` and start from run.init_checkpoint, or set "
                           "lora.enabled=false")
    m = cfg.model
    rules = {r.mcore: r for r in tensor_rules(m)}
    tied = not m.untie_embeddings_and_output_weights
    chunks = trainer.unwrapped
    gated = bool(chunks[0].config.gated_linear_unit)
    count = 0
    with SafetensorsReader(hf_dir) as reader:
        check_hf_tensors(reader, list(rules.values()), m, hf_dir)
        plan = []
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                plan.append((name, param, _rule_of(_global_name(name, chunk), rules, tied)))
        for name, param, rule in plan:
            full = merge(rule, [reader.get(n) for n in rule.hf], m)
            part = local_slice(full, param, name, gated)
            if tuple(part.shape) != tuple(param.shape):
                raise ConvertError(f"'{name}': the HF tensors give {list(part.shape)} on this rank, the model has "
                                   f"{list(param.shape)}; the layer spec and the mapping disagree")
            param.data.copy_(part)
            count += 1
    trainer.optimizer.reload_model_params()   # mixed precision: the fp32 main copies follow the new weights
    weights_changed()                          # cached fake-quant FP4 weights are stale
    return count
