"""One typed, validated configuration for a megatron-qrl run.

Loaded from YAML, then dotted CLI overrides (`trainer.tensor_parallel=2`) are applied, then every field
and every cross-field combination is validated *before* any process group starts: each section checks its
own fields here, beside them; the rules across sections are megatron_qrl/config_rules.py's, run once every
section is valid. A bad value raises `ConfigError` whose message names the field and the fix.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .config_rules import ConfigError, at_most, check_world_size, cross_section_errors


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _raise_all(errs: list[str]) -> None:
    """A section's own rules report every problem at once (config_rules.py holds those across sections)."""
    if errs:
        raise ValueError("; ".join(errs))


class ModelConfig(_Section):
    """Qwen3-MoE-style decoder: RMSNorm, GQA + QK-norm + RoPE, SwiGLU routed experts (+ optional shared)."""

    num_layers: int = Field(4, ge=1)
    hidden_size: int = Field(128, ge=8)
    num_attention_heads: int = Field(4, ge=1)
    num_query_groups: int = Field(2, ge=1)
    kv_channels: Optional[int] = Field(None, ge=1, description="head dim; default hidden/heads")
    ffn_hidden_size: int = Field(256, ge=1, description="dense MLP size (layers not in moe_layer_freq)")
    num_experts: int = Field(8, ge=0, description="0 = dense model")
    moe_router_topk: int = Field(2, ge=1)
    moe_ffn_hidden_size: int = Field(128, ge=1)
    moe_shared_expert_ffn_hidden_size: int = Field(0, ge=0, description="0 = no shared expert")
    moe_aux_loss_coeff: float = Field(0.0, ge=0)
    qk_layernorm: bool = True
    rotary_base: int = Field(10000, ge=1)
    norm_epsilon: float = Field(1e-6, gt=0)
    vocab_size: int = Field(64, ge=2)
    max_sequence_length: int = Field(128, ge=2)
    init_method_std: float = Field(0.02, gt=0)
    untie_embeddings_and_output_weights: bool = True
    hf_path: Optional[str] = Field(None, description="local Hugging Face model directory: fills the fields above "
                                   "from its config.json, gives the tokenizer and the initial weights "
                                   "(docs/convert.md)")

    @model_validator(mode="before")
    @classmethod
    def _from_hf_path(cls, data: Any):
        """model.hf_path: config.json's architecture fields (a disagreeing field is an error naming both)."""
        if isinstance(data, dict) and data.get("hf_path") is not None:
            from megatron_qrl.convert.hf_model import model_section_from_hf

            return model_section_from_hf(data)
        return data

    @model_validator(mode="after")
    def _shape_rules(self):
        """Attention heads split into whole query groups and head dims; top-k within the experts."""
        errs = []
        if self.num_attention_heads % self.num_query_groups:
            errs.append(f"model.num_query_groups ({self.num_query_groups}) must divide model.num_attention_heads "
                        f"({self.num_attention_heads})")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            errs.append(f"model.hidden_size ({self.hidden_size}) must be divisible by model.num_attention_heads "
                        f"({self.num_attention_heads}), or set model.kv_channels")
        if self.num_experts:
            errs += at_most("model.moe_router_topk", self.moe_router_topk, "model.num_experts", self.num_experts)
        _raise_all(errs)
        return self

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads


class QuantConfig(_Section):
    """FP4 quantization-aware training in the trainer (METHODS.md section 2)."""

    format: Literal["nvfp4", "mxfp4", "bf16"] = "nvfp4"
    qat: bool = True
    targets: Literal["routed_experts", "all_linears"] = "routed_experts"
    scheme: Literal["w4a4", "w4a16"] = "w4a4"


class TrainerConfig(_Section):
    """Megatron-Core trainer: parallel layout, optimizer, schedule."""

    tensor_parallel: int = Field(1, ge=1)
    pipeline_parallel: int = Field(1, ge=1)
    expert_parallel: int = Field(1, ge=1)
    expert_tensor_parallel: int = Field(1, ge=1)
    sequence_parallel: Optional[bool] = Field(None, description="default: on when TP>1 with MoE")
    micro_batch_size: int = Field(4, ge=1)
    moe_experts: Literal["grouped", "sequential"] = Field(
        "grouped", description="routed experts: grouped GEMMs with fused FP4 QAT, or one expert after another")
    lr: float = Field(1e-4, gt=0)
    min_lr: float = Field(0.0, ge=0)
    lr_warmup_steps: int = Field(0, ge=0)
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    weight_decay: float = Field(0.0, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    clip_grad: float = Field(1.0, ge=0)
    bf16: bool = False
    use_distributed_optimizer: bool = True
    seed: int = 1234

    @model_validator(mode="after")
    def _lr_range(self):
        _raise_all(at_most("trainer.min_lr", self.min_lr, "trainer.lr", self.lr))
        return self


class RolloutConfig(_Section):
    """Rollout engine and sampling."""

    engine: Literal["embedded", "sglang"] = "embedded"
    weights: Literal["nvfp4", "mxfp4", "bf16"] = "nvfp4"
    scheme: Literal["w4a4", "w4a16"] = "w4a4"
    kv_cache: Literal["bf16", "fp8", "fp4"] = Field(
        "bf16", description="KV cache format (one scale set per token and KV head); fp8 / fp4 are stored packed on "
                            "CUDA (1.9x / 3.4x less memory than bf16 at head_dim 128), dequantized on CPU")
    placement: Literal["colocated", "disaggregated"] = "colocated"
    num_engine_ranks: int = Field(1, ge=1, description="disaggregated: ranks that run engines")
    group_size: int = Field(8, ge=1, description="responses per prompt (GRPO group)")
    prompts_per_step: int = Field(8, ge=1)
    max_new_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="0 = off")
    max_batch_size: int = Field(256, ge=1, description="continuous batching: concurrent sequences")
    decode: Literal["auto", "graphs", "static", "eager"] = Field(
        "auto", description="embedded engine decode path: auto = CUDA graphs of the static decode step on a GPU "
        "(eager Megatron steps otherwise), graphs, static (the same step without graphs), eager (the reference)")
    decode_window: int = Field(16, ge=1, description="graph decode: steps between host checks (finished rows, "
                               "admission of waiting prompts)")
    max_generate_retries: int = Field(2, ge=0, description="engine failures per step: restart the engine, "
                                      "re-sync weights and retry the batch this many times, then stop")
    seed: int = 0
    sglang_model_path: Optional[str] = Field(None, description="sglang: served checkpoint (NVFP4 ModelOpt export)")
    sglang_server_urls: list[str] = Field([], description="sglang disaggregated: server URLs")
    sglang_router_url: Optional[str] = Field(None, description="sglang disaggregated: sglang_router URL")
    sglang_tp_size: int = Field(1, ge=1, description="sglang: tensor parallel size per engine")
    sglang_mem_fraction: float = Field(0.7, gt=0, lt=1, description="sglang: mem_fraction_static")
    sglang_max_restarts: int = Field(2, ge=0, description="sglang: restarts of a dead server we launched")
    sglang_update_group_addr: str = Field("127.0.0.1", description="sglang: trainer address for weight broadcast")
    sglang_update_group_port: int = Field(29600, ge=1, le=65535, description="sglang: its rendezvous port")
    weight_sync_bucket_mb: float = Field(512.0, gt=0, description="sglang: bytes per weight-sync bucket (MiB)")


class AISConfig(_Section):
    """Adaptive importance sampling constants (METHODS.md section 4)."""

    C: float = Field(2.0, gt=0, description="truncation of rho")
    delta: float = Field(0.05, gt=0, description="divergence at which alpha_mis saturates")
    gamma: float = Field(1.0, gt=0, description="tolerated variance amplification")
    beta: float = Field(0.5, ge=0, description="weight of the variance penalty")


class DynamicSamplingConfig(_Section):
    """DAPO dynamic sampling: prompt groups whose rewards are all equal have zero advantage and carry no gradient;
    they are dropped and more prompts are generated until the batch holds rollout.prompts_per_step groups."""

    enabled: bool = Field(False, description="DAPO dynamic sampling: drop prompt groups whose rewards are all "
                          "equal and generate more prompts to refill the batch (docs/rl.md)")
    max_generate_calls: int = Field(4, ge=1, description="generate calls per step at most (the first included); "
                                    "then the step trains on the groups kept so far")


# peers' KL estimator names (verl) -> ours; the same table as megatron_qrl/rl/kl.py (config imports no torch)
_KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


class RLConfig(_Section):
    """GRPO, the rollout/train mismatch correction, KL to a reference, DAPO options (METHODS.md 4, 7, 8)."""

    is_method: Literal["none", "tis", "mis", "icepop", "ais"] = Field(
        "ais", description="rollout/train mismatch correction: none, tis, mis, icepop or ais")
    is_level: Literal["token", "seq", "geo"] = Field(
        "token", description="unit of the IS correction: token; seq = response with the product of its token "
        "ratios; geo = response with their geometric mean")
    ais: AISConfig = AISConfig()
    tis_C: float = Field(2.0, gt=0)
    mis_U: float = Field(2.0, gt=1)
    mis_level: Literal["token", "sequence"] = Field(
        "token", description="deprecated: sequence = rl.is_level=geo with rl.is_method=mis")
    icepop_low: float = Field(0.5, gt=0)
    icepop_high: float = Field(2.0, gt=0)
    clip_low: float = Field(0.2, ge=0, lt=1)
    clip_high: float = Field(0.28, ge=0)
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = Field(
        "token-mean", description="token-mean: every token weighs the same; seq-mean-token-mean: every response; "
        "seq-mean-token-sum: response sums averaged over responses")
    kl_coef: float = Field(0.0, ge=0, description="weight of the KL to a frozen reference policy; 0 = off (no "
                           "reference is built)")
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="k1 = -l, k2 = l^2/2, k3 = e^l-1-l clipped to [-10, 10] (l = logp_ref - logp); "
        "verl's kl / mse / low_var_kl are accepted")
    kl_mode: Literal["loss", "reward"] = Field(
        "loss", description="loss: kl_coef * KL term in the loss; reward: kl_coef * the response's summed KL "
        "subtracted from its reward before the advantages")
    kl_reference: Optional[str] = Field(
        None, description="checkpoint directory whose weights are the reference; default: the initial policy "
        "(the run writes it as checkpoints/step_000000 when it starts)")
    kl_reference_offload: bool = Field(False, description="keep the reference weights in CPU memory between uses")
    normalize_std: bool = True
    updates_per_batch: int = Field(1, ge=1)
    mask_weight: Literal["rho", "one"] = Field(
        "rho", description="mis/icepop: weight of kept tokens (rho = masked IS, one = pure masking)")
    dynamic_sampling: DynamicSamplingConfig = DynamicSamplingConfig()
    overlong_buffer_len: int = Field(0, ge=0, description="DAPO soft overlong punishment: the reward falls by up "
                                     "to overlong_penalty_factor over the last N tokens before "
                                     "rollout.max_new_tokens; 0 = off")
    overlong_penalty_factor: float = Field(1.0, ge=0, description="reward penalty at rollout.max_new_tokens")
    mask_truncated: bool = Field(False, description="DAPO overlong filtering: responses cut at "
                                 "rollout.max_new_tokens carry no loss")

    @field_validator("kl_estimator", mode="before")
    @classmethod
    def _estimator(cls, name):
        """Our names or peers' (verl's kl / mse / low_var_kl), case-insensitive."""
        key = str(name).lower()
        key = _KL_ALIASES.get(key, key)
        if key not in ("k1", "k2", "k3"):
            raise ValueError(f"unknown KL estimator {name!r}; choose k1, k2 or k3 (k3 = low_var_kl), e.g. "
                             "rl.kl_estimator=k3")
        return key

    @model_validator(mode="before")
    @classmethod
    def _mis_level_alias(cls, data):
        """The deprecated mis_level=sequence means is_level=geo for MIS (what it always computed)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("mis_level") == "sequence" and data.get("is_method", "ais") == "mis" and "is_level" not in data:
            data["is_level"] = "geo"
        return data

    @model_validator(mode="after")
    def _icepop(self):
        if self.icepop_low >= self.icepop_high:
            raise ValueError(
                f"rl.icepop_low ({self.icepop_low}) must be < rl.icepop_high ({self.icepop_high}); "
                "set e.g. rl.icepop_low=0.5 rl.icepop_high=2.0"
            )
        return self


class AQNConfig(_Section):
    """Adaptive quantization noise in RMSNorm weights (METHODS.md section 5)."""

    enabled: bool = True
    sigma_start: float = Field(1e-2, gt=0)
    sigma_end: float = Field(1e-4, gt=0)
    stages: int = Field(10, ge=3, description="K; stage 0 is noise-free")
    apply_to: Literal["rollout", "both"] = "rollout"

    @model_validator(mode="after")
    def _decaying(self):
        _raise_all(at_most("aqn.sigma_end", self.sigma_end, "aqn.sigma_start", self.sigma_start))
        return self


class TraceConfig(_Section):
    """TRACE rollout-guided rounding (METHODS.md section 3)."""

    enabled: bool = True
    num_cached_layers: Optional[int] = Field(None, ge=0, description="deepest N layers; default half")
    memory_budget_mb: float = Field(1024.0, gt=0)
    spill_dir: Optional[str] = None
    fallback_shift: float = Field(0.25, ge=0, le=0.5, description="RTN fallback beyond this shift")


# Megatron's names of the linears a LoRA adapter can wrap (megatron_qrl/models/lora.py): the fused q/k/v
# projection, the attention output (o), the gate/up (fc1) and down (fc2) projections of dense and shared-expert
# MLPs, and the same two of every routed expert.
LORA_TARGET_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "experts.linear_fc1",
                       "experts.linear_fc2")


class LoRAConfig(_Section):
    """QeRL mode: LoRA adapters over a frozen base held packed in FP4 (docs/lora.md). Every decoder linear then
    keeps a frozen base (packed in base_format inside quant.targets, bf16 outside it); only the adapters (and
    the RMSNorm weights with train_norms) get gradients, optimizer state and travel at each weight sync."""

    enabled: bool = False
    rank: int = Field(16, ge=1)
    alpha: float = Field(32.0, gt=0, description="adapter output scale is alpha / rank")
    dropout: float = Field(0.0, description="must be 0: RL needs the trainer and rollout forwards to agree")
    target_modules: list[str] = Field(list(LORA_TARGET_MODULES), description="linears that get adapters, any of "
                                      + ", ".join(LORA_TARGET_MODULES))
    train_norms: bool = Field(False, description="also train (and sync) every RMSNorm weight")
    base_format: Literal["nvfp4", "mxfp4", "bf16"] = Field("nvfp4", description="storage of the frozen base")

    @model_validator(mode="after")
    def _targets(self):
        if self.dropout != 0:
            raise ValueError(f"lora.dropout ({self.dropout}) must be 0: a random adapter mask would make the "
                             "trainer's forward differ from the rollout engine's; set lora.dropout=0")
        unknown = [t for t in self.target_modules if t not in LORA_TARGET_MODULES]
        if unknown:
            raise ValueError(f"lora.target_modules has unknown names {unknown}; use any of "
                             f"{list(LORA_TARGET_MODULES)}")
        if not self.target_modules or len(set(self.target_modules)) != len(self.target_modules):
            raise ValueError("lora.target_modules must list at least one module, each once")
        return self


class R3Config(_Section):
    enabled: bool = True


class DataConfig(_Section):
    """Prompts (synthetic tasks or local files), how they become token ids, and the verifier."""

    task: Literal["arithmetic", "countdown", "jsonl", "parquet", "gsm8k", "math"] = "arithmetic"
    path: Optional[str] = None
    prompt_key: str = Field("prompt", description="prompt column (gsm8k reads 'question', math 'problem' when "
                            "left at 'prompt')")
    answer_key: str = "answer"
    response_key: Optional[str] = Field(None, description="jsonl/parquet: column of reference responses (the SFT "
                                        "warm start's targets)")
    chat_template: Optional[bool] = Field(None, description="wrap prompts in the tokenizer's chat template; default: "
                                          "on when the model.hf_path tokenizer has one")
    system_prompt: Optional[str] = Field(None, description="chat template: a system message before each prompt")
    chat_template_kwargs: dict[str, Any] = Field({}, description="chat template: extra variables, e.g. "
                                                 "{enable_thinking: false} for Qwen3")
    reward: Optional[str] = Field(None, description="user reward 'module:function'")
    eval_size: int = Field(64, ge=1)
    seed: int = 0
    synthetic_size: int = Field(100_000, ge=1, description="arithmetic/countdown: samples per epoch")
    max_operand: int = Field(20, ge=1, description="arithmetic: operands in [0, max_operand)")
    countdown_numbers: int = Field(3, ge=2, description="countdown: numbers per puzzle")
    countdown_max_number: int = Field(10, ge=1, description="countdown: numbers in [1, max]")
    reward_time_limit_s: float = Field(1.0, ge=0, description="per-sample limit for a user reward fn; 0=off")

    @model_validator(mode="after")
    def _file_tasks_have_a_path(self):
        if self.task in ("jsonl", "parquet", "gsm8k", "math") and not self.path:
            raise ValueError(f"data.task={self.task} reads a local file: set data.path=/path/to/file")
        return self


class RunConfig(_Section):
    output_dir: str = Field("runs/tiny_cpu", description="default: runs/<config file name> (runs/tiny_cpu "
                            "without a file); one run per directory (docs/RELIABILITY.md \"Run directories\")")
    total_steps: int = Field(20, ge=1)
    sft_steps: int = Field(0, ge=0, description="SFT warm start when no checkpoint exists")
    sft_lr: Optional[float] = Field(None, gt=0, description="constant LR of the SFT warm start (default trainer.lr)")
    eval_every: int = Field(10, ge=0)
    checkpoint_every: int = Field(10, ge=0, description="a checkpoint every N RL steps; 0 = only the final one "
                                  "(the last step is always saved unless run.save_checkpoints=false)")
    save_checkpoints: bool = Field(True, description="false: write no checkpoint at all (the run cannot be "
                                   "resumed or evaluated afterwards)")
    resume: bool = True
    stop_after_steps: Optional[int] = Field(None, ge=1, description="end this process after N RL steps (e.g. "
                                            "to fit a job's time limit); a rerun resumes from the checkpoint")
    init_checkpoint: Optional[str] = Field(None, description="start from these weights (e.g. `qrl convert "
                                           "hf-to-mcore` output) when the run has no checkpoint of its own")
    wandb_project: str = "megatron-qrl"
    wandb_mode: Optional[Literal["online", "offline", "disabled"]] = None
    max_nonfinite_steps: int = Field(3, ge=1, description="NaN/Inf steps are skipped; more than this many in "
                                     "a row write a checkpoint and stop the run")
    seed: int = 0


class QRLConfig(_Section):
    """The whole run: each section checks its own fields; the rules across sections are config_rules.py's."""

    model: ModelConfig = ModelConfig()
    quant: QuantConfig = QuantConfig()
    trainer: TrainerConfig = TrainerConfig()
    rollout: RolloutConfig = RolloutConfig()
    rl: RLConfig = RLConfig()
    aqn: AQNConfig = AQNConfig()
    trace: TraceConfig = TraceConfig()
    r3: R3Config = R3Config()
    lora: LoRAConfig = LoRAConfig()
    data: DataConfig = DataConfig()
    run: RunConfig = RunConfig()

    @model_validator(mode="after")
    def _cross_checks(self):
        """Once every section is valid on its own: the rules across sections (config_rules.py)."""
        _raise_all(cross_section_errors(self))
        return self

    def check_world_size(self, world_size: int) -> None:
        """Fail before process groups start when the layout cannot tile the world."""
        check_world_size(self, world_size)

    def cached_layers(self) -> list[int]:
        """Indices of the layers whose activation rounding TRACE caches (the deepest ones)."""
        if not self.trace.enabled:
            return []
        n = self.trace.num_cached_layers
        if n is None:
            n = math.ceil(self.model.num_layers / 2)
        return list(range(self.model.num_layers - n, self.model.num_layers))


def _parse_value(text: str) -> Any:
    return yaml.safe_load(text) if text != "" else ""


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b.c=value` overrides (values parsed as YAML scalars) to a nested dict."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form section.field=value "
                              "(e.g. trainer.tensor_parallel=2)")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        node = data
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}': '{p}' is not a section")
        node[parts[-1]] = _parse_value(value)
    return data


def _format_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "config"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field; check the spelling against docs/configuration.md"
        lines.append(f"{loc}: {msg}" + (f" (got {e['input']!r})" if e["type"] != "value_error" and
                                         not isinstance(e.get("input"), dict) else ""))
    return "invalid configuration:\n  " + "\n  ".join(lines)


def from_dict(data: dict) -> QRLConfig:
    try:
        return QRLConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None


def load_config(path: Optional[str | Path] = None, overrides: Optional[list[str]] = None) -> QRLConfig:
    """YAML file (optional) + dotted overrides -> validated QRLConfig."""
    data: dict = {}
    if path is not None:
        data = read_config_file(path)
        run = data.setdefault("run", {})
        if isinstance(run, dict) and "output_dir" not in run:   # one directory per config, not one for all
            run["output_dir"] = f"runs/{Path(path).stem}"
    return from_dict(apply_overrides(data, list(overrides or [])))


def read_config_file(path: str | Path) -> dict:
    """The raw sections of a YAML config file (not validated yet); a missing file, a YAML syntax error or a
    file that is no mapping of sections is a ConfigError naming the file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file '{p}' does not exist; pass --config configs/tiny_cpu.yaml or another "
                          "file under configs/")
    try:
        loaded = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(_yaml_error(p, err)) from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file '{p}' must hold a mapping of sections (model:, trainer:, ...)")
    return loaded


def _yaml_error(path: Path, err: yaml.YAMLError) -> str:
    """'FILE:LINE:COL: YAML syntax error: <problem>' (lines counted from 1, as editors do). The context mark
    (e.g. the key that lacks its ':') comes first: it is where the mistake usually is."""
    context, problem = getattr(err, "context_mark", None), getattr(err, "problem_mark", None)
    mark = context or problem
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    text = "; ".join(str(x) for x in (getattr(err, "context", None), getattr(err, "problem", None)) if x) or str(err)
    if context is not None and problem is not None and problem.line != context.line:
        text += f" (noticed at line {problem.line + 1})"
    return (f"{where}: YAML syntax error: {text}; fix the file there (nested fields are indented under their "
            "section, and 'key: value' needs the space after the colon)")


def dump_config(cfg: QRLConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(), sort_keys=False)
