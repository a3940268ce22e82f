"""What every rollout engine promises the RL loop: the RolloutEngine protocol and its data types.

The embedded engine (megatron_qrl.rollout.embedded) and the SGLang adapter implement the same protocol,
so the loop never knows which one it drives. Position conventions used by every field below:

- A sample's full sequence is `prompt_ids + tokens` (P + T ids). The engine forwards positions
  0 .. P+T-2 (the last sampled token is never fed back), so per-position records (routing, TRACE) have
  exactly P+T-1 rows, row i = the forward of input position i. The trainer's forward over the same
  P+T-1 inputs lines up row for row; the logits at row P-1+t give generated token t.
- `logprobs[t]` = log_softmax(logits at row P-1+t)[tokens[t]] computed from the raw logits in float32:
  temperature 1, no top-k / top-p filtering, AQN noise and FP4 numerics of the engine included. That is
  log pi_rollout(token) of METHODS.md section 4 -- the policy the trainer optimises -- not the log-prob of
  the (temperature / nucleus distorted) distribution the token was drawn from. With temperature 1 and no
  filtering the two coincide.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Mapping, Optional, Protocol, Union, runtime_checkable

import torch

if TYPE_CHECKING:
    from megatron_qrl.quant.wire import FP4Tensor

FinishReason = Literal["stop", "length"]


class WeightUpdateError(ValueError):
    """A weight update was refused; the engine's weights and version are unchanged."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. temperature 0 = greedy; top_k 0 = off; top_p 1 = off; top-k and top-p compose."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    return_logprobs: bool = True
    # global index of the first prompt: a data-parallel shard then draws exactly what one engine would
    index_offset: int = 0

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must lie in (0, 1] (1 = off), got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_config(cls, rollout_cfg, stop_token_ids=(), **overrides) -> "SamplingParams":
        """From QRLConfig.rollout (temperature, top_p, top_k, max_new_tokens, seed)."""
        base = dict(temperature=rollout_cfg.temperature, top_p=rollout_cfg.top_p, top_k=rollout_cfg.top_k,
                    max_new_tokens=rollout_cfg.max_new_tokens, seed=rollout_cfg.seed,
                    stop_token_ids=tuple(stop_token_ids))
        base.update(overrides)
        return cls(**base)


@dataclass
class ActivationCapture:
    """TRACE payload of one quantized activation site role (e.g. routed-expert fc1) in one layer.

    Rows follow the sample's forwarded positions (N = P+T-1). Routed-expert roles ("fc1", "fc2") have a
    second index, the expert slot j: the input of expert routed_experts[row, moe_layer, j] (the router's
    top-k order). Dense roles ("qkv", "proj", "shared_fc1", "shared_fc2"; captured only when
    quant.targets=all_linears quantizes them) have no slot index. Each row was quantized with codes whose
    mantissa bits are `bits` and scales `scales` / `global_scale` -- exactly what
    `nvfp4_quantize(..., rounding="guided")` replays:
      bits          uint8 [N, (k,) K/8]   (8 mantissa bits per byte, LSB first)
      scales        NVFP4: float8_e4m3fn [N, (k,) K/16]; MXFP4: uint8 E8M0 [N, (k,) K/32]
      global_scale  NVFP4: fp32 [N, (k)] (the per-tensor scale of the engine tensor the row was in); MXFP4: None
      codes         uint8 [N, (k,) K/2] packed E2M1 codes, only with EmbeddedEngine(keep_codes=True) (tests)
    A replay must quantize each row with its own global scale: rows of one engine step (and expert)
    share one, rows of different steps do not (rollout.capture.guided_requantize does the grouping).
    """

    format: str
    bits: torch.Tensor
    scales: torch.Tensor
    global_scale: Optional[torch.Tensor]
    codes: Optional[torch.Tensor] = None

    @property
    def num_rows(self) -> int:
        return self.bits.shape[0]

    def to(self, device) -> "ActivationCapture":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return ActivationCapture(self.format, move(self.bits), move(self.scales), move(self.global_scale),
                                 move(self.codes))

    def nbytes(self) -> int:
        n = self.bits.numel() + self.scales.numel() * self.scales.element_size()
        return n + (self.global_scale.numel() * 4 if self.global_scale is not None else 0)


# layer index (global, 0-based) -> site role ("fc1", "fc2", and dense roles under all_linears) -> capture
TraceCapture = dict[int, dict[str, ActivationCapture]]


@dataclass
class RolloutSample:
    """One generated response and everything the trainer needs to score it against the rollout.

    routed_experts: int16 [P+T-1, num_moe_layers, topk], the router's own top-k ids per forwarded
        position and MoE layer (R3), None for dense models or when the engine does not record them.
    trace: TRACE captures of the cached layers (empty when TRACE is off, and once the sample left its engine).
    trace_handle: the sample's global index in its step (set by the engine's TRACE recorder, which keeps the
        captures under it: what travels to the trainer is the handle; -1: none).
    """

    prompt_ids: list[int]
    tokens: list[int]
    logprobs: Optional[torch.Tensor]
    finish_reason: FinishReason
    routed_experts: Optional[torch.Tensor] = None
    trace: TraceCapture = field(default_factory=dict)
    weight_version: int = -1
    trace_handle: int = -1

    @property
    def num_forwarded(self) -> int:
        return len(self.prompt_ids) + len(self.tokens) - 1

    @property
    def sequence(self) -> list[int]:
        return list(self.prompt_ids) + list(self.tokens)

    def routed_experts_padded(self, length: int) -> torch.Tensor:
        """long [length, L, k] R3 ids for a trainer row of `length` >= P+T-1 tokens (batch['r3_expert_ids']).

        Rows past the forwarded positions (the last generated token, right padding) repeat the last row:
        valid expert ids, as the replaying router requires, at positions whose outputs never enter a loss.
        """
        if self.routed_experts is None:
            raise ValueError("this sample has no routed experts (dense model or routing not recorded)")
        ids = self.routed_experts.long()
        if length < ids.shape[0]:
            raise ValueError(f"length {length} is shorter than the {ids.shape[0]} forwarded positions")
        return torch.cat([ids, ids[-1:].expand(length - ids.shape[0], *ids.shape[1:])], dim=0)


WeightPayload = Union[torch.Tensor, "FP4Tensor"]  # FP4Tensor: megatron_qrl.quant.wire


@runtime_checkable
class RolloutEngine(Protocol):
    """The engine interface the RL loop drives (embedded FP4 engine, SGLang adapter)."""

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[RolloutSample]:
        """One sample per prompt, in prompt order. Repeat a prompt G times for a GRPO group."""
        ...

    def update_weights(self, weights: Mapping[str, WeightPayload], version: int,
                       hashes: Mapping[str, str]) -> None:
        """Install new weights. Every tensor must come with `hashes[name] == tensor_digest(payload)`;
        on any mismatch, unknown name or shape error raise WeightUpdateError and change nothing."""
        ...

    def release_memory(self) -> None:
        """Colocated mode: free weights / KV cache memory while the trainer runs."""
        ...

    def resume_memory(self) -> None:
        """Re-acquire what release_memory freed (weights come back unchanged)."""
        ...

    def health(self) -> dict:
        """Cheap status: weight version, memory state, device, counters."""
        ...
