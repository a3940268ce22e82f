"""A sharded trainer's parameters as one unsharded model's (the names and shapes the engine's model has).

The embedded engine runs the whole model in one process; a trainer under tensor, pipeline or expert
parallelism holds shards. `full_named_parameters` reassembles them (collective over the trainer ranks):
- tensor parallel: all_gather over the TP group (the expert-TP group for routed experts) along each
  parameter's `partition_dim`; gated fc1 weights hold [gate_shard; up_shard] per rank, so they are
  regathered as [all gate shards; all up shards], the unsharded layout;
- pipeline parallel: `decoder.layers.{i}` is renamed to the layer's global index (TransformerLayer.layer_number)
  and the stages' dictionaries are merged over the pipeline group (embedding first stage, output layer last);
- expert parallel: `local_experts.{i}` is renamed to its global expert index and the dictionaries are merged
  over the expert-parallel group.
Every trainer rank returns the full dictionary. Memory: one full copy per rank (fine for the models this
repository runs; a production sync would stream per layer and gather only on the sending rank).
"""
from __future__ import annotations

import re

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def _is_expert(name: str) -> bool:
    return ".experts." in name


def _gather_tp(t: torch.Tensor, param, name: str, gated: bool) -> torch.Tensor:
    group = ps.get_expert_tensor_parallel_group() if _is_expert(name) else ps.get_tensor_model_parallel_group()
    size = dist.get_world_size(group) if group is not None else 1
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return t
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    dim = getattr(param, "partition_dim", 0)
    if gated and name.endswith("linear_fc1.weight"):
        halves = [p.chunk(2, dim=dim) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
    return torch.cat(parts, dim=dim)


def _global_name(name: str, chunk) -> str:
    m = _LAYER.match(name)
    if m:
        layer = chunk.decoder.layers[int(m.group(1))]
        name = f"decoder.layers.{layer.layer_number - 1}." + name[m.end():]
    e = _EXPERT.search(name)
    if e:
        num_local = chunk.config.num_moe_experts // ps.get_expert_model_parallel_world_size()
        first = ps.get_expert_model_parallel_rank() * num_local
        name = name[:e.start()] + f".local_experts.{first + int(e.group(1))}." + name[e.end():]
    return name


def _merge_over(local: dict, group) -> dict:
    if group is None or dist.get_world_size(group) == 1:
        return local
    from megatron_qrl.trace.transport import comm_device

    from .weight_transport import all_gather_tensors

    device = next(iter(local.values())).device if local else torch.device("cpu")
    merged = all_gather_tensors(local, group, comm_device(group))
    return {k: v.to(device) for k, v in merged.items()}


def full_named_parameters(chunks: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """{unsharded name: full tensor} of the trainer's model chunks (collective over the trainer ranks)."""
    gated = bool(chunks[0].config.gated_linear_unit)
    dense, experts = {}, {}
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            full = _gather_tp(p.detach(), p, name, gated)
            (experts if _is_expert(name) else dense)[_global_name(name, chunk)] = full
    if ps.get_expert_model_parallel_world_size() > 1:
        experts = _merge_over(experts, ps.get_expert_model_parallel_group())
    merged = {**dense, **experts}
    if ps.get_pipeline_model_parallel_world_size() > 1:
        merged = _merge_over(merged, ps.get_pipeline_model_parallel_group())
    return merged


def global_names(chunks: list[torch.nn.Module], local_names) -> set[str]:
    """Local parameter names of this rank's chunks -> their unsharded names (the chunk that owns each)."""
    out = set()
    for chunk in chunks:
        own = dict(chunk.named_parameters())
        out |= {_global_name(n, chunk) for n in local_names if n in own}
    return out
