"""Trainer -> engine weight sync: the codec's FP4 bytes with a digest per tensor, then a fresh AQN draw.

Packing and digests run on the trainer's device (quant/wire.py, quant/digest.py): no host copy of the
payload; the routed experts' FP4 bytes come from the grouped experts' QAT quantizer when it quantizes in
the sync's format (models/grouped_experts.py), so one quantization per weight change serves both.

The engine refuses an update whose bytes do not hash to the sent digests (nothing changes then); after a
successful install we audit that the engine holds exactly the digests we sent (sync/hash_ok). AQN noise
(METHODS.md section 5) is drawn after each sync: the engine's norm weight = trainer weight + fresh Z, never
accumulating; with aqn.apply_to=both the trainer's norms get the same draw (same seed).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megatron_qrl.config import ConfigError
from megatron_qrl.models import clear_aqn_noise, set_aqn_noise
from megatron_qrl.rl import aqn_sigma


def unwrap(trainer_model: list) -> list[torch.nn.Module]:
    """Megatron DDP wrappers -> the GPTModel chunks (parameter names as the engine's model has them)."""
    from megatron.core.utils import unwrap_model

    return unwrap_model(list(trainer_model))   # DDP, then Float16Module (bf16 on GPU)


def is_sharded(cfg) -> bool:
    """The trainer holds shards (TP/PP/EP/ETP > 1): the engine needs the gathered full model."""
    t = cfg.trainer
    return t.tensor_parallel * t.pipeline_parallel * t.expert_parallel * t.expert_tensor_parallel != 1


def check_rl_layout(cfg) -> None:
    """Layouts the RL loop runs: any trainer layout with embedded engines, colocated or disaggregated."""
    if cfg.lora.enabled and cfg.rollout.placement == "disaggregated":
        raise ConfigError("lora.enabled with rollout.placement=disaggregated is not implemented (the adapters-only "
                         "sync runs in-process): use rollout.placement=colocated for QeRL mode")
    t = cfg.trainer
    colocated_sharded = is_sharded(cfg) and cfg.rollout.placement == "colocated"
    if colocated_sharded and (cfg.lora.enabled or cfg.rollout.engine != "embedded"):
        what = "lora.enabled" if cfg.lora.enabled else f"rollout.engine={cfg.rollout.engine}"
        raise ConfigError(
            f"{what} with a sharded colocated trainer (trainer.tensor_parallel={t.tensor_parallel}, pipeline_parallel="
            f"{t.pipeline_parallel}, expert_parallel={t.expert_parallel}) is not implemented: use data parallelism "
            "only, or rollout.placement=disaggregated")
    if t.expert_parallel > 1 and t.tensor_parallel > 1 and cfg.trace.enabled:
        raise ConfigError("TRACE replay under trainer.expert_parallel>1 together with tensor_parallel>1 is not "
                         "implemented (each dispatch source holds a sequence shard; trace/lookup.py ExpertSources): "
                         "set trace.enabled=false or trainer.tensor_parallel=1")


def aqn_seed(run_seed: int, step: int) -> int:
    return (run_seed * 1_000_003 + step) % (2 ** 31)


def step_aqn_sigma(cfg, step: int) -> float:
    """This step's AQN noise std (0 when AQN is off)."""
    return aqn_sigma(step, cfg.run.total_steps, cfg.aqn) if cfg.aqn.enabled else 0.0


def noise_free(cfg):
    """The config with AQN off: evaluation scores the policy itself, as `qrl eval` of its checkpoint does."""
    return cfg.model_copy(update={"aqn": cfg.aqn.model_copy(update={"enabled": False})})


def holds_digests(held, hashes) -> float:
    """The post-sync audit: 1.0 when the engine holds exactly the digests that were sent."""
    return float(held is not None and all(held.get(n) == h for n, h in hashes.items()))


def set_trainer_aqn(trainer, cfg, step: int) -> float:
    """The trainer's side of AQN for `step`: the engine's draw too (apply_to=both) or none; returns sigma."""
    sigma = step_aqn_sigma(cfg, step)
    if cfg.aqn.enabled and cfg.aqn.apply_to == "both":
        set_aqn_noise(unwrap(trainer.model), sigma, generator=torch.Generator().manual_seed(aqn_seed(cfg.run.seed, step)))
    else:
        clear_aqn_noise(unwrap(trainer.model))
    return sigma


def quantized_weight_names(chunks: list[torch.nn.Module], cfg) -> set[str]:
    """Parameter names the engine holds in FP4 (EmbeddedEngine._configure_linears' rule, from the trainer's side)."""
    from megatron_qrl.models import fp4_linears
    from megatron_qrl.rollout.embedded import rollout_quantized
    from megatron_qrl.rollout.weights import FP4_FORMATS

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

    from .gather_weights import full_named_parameters, global_names

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


def sync_weights(engine, trainer, cfg, step: int, version: int) -> dict:
    """Install the trainer's weights in the engine and draw this step's AQN noise; returns metrics."""
    if cfg.lora.enabled:  # QeRL mode: base linked once, adapters (+ norms) per step
        from .lora_sync import sync_lora

        return sync_lora(engine, trainer, cfg, step, version)
    if cfg.rollout.engine == "sglang":  # FP4 bytes + digests under Megatron names; the adapter maps them to HF
        from .sglang_rollouts import sync_sglang

        return sync_sglang(engine, trainer, cfg, step, version)
    t0 = time.perf_counter()
    # a colocated engine beside a sharded trainer: every rank gathers the full model; unsharded: this rank's
    # payload (EmbeddedEngine.sync_from_model's, with the QAT quantizer's expert bytes reused)
    weights, hashes = trainer_payload(trainer, cfg, everywhere=True) if is_sharded(cfg) else local_payload(trainer, cfg)
    engine.update_weights(weights, version, hashes)
    hash_ok = holds_digests(getattr(getattr(engine, "store", None), "digests", None), hashes)
    sigma = set_trainer_aqn(trainer, cfg, step)
    engine.set_aqn_noise(sigma, aqn_seed(cfg.run.seed, step))
    store = getattr(engine, "store", None)
    return {"sync/s": time.perf_counter() - t0, "sync/hash_ok": hash_ok, "sync/tensors": float(len(hashes)),
            "sync/bytes": float(store.nbytes()) if store is not None else float("nan"), "aqn/sigma": sigma}
