"""The trainer's weights as the engine installs them: the codec's FP4 bytes with a digest per tensor.

Packing and digests run on the trainer's device (quant/wire.py, quant/digest.py): no host copy of the
payload; the routed experts' FP4 bytes come from the grouped experts' QAT quantizer when it quantizes in
the sync's format (models/grouped_experts.py), so one quantization per weight change serves both. A
sharded trainer's weights are gathered into the unsharded model's first (pipeline/gather_weights.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .base import is_sharded, unwrap


def quantized_weight_names(chunks: list[torch.nn.Module], cfg) -> set[str]:
    """Parameter names the engine holds in FP4 (EmbeddedEngine._configure_linears' rule, from the trainer's side)."""
    from megatron_qrl.models import fp4_linears
    from megatron_qrl.rollout.embedded import rollout_quantized
    from megatron_qrl.quant.formats import FP4_FORMATS

    if cfg.rollout.weights not in FP4_FORMATS:
        return set()
    out = set()
    for chunk in chunks:
        names = {id(m): n for n, m in chunk.named_modules()}
        out |= {f"{names[id(lin)]}.weight" for lin in fp4_linears(chunk) if rollout_quantized(lin.site, cfg.quant.targets)}
    return out


def qat_fp4_weights(chunks: list[torch.nn.Module], fmt: str) -> dict:
    """{parameter name: FP4Tensor} that the grouped experts' QAT quantizer holds for the current weights in
    `fmt` (one launch per layer and role; the next training forward reuses the same quantization)."""
    from megatron_qrl.models import grouped_expert_modules

    out = {}
    for chunk in chunks:
        for name, mod in grouped_expert_modules(chunk):
            out.update({f"{name}.{k}": v for k, v in mod.fp4_weights(fmt).items()})
    return out


def local_payload(trainer, cfg):
    """(weights, digests) of this rank's unsharded trainer: the codec's FP4 bytes of the quantized linears,
    the other parameters as they are (no communication). Quantized on the trainer's device -- the experts'
    bytes from their QAT quantizer where it runs in the sync's format, the rest in one codec launch per
    group of equal shapes -- and hashed there (qh128, quant/digest.py)."""
    from megatron_qrl.quant.wire import pack_state

    chunks = unwrap(trainer.model)
    quantized = quantized_weight_names(chunks, cfg)
    fmt = cfg.rollout.weights
    prepacked = qat_fp4_weights(chunks, fmt) if fmt in ("nvfp4", "mxfp4") else {}
    named = ((n, p.detach()) for c in chunks for n, p in c.named_parameters())
    return pack_state(named, fmt, quantized.__contains__, prepacked={n: t for n, t in prepacked.items()
                                                                      if n in quantized})


def trainer_payload(trainer, cfg, everywhere: bool = False):
    """local_payload for an engine elsewhere, under the unsharded model's names. Collective over the trainer
    ranks when the trainer is sharded (gather_weights). Returns (None, None) on every trainer rank but 0,
    the one that sends, unless `everywhere` (colocated engines: every rank installs the full model)."""
    from megatron_qrl.platform import trainer_group
    from megatron_qrl.quant.wire import pack_state

    from ..gather_weights import full_named_parameters, global_names

    if not is_sharded(cfg):
        return local_payload(trainer, cfg) if everywhere or dist.get_rank() == 0 else (None, None)
    chunks = unwrap(trainer.model)
    named = full_named_parameters(chunks)
    group = trainer_group()
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, sorted(global_names(chunks, quantized_weight_names(chunks, cfg))), group=group)
    if not everywhere and dist.get_rank() != 0:
        return None, None
    quantized = {n for p in parts for n in p}
    return pack_state(named.items(), cfg.rollout.weights, quantized.__contains__)
