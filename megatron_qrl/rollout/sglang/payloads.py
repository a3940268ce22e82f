"""Requests to and responses from SGLang's generate API, in the pinned release's shapes.

Both the HTTP `/generate` body and the in-process `Engine.generate(...)` keyword arguments are built
here (their keys are fields of the release's `GenerateReqInput`; tests check that against its source).
A response is one dict per request: `output_ids`, and `meta_info` with `finish_reason`
({"type": "stop"|"length"|"abort", ...}), `output_token_logprobs` (a list of
`[logprob, token_id, text_or_None]`), `routed_experts` (base64 of int32 `[P+T-1, num_hidden_layers,
topk]`, only when requested and the server runs with `--enable-return-routed-experts`) and
`weight_version` (a string). Parsing turns it into the protocol's RolloutSample and refuses anything
that would silently misalign with the trainer.

Log-probs: SGLang computes them after temperature scaling unless the scheduler runs with the
environment variable SGLANG_RETURN_ORIGINAL_LOGPROB=1; the protocol wants the raw-logit policy
log-prob, so the adapter sets that variable for the engines it starts (see `engine_environment`).
"""
from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from ..protocol import RolloutSample, SamplingParams

TOP_K_OFF = -1  # SGLang's "no top-k" (ours is 0)
ORIGINAL_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"


class SGLangResponseError(RuntimeError):
    """A response the adapter cannot turn into a RolloutSample (abort, NaN stop, misaligned fields)."""


def engine_environment() -> dict[str, str]:
    """Environment the SGLang processes need so `output_token_logprobs` are log pi(token) of the raw logits."""
    return {ORIGINAL_LOGPROB_ENV: "1"}


def sglang_sampling_params(sampling: SamplingParams, sampling_seed: Optional[int] = None) -> dict[str, Any]:
    """Our SamplingParams as the release's `SamplingParams` fields.

    SGLang stops on the model's EOS ids as well as on `stop_token_ids` (unless `ignore_eos`, which
    disables both), so with no stop ids we set ignore_eos to keep "length only" semantics; with stop ids,
    pass the model's EOS ids among them (the pipeline passes the tokenizer's). `sampling_seed` is honoured
    by SGLang only under --enable-deterministic-inference.
    """
    params: dict[str, Any] = {
        "temperature": float(sampling.temperature),
        "top_p": float(sampling.top_p),
        "top_k": int(sampling.top_k) if sampling.top_k > 0 else TOP_K_OFF,
        "max_new_tokens": int(sampling.max_new_tokens),
        "stop_token_ids": [int(t) for t in sampling.stop_token_ids],
        "ignore_eos": not sampling.stop_token_ids,
    }
    if sampling_seed is not None:
        params["sampling_seed"] = int(sampling_seed)
    return params


def request_seed(seed: int, index: int) -> int:
    """A per-request seed derived from SamplingParams.seed and the prompt's position (deterministic mode)."""
    return (int(seed) * 1_000_003 + int(index)) % (2 ** 31)


def generate_request(prompt_ids: Sequence[int], sampling: SamplingParams, *, return_routed_experts: bool,
                     sampling_seed: Optional[int] = None) -> dict[str, Any]:
    """One `/generate` body (also the keyword arguments of `Engine.generate` for one prompt)."""
    return {
        "input_ids": [int(t) for t in prompt_ids],
        "sampling_params": sglang_sampling_params(sampling, sampling_seed),
        "return_logprob": bool(sampling.return_logprobs),
        "logprob_start_len": -1,  # -1: output tokens only
        "return_routed_experts": bool(return_routed_experts),
    }


@dataclass(frozen=True)
class RoutingLayout:
    """How to read `meta_info["routed_experts"]`: SGLang records every hidden layer (dense ones too)."""

    num_hidden_layers: int
    topk: int
    num_experts: int
    moe_layers: tuple[int, ...]

    @classmethod
    def from_model_config(cls, model_cfg) -> Optional["RoutingLayout"]:
        """The project's models make every layer MoE when num_experts > 0; None for dense models."""
        if not model_cfg.num_experts:
            return None
        return cls(model_cfg.num_layers, model_cfg.moe_router_topk, model_cfg.num_experts,
                   tuple(range(model_cfg.num_layers)))


def decode_routed_experts(encoded: str, num_forwarded: int, layout: RoutingLayout) -> torch.Tensor:
    """base64 int32 [P+T-1, num_hidden_layers, topk] -> int16 [P+T-1, num_moe_layers, topk] (protocol R3)."""
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError, TypeError) as e:
        raise SGLangResponseError(f"meta_info.routed_experts is not base64: {e}") from e
    per_row = layout.num_hidden_layers * layout.topk
    if len(raw) % 4 or (len(raw) // 4) != num_forwarded * per_row:
        raise SGLangResponseError(
            f"meta_info.routed_experts holds {len(raw)} bytes; expected int32 [{num_forwarded} (P+T-1), "
            f"{layout.num_hidden_layers} layers, {layout.topk} topk] = {num_forwarded * per_row * 4} bytes. "
            "Check that the served model's num_hidden_layers / num_experts_per_tok match model.num_layers / "
            "model.moe_router_topk")
    ids = torch.frombuffer(bytearray(raw), dtype=torch.int32).reshape(num_forwarded, layout.num_hidden_layers,
                                                                        layout.topk)
    ids = ids[:, list(layout.moe_layers)]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= layout.num_experts):
        raise SGLangResponseError(f"routed expert ids outside [0, {layout.num_experts}) in meta_info.routed_experts")
    return ids.to(torch.int16)


def _finish_reason(meta: dict) -> str:
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind == "stop" and isinstance(reason, dict) and reason.get("matched") == "NaN happened":
        raise SGLangResponseError("SGLang stopped the request because the logits held NaN ('NaN happened')")
    if kind in ("stop", "length"):
        return kind
    if kind == "abort":
        raise SGLangResponseError(f"SGLang aborted the request: {reason.get('message')!r} "
                                  f"(status {reason.get('status_code')})")
    raise SGLangResponseError(f"unexpected meta_info.finish_reason {reason!r} (a streamed or unfinished response?)")


def _output_logprobs(meta: dict, tokens: list[int]) -> torch.Tensor:
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise SGLangResponseError("meta_info has no output_token_logprobs although return_logprob was set")
    if len(entries) != len(tokens):
        raise SGLangResponseError(f"{len(entries)} output_token_logprobs for {len(tokens)} output ids")
    values = []
    for t, (entry, token) in enumerate(zip(entries, tokens)):
        logprob, token_id = entry[0], entry[1]
        if int(token_id) != token or logprob is None:
            raise SGLangResponseError(f"output_token_logprobs[{t}] = {entry!r} does not score output id {token}")
        values.append(float(logprob))
    return torch.tensor(values, dtype=torch.float32)


def _weight_version(meta: dict) -> int:
    v = meta.get("weight_version")
    return int(v) if isinstance(v, (int, str)) and str(v).lstrip("-").isdigit() else -1


def parse_generate_response(prompt_ids: Sequence[int], response: dict, sampling: SamplingParams,
                            routing: Optional[RoutingLayout]) -> RolloutSample:
    """One `/generate` (or Engine.generate) result -> RolloutSample; `routing` None = no R3 ids expected."""
    if not isinstance(response, dict) or "meta_info" not in response or "output_ids" not in response:
        raise SGLangResponseError(f"not a generate result (needs output_ids and meta_info): {str(response)[:200]}")
    meta = response["meta_info"]
    tokens = [int(t) for t in response["output_ids"]]
    finish = _finish_reason(meta)
    logprobs = _output_logprobs(meta, tokens) if sampling.return_logprobs else None
    routed = None
    if routing is not None:
        if meta.get("routed_experts") is None:
            raise SGLangResponseError("meta_info has no routed_experts: start the server with "
                                      "--enable-return-routed-experts (or set r3.enabled=false)")
        routed = decode_routed_experts(meta["routed_experts"], len(prompt_ids) + len(tokens) - 1, routing)
    return RolloutSample(prompt_ids=[int(t) for t in prompt_ids], tokens=tokens, logprobs=logprobs,
                         finish_reason=finish, routed_experts=routed, weight_version=_weight_version(meta))
