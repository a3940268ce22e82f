"""The trainer's batch format, data-parallel sharding and micro-batching.

A batch is a dict; every rank passes the same *global* batch (the RL loop has it everywhere):
    tokens         long  [B, T]   prompt + response, right-padded (required)
    loss_mask      float [B, T]   1 on tokens that enter the loss (default: all ones)
    position_ids   long  [B, T]   optional; must be 0..T-1 per row: Megatron's RoPE uses positions
                                  0..T-1, so sequences start at position 0 (right padding only)
    r3_expert_ids  long  [B, T, L, k]  optional R3 replay: expert ids the rollout used for input token t
                                  at MoE layer l (global layer index), applied when cfg.r3.enabled
    r3_mask        float [B, T]   optional: 1 where those ids are the engine's (0: tokens it never routed);
                                  r3/router_agreement counts only these (and never padding)
    any other tensor whose first dim is B (advantages [B], logp_old [B, T], ...) is sliced per
    micro-batch and handed to the loss function; other values pass through unchanged.

TRACE guides are not part of the batch: the Trainer's replay (`Trainer(cfg, trace=...)`, trace/guidance.py)
serves each micro-batch by its sample_ids (global batch) and batch_rows (padded batch).

The trainer adds per micro-batch: sample_ids [mb] (global indices, -1 for padding), batch_rows [mb] (rows
of the padded batch), sample_mask [mb] (0 for padding samples), num_global_tokens (sum of loss_mask over the
real global batch), num_global_samples (B) and num_real_positions (T before the sequence-parallel padding).

Sharding: B is padded (with copies of sample 0, loss_mask 0, sample_mask 0) to a multiple of
dp * micro_batch_size; data-parallel rank r takes the contiguous slice r of dp slices, then splits it
into micro-batches. T is padded to a multiple of the tensor-parallel size under sequence parallelism.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

RESERVED = ("tokens", "loss_mask", "position_ids", "r3_expert_ids")


class BatchError(ValueError):
    """A malformed batch: the message names the key and the expected shape."""


@dataclass
class ShardedBatch:
    micro_batches: list          # list of dicts for this DP rank
    global_size: int             # real B (before padding)
    padded_size: int             # B after padding to dp * micro_batch_size
    seq_len: int                 # real T
    padded_seq_len: int          # T after padding for sequence parallelism
    dp_rank: int
    dp_size: int


def validate(batch: dict) -> tuple[int, int]:
    if "tokens" not in batch:
        raise BatchError("batch needs 'tokens' (long [B, T])")
    if "trace_guides" in batch:
        raise BatchError("batch['trace_guides'] is gone: TRACE guides come from the trainer's replay; build the "
                         "trainer with Trainer(cfg, trace=TraceReplay.for_config(cfg)) (or set trainer.trace = "
                         "TraceReplay.serving(guides)) and pass the batch without it")
    tokens = batch["tokens"]
    if not torch.is_tensor(tokens) or tokens.dim() != 2 or tokens.dtype not in (torch.long, torch.int32):
        raise BatchError(f"batch['tokens'] must be an integer tensor [B, T], got "
                         f"{getattr(tokens, 'dtype', type(tokens))} {tuple(getattr(tokens, 'shape', ()))}")
    B, T = tokens.shape
    if "loss_mask" in batch and tuple(batch["loss_mask"].shape) != (B, T):
        raise BatchError(f"batch['loss_mask'] must be [B, T] = {(B, T)}, got {tuple(batch['loss_mask'].shape)}")
    if batch.get("position_ids") is not None:
        pos = batch["position_ids"]
        if tuple(pos.shape) != (B, T) or not torch.equal(pos.cpu(), torch.arange(T).expand(B, T)):
            raise BatchError("batch['position_ids'] must be 0..T-1 on every row: Megatron's RoPE uses positions "
                             "0..T-1, so right-pad sequences (prompt at position 0) instead of left padding")
    ids = batch.get("r3_expert_ids")
    if ids is not None and (ids.dim() != 4 or tuple(ids.shape[:2]) != (B, T)):
        raise BatchError(f"batch['r3_expert_ids'] must be long [B, T, num_layers, topk], got {tuple(ids.shape)}")
    return B, T


def _pad_rows(x: torch.Tensor, n: int, zero: bool) -> torch.Tensor:
    if n == 0:
        return x
    fill = torch.zeros_like(x[:1]) if zero else x[:1]
    return torch.cat([x, fill.expand(n, *x.shape[1:])], dim=0)


def _pad_seq(x: torch.Tensor, n: int, repeat_last: bool) -> torch.Tensor:
    if n == 0:
        return x
    pad = x[:, -1:] if repeat_last else torch.zeros_like(x[:, :1])
    return torch.cat([x, pad.expand(x.shape[0], n, *x.shape[2:])], dim=1)


def rows_per_dp_rank(num_samples: int, dp_size: int, micro_batch_size: int = 1) -> int:
    """Rows of the padded batch each data-parallel rank runs: B split evenly, rounded up to micro-batches."""
    per_rank = -(-num_samples // dp_size)
    return -(-per_rank // micro_batch_size) * micro_batch_size


def shard(batch: dict, dp_rank: int, dp_size: int, micro_batch_size: int, seq_multiple: int = 1,
          device: torch.device | None = None) -> ShardedBatch:
    """Pad, take this data-parallel rank's slice and cut it into micro-batches."""
    B, T = validate(batch)
    per_rank = rows_per_dp_rank(B, dp_size, micro_batch_size)
    Bp = per_rank * dp_size
    Tp = -(-T // seq_multiple) * seq_multiple
    loss_mask = batch.get("loss_mask")
    loss_mask = torch.ones(B, T) if loss_mask is None else loss_mask.float()
    num_global_tokens = float(loss_mask.sum())

    tensors: dict[str, torch.Tensor] = {
        "tokens": batch["tokens"].long(), "loss_mask": loss_mask,
        "sample_mask": torch.ones(B), "sample_ids": torch.arange(B), "batch_rows": torch.arange(B)}
    if batch.get("r3_expert_ids") is not None:
        tensors["r3_expert_ids"] = batch["r3_expert_ids"].long()
    extras: dict[str, Any] = {}
    for k, v in batch.items():
        if k in RESERVED:
            continue
        if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == B:
            tensors[k] = v
        else:
            extras[k] = v
    for k, v in list(tensors.items()):
        v = _pad_rows(v, Bp - B, zero=k in ("loss_mask", "sample_mask", "r3_mask"))
        if k == "sample_ids" and Bp > B:
            v = v.clone()
            v[B:] = -1
        if k == "batch_rows":   # the padded batch's row index: which micro-batch this is, padding included
            v = torch.arange(Bp)
        if Tp != T and v.dim() >= 2 and v.shape[1] == T:  # per-token tensors
            v = _pad_seq(v, Tp - T, repeat_last=k == "r3_expert_ids")
        tensors[k] = v

    lo = dp_rank * per_rank
    mbs = []
    for start in range(lo, lo + per_rank, micro_batch_size):
        mb = {k: v[start:start + micro_batch_size] for k, v in tensors.items()}
        if device is not None:
            mb = {k: (v.to(device) if k not in ("sample_ids", "batch_rows") else v) for k, v in mb.items()}
        mb.update(extras)
        mb["position_ids"] = torch.arange(Tp, device=mb["tokens"].device).expand(mb["tokens"].shape[0], Tp)
        mb["num_global_tokens"] = num_global_tokens
        mb["num_global_samples"] = B
        mb["num_real_positions"] = T      # positions >= T pad T for sequence parallelism
        mbs.append(mb)
    return ShardedBatch(mbs, B, Bp, T, Tp, dp_rank, dp_size)


def replay_ids_for_router(ids_bt: torch.Tensor, tp_rank: int, tp_size: int, sequence_parallel: bool
                          ) -> torch.Tensor:
    """[mb, T, k] replay ids of one layer -> [tokens, k] in Megatron's router order ([s, b] flattened,
    this rank's sequence shard under sequence parallelism)."""
    sb = ids_bt.transpose(0, 1)
    if sequence_parallel and tp_size > 1:
        chunk = sb.shape[0] // tp_size
        sb = sb[tp_rank * chunk:(tp_rank + 1) * chunk]
    return sb.reshape(-1, sb.shape[-1]).contiguous()


def token_logprobs(nll: torch.Tensor) -> torch.Tensor:
    """Megatron's per-position next-token NLL [b, s] -> token-aligned log-probs [b, s] (logp[:, 0] = 0)."""
    return torch.cat([torch.zeros_like(nll[:, :1]), -nll[:, :-1]], dim=1)
