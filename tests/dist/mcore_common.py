"""Shared pieces of the Megatron-Core multi-process tests: tiny config, deterministic batch, loss.

Kept free of Megatron imports at module level: checkpoint saving may spawn helpers that re-import
__main__, and pytest imports this file for the tolerances.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

# fp32 on CPU: layouts differ only in reduction order (TP all-reduce, EP alltoall, split GEMMs), so
# log-probs agree to ~1e-6; FP4 rounding can amplify a last-bit difference when an element sits on a
# rounding boundary, which the W4A4 tolerance absorbs.
LOGP_ATOL = 2e-4
LOSS_RTOL = 1e-4

B, T = 4, 32
NUM_LAYERS = 2
TOPK = 2
NUM_EXPERTS = 8


def overrides(scheme: str = "w4a4") -> list[str]:
    return [f"model.num_layers={NUM_LAYERS}", "model.hidden_size=64", "model.num_attention_heads=4",
            "model.num_query_groups=2", f"model.num_experts={NUM_EXPERTS}", f"model.moe_router_topk={TOPK}",
            "model.moe_ffn_hidden_size=64", "model.vocab_size=64", "model.max_sequence_length=64",
            "rollout.max_new_tokens=16", "quant.format=nvfp4", "quant.targets=all_linears",
            f"quant.scheme={scheme}", "trainer.micro_batch_size=2", "trainer.lr=3e-3", "trainer.clip_grad=1.0",
            "trainer.seed=1234"]


def layout_overrides(tp=1, pp=1, ep=1, etp=1) -> list[str]:
    return [f"trainer.tensor_parallel={tp}", f"trainer.pipeline_parallel={pp}", f"trainer.expert_parallel={ep}",
            f"trainer.expert_tensor_parallel={etp}"]


def make_cfg(scheme="w4a4", **layout):
    from megatron_qrl.config import load_config

    return load_config(None, overrides(scheme) + layout_overrides(**layout))


def make_batch(replay: bool = True) -> dict:
    import torch

    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 64, (B, T), generator=g)
    lengths = torch.tensor([T, T - 5, T - 9, T - 2])
    loss_mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    loss_mask[:, :4] = 0  # "prompt"
    batch = {"tokens": tokens, "loss_mask": loss_mask, "advantages": torch.tensor([1.0, -0.5, 0.25, -1.0])}
    if replay:
        scores = torch.rand(B, T, NUM_LAYERS, NUM_EXPERTS, generator=g)
        batch["r3_expert_ids"] = scores.topk(TOPK, dim=-1).indices
    return batch


def loss_fn(logp, mb):
    """A GRPO-shaped global token mean: sum over micro-batches and ranks equals the full-batch loss."""
    w = 1.0 + mb["advantages"][:, None]
    loss = -(w * logp * mb["loss_mask"]).sum() / mb["num_global_tokens"]
    return loss, {"tokens": mb["loss_mask"].sum()}


def logprobs_with_aqn(trainer, batch, sigma: float = 0.05, seed: int = 5):
    """Log-probs under one AQN draw from a fixed seed (the same Z on every layout), then noise-free again."""
    import torch

    from megatron_qrl.models import clear_aqn_noise, set_aqn_noise

    set_aqn_noise(trainer.model, sigma, torch.Generator().manual_seed(seed), num_layers=NUM_LAYERS)
    try:
        return trainer.logprobs(batch)
    finally:
        clear_aqn_noise(trainer.model)


def setup_threads() -> None:
    import torch

    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("megatron").setLevel(logging.ERROR)


def write_json(path: str | Path, data: dict) -> None:
    Path(path).write_text(json.dumps(data, indent=1))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def add_repo_to_path() -> None:
    root = str(Path(__file__).resolve().parents[2])
    if root not in sys.path:
        sys.path.insert(0, root)
