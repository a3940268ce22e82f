"""The rules that tie config sections together, all in one place; each section checks its own fields in config.py.

Two stages, both before any process group starts:
- `cross_section_errors(cfg)`: what every use of a config needs. QRLConfig runs it once all sections are
  valid, so load_config / from_dict report every combination that cannot work at once, in one ConfigError.
- `check_world_size(cfg, world_size)`: whether the trainer layout tiles the job's trainer ranks (known only
  when the job starts: QRLConfig.check_world_size, platform.init_distributed, the RL job's check_job).
The layouts the RL loop runs (pipeline's check_rl_layout) are the RL job's rules, beside its placement: a
checkpoint conversion or a trainer-only script may use layouts the RL loop does not.
Every message names the fields and the fix. This module imports only the torch-free quant.blocks (config.py
imports it).
"""
from __future__ import annotations

from megatron_qrl.quant.blocks import block_size



class ConfigError(ValueError):
    """An invalid configuration: the message names the field and how to fix it."""


def cross_section_errors(cfg) -> list[str]:
    """Every combination of sections that cannot work (empty when the config is consistent)."""
    return [*_parallel_layout(cfg), *_qat_blocks(cfg), *_lora(cfg), *_rl(cfg), *_trace(cfg), *_rollout(cfg),
            *_data(cfg)]


def _parallel_layout(cfg) -> list[str]:
    """The trainer's TP/PP/EP sizes against the model's heads, layers and experts."""
    m, t = cfg.model, cfg.trainer
    errs = []
    if m.num_attention_heads % t.tensor_parallel:
        errs.append(f"trainer.tensor_parallel ({t.tensor_parallel}) must divide model.num_attention_heads "
                    f"({m.num_attention_heads}); choose a divisor")
    if m.num_query_groups % t.tensor_parallel:
        errs.append(f"trainer.tensor_parallel ({t.tensor_parallel}) must divide model.num_query_groups "
                    f"({m.num_query_groups}); choose a divisor")
    if m.num_layers % t.pipeline_parallel:
        errs.append(f"trainer.pipeline_parallel ({t.pipeline_parallel}) must divide model.num_layers "
                    f"({m.num_layers})")
    if m.num_experts and m.num_experts % t.expert_parallel:
        errs.append(f"trainer.expert_parallel ({t.expert_parallel}) must divide model.num_experts "
                    f"({m.num_experts}); choose a divisor")
    elif not m.num_experts and t.expert_parallel > 1:
        errs.append("trainer.expert_parallel > 1 needs an MoE model: set model.num_experts > 0 "
                    "or trainer.expert_parallel=1")
    if t.sequence_parallel is False and t.tensor_parallel > 1 and m.num_experts:
        errs.append("trainer.sequence_parallel=false with tensor_parallel > 1 and MoE is not supported by "
                    "Megatron-Core; set trainer.sequence_parallel=true (or leave it unset)")
    return errs


def at_most(name: str, value, limit_name: str, limit) -> list[str]:
    """[] when value <= limit, else the message naming both fields (a section's rule or one across sections)."""
    return [f"{name} ({value}) must be <= {limit_name} ({limit})"] if value > limit else []


def _block_errors(cfg, fmt: str, purpose: str, fix: str) -> list[str]:
    """The model's GEMM dimensions (per TP shard) must hold whole `fmt` scale blocks (bf16 has none)."""
    if fmt == "bf16":
        return []
    block, m, tp = block_size(fmt), cfg.model, cfg.trainer.tensor_parallel
    errs = []
    for name, size in [("model.hidden_size", m.hidden_size), ("model.moe_ffn_hidden_size", m.moe_ffn_hidden_size),
                       ("model.ffn_hidden_size", m.ffn_hidden_size)]:
        shard = size // (tp if name != "model.hidden_size" else 1)
        if shard % block:
            errs.append(f"{name} ({size}, per TP shard {shard}) must be a multiple of the {fmt} block ({block}) for "
                        f"{purpose}; pad it or set {fix}")
    return errs


def _qat_blocks(cfg) -> list[str]:
    """FP4 QAT: something to quantize, in whole scale blocks."""
    q, m = cfg.quant, cfg.model
    errs = []
    if not m.num_experts and q.qat and q.format != "bf16" and q.targets == "routed_experts":
        errs.append("quant.targets=routed_experts quantizes nothing in a dense model (model.num_experts=0): "
                    "set quant.targets=all_linears (or quant.qat=false)")
    return errs + _block_errors(cfg, q.format, "FP4 QAT", "quant.format=bf16")


def _lora(cfg) -> list[str]:
    """LoRA mode: the engine runs the trainer's frozen base bytes, so the formats must agree (docs/lora.md)."""
    lo, q, ro = cfg.lora, cfg.quant, cfg.rollout
    if not lo.enabled:
        return []
    errs = []
    if ro.weights != lo.base_format:
        errs.append(f"lora.base_format ({lo.base_format}) must equal rollout.weights ({ro.weights}): "
                    "the engine runs the trainer's frozen base bytes; set both to the same format")
    if lo.base_format == "bf16" and q.qat and q.format != "bf16":
        errs.append("lora.base_format=bf16 has no FP4 weights to train against: set quant.qat=false")
    if lo.base_format != "bf16" and q.qat and q.format not in ("bf16", lo.base_format):
        errs.append(f"quant.format ({q.format}) must equal lora.base_format ({lo.base_format}): with LoRA, "
                    "quant.qat only fake-quantizes activations of the FP4 base's GEMM (its weights are FP4 "
                    "already)")
    if ro.engine != "embedded" or ro.placement != "colocated":
        errs.append("lora.enabled shares the frozen base with an in-process embedded engine: set "
                    "rollout.engine=embedded and rollout.placement=colocated")
    return errs + _block_errors(cfg, lo.base_format, "a packed LoRA base", "lora.base_format=bf16")


def _rl(cfg) -> list[str]:
    """Combinations of the rl section with the rollout that cannot work (docs/rl.md)."""
    rl, ro = cfg.rl, cfg.rollout
    errs = []
    if rl.overlong_buffer_len >= ro.max_new_tokens:
        errs.append(f"rl.overlong_buffer_len ({rl.overlong_buffer_len}) must be < rollout.max_new_tokens "
                    f"({ro.max_new_tokens}): the penalty ramps over the last overlong_buffer_len tokens before "
                    "the limit; lower it (0 = off)")
    if rl.dynamic_sampling.enabled and ro.group_size < 2:
        errs.append("rl.dynamic_sampling.enabled needs rollout.group_size >= 2: a group of one response "
                    "always has equal rewards and would always be dropped")
    if rl.dynamic_sampling.enabled and ro.placement == "disaggregated" and ro.engine == "embedded":
        errs.append("rl.dynamic_sampling.enabled is not supported with rollout.placement=disaggregated and "
                    "rollout.engine=embedded (the engine ranks draw and trace one batch per step); use "
                    "rollout.placement=colocated or rollout.engine=sglang, or set "
                    "rl.dynamic_sampling.enabled=false")
    return errs


def _trace(cfg) -> list[str]:
    """TRACE replays what an FP4 W4A4 engine captured, layer by layer and (MoE) with the captured routing."""
    tr, m, ro = cfg.trace, cfg.model, cfg.rollout
    errs = []
    if tr.num_cached_layers is not None:
        errs += at_most("trace.num_cached_layers", tr.num_cached_layers, "model.num_layers", m.num_layers)
    if not tr.enabled:
        return errs
    if m.num_experts and not cfg.r3.enabled:
        errs.append("trace.enabled with an MoE model needs routing replay: set r3.enabled=true "
                    "(or trace.enabled=false); see METHODS.md section 3.4")
    if ro.weights == "bf16":
        errs.append("trace.enabled needs FP4 rollouts: set rollout.weights=nvfp4 (or trace.enabled=false)")
    if ro.scheme != "w4a4":
        errs.append("trace.enabled needs quantized activations: set rollout.scheme=w4a4 (or trace.enabled=false)")
    if ro.engine == "sglang":
        errs.append("rollout.engine=sglang cannot capture TRACE bits (docs/sglang.md); set trace.enabled=false")
    return errs


def _rollout(cfg) -> list[str]:
    ro, m = cfg.rollout, cfg.model
    if ro.max_new_tokens + 8 > m.max_sequence_length:
        return [f"rollout.max_new_tokens ({ro.max_new_tokens}) leaves no room for prompts in "
                f"model.max_sequence_length ({m.max_sequence_length}); raise the latter"]
    return []


def _data(cfg) -> list[str]:
    d = cfg.data
    if not cfg.model.hf_path and (d.chat_template or d.system_prompt or d.chat_template_kwargs):
        return ["data.chat_template / system_prompt / chat_template_kwargs need a tokenizer with a chat "
                "template: set model.hf_path to a Hugging Face model directory (the default character "
                "tokenizer has none)"]
    return []


# --------------------------------------------------------------------------------------------- job size
def check_world_size(cfg, world_size: int) -> None:
    """The trainer layout tiles `world_size` trainer ranks (data parallel is what remains)."""
    t = cfg.trainer
    mp = t.tensor_parallel * t.pipeline_parallel
    if world_size % mp:
        raise ConfigError(f"trainer.tensor_parallel*trainer.pipeline_parallel ({mp}) must divide the number "
                          f"of trainer ranks ({world_size}); change the layout or the process count")
    dp = world_size // mp
    if (dp * t.tensor_parallel) % (t.expert_parallel * t.expert_tensor_parallel):
        raise ConfigError(f"trainer.expert_parallel*trainer.expert_tensor_parallel "
                          f"({t.expert_parallel * t.expert_tensor_parallel}) must divide data*tensor parallel "
                          f"({dp * t.tensor_parallel}) with {world_size} ranks")
