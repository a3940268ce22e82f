"""TRACE acceptance measurements on one process: rollout vs trainer log-probs with and without guidance.

    python tools/trace_eval.py [--config configs/tiny_cpu.yaml] [--layers 0,half,all] [overrides ...]

One trainer, one embedded engine, one weight sync (AQN sigma 0), one generate() with TRACE capture of
every layer; then the trainer's per-token log-probs of the rollout batch (R3 replay on) under:
    qat        independent QAT (no guides)
    trace_N    TRACE guides for the deepest N layers (trace_half: the default half)
with mean and max |log pi_train - log pi_rollout| over response tokens, the cache's bits/element and the
code mismatch before/after guidance. tests/test_trace_acceptance.py asserts on the same measurement
(self-contained there); docs/trace.md "Acceptance" has the numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional

import torch


def acceptance_config(base: Optional[str] = "configs/tiny_cpu.yaml", overrides: Optional[list[str]] = None):
    """The run config with TRACE capturing every layer (the bridge restricts to fewer layers later)."""
    from megatron_qrl.config import load_config

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = base if base is None or os.path.isabs(base) else os.path.join(root, base)
    cfg = load_config(path, ["aqn.enabled=false", "trace.enabled=true", "r3.enabled=true",
                             "rollout.weights=nvfp4", "rollout.scheme=w4a4", *(overrides or [])])
    n = cfg.model.num_layers
    return cfg.model_copy(update={"trace": cfg.trace.model_copy(update={"num_cached_layers": n})})


def with_cached_layers(cfg, n: Optional[int]):
    """cfg with trace.num_cached_layers=n (n=None: the default half; n=0: TRACE off)."""
    if n == 0:
        return cfg.model_copy(update={"trace": cfg.trace.model_copy(update={"enabled": False})})
    return cfg.model_copy(update={"trace": cfg.trace.model_copy(update={"enabled": True, "num_cached_layers": n})})


def build(cfg):
    """Trainer + engine (one sync, AQN sigma 0) and the tokenizer; nothing generated yet."""
    from megatron_qrl.data import CharTokenizer
    from megatron_qrl.pipeline import sync_weights
    from megatron_qrl.rollout.embedded import EmbeddedEngine
    from megatron_qrl.trainer import Trainer

    torch.manual_seed(cfg.trainer.seed)
    trainer = Trainer(cfg)
    engine = EmbeddedEngine(cfg)
    m = sync_weights(engine, trainer, cfg, step=0, version=0)
    assert m["aqn/sigma"] == 0.0 and m["sync/hash_ok"] == 1.0, m
    return trainer, engine, CharTokenizer()


def prompts_for(cfg, num_prompts: int, group_size: int):
    from megatron_qrl.data import build_datasets

    train_set, _ = build_datasets(cfg.data)
    prompts = [train_set[i] for i in range(num_prompts)]
    return [p for p in prompts for _ in range(group_size)]


def generate(cfg, engine, tokenizer, samples, seed: int = 0, temperature: float = 1.0,
             max_new_tokens: Optional[int] = None):
    from megatron_qrl.pipeline import encode_prompts
    from megatron_qrl.rollout.protocol import SamplingParams

    sp = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens or cfg.rollout.max_new_tokens,
                        stop_token_ids=(tokenizer.eos_id,), seed=seed)
    t0 = time.perf_counter()
    outs = engine.generate(encode_prompts(tokenizer, samples), sp)
    return outs, time.perf_counter() - t0


def rollout_batch(cfg, tokenizer, samples, rollouts):
    from megatron_qrl.data import task_reward
    from megatron_qrl.pipeline import build_batch

    return build_batch(samples, rollouts, tokenizer, cfg.rollout.group_size, cfg.rl.normalize_std,
                       cfg.data.reward or task_reward(cfg.data), cfg.data.reward_time_limit_s)


def mean_abs_diff(logp, batch) -> float:
    m = batch.loss_mask
    return float(((logp.float().cpu() - batch.logp_rollout).abs() * m).sum() / m.sum())


def trainer_logprobs(cfg, trainer, batch, num_cached_layers: Optional[int]):
    """(logp [B, T], TRACE metrics) with guides for the deepest num_cached_layers layers (0: plain QAT)."""
    from megatron_qrl.pipeline import trainer_batch
    from megatron_qrl.trace import local_replay

    trainer.trace = local_replay(with_cached_layers(cfg, num_cached_layers), batch.rollouts, batch)
    logp = trainer.logprobs(trainer_batch(batch))
    return logp, (trainer.trace.metrics() if trainer.trace is not None else {})


def evaluate(cfg, num_prompts: int = 8, group_size: int = 4, seed: int = 0, layer_counts=(0, None, -1),
             temperature: float = 1.0) -> dict:
    """layer_counts: 0 = independent QAT, None = the default half, -1 = all layers, n = the deepest n."""
    trainer, engine, tok = build(cfg)
    samples = prompts_for(cfg, num_prompts, group_size)
    rollouts, rollout_s = generate(cfg, engine, tok, samples, seed=seed, temperature=temperature)
    batch = rollout_batch(cfg, tok, samples, rollouts)
    out = {"response_tokens": batch.num_response_tokens, "rollout_s": rollout_s}
    L = cfg.model.num_layers
    for n in layer_counts:
        n_eff = L if n == -1 else n
        logp, m = trainer_logprobs(cfg, trainer, batch, n_eff)
        name = "qat" if n_eff == 0 else f"trace_{'half' if n_eff is None else n_eff}"
        diff = (logp.float().cpu() - batch.logp_rollout).abs() * batch.loss_mask
        out[name] = {"logp_abs_diff": mean_abs_diff(logp, batch), "logp_abs_diff_max": float(diff.max()), **m}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/tiny_cpu.yaml")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", default="0,half,all",
                   help="comma list of cached-layer counts: 0 (independent QAT), half (default), all, or n")
    p.add_argument("--json", default=None)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    cfg = acceptance_config(a.config, a.overrides)
    counts = [None if x == "half" else -1 if x == "all" else int(x) for x in a.layers.split(",")]
    res = evaluate(cfg, a.prompts, a.group, a.seed, layer_counts=counts)
    text = json.dumps(res, indent=1, default=float)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
