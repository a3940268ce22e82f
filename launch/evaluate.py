"""`qrl eval CKPT [--config C] [--task T] [overrides]`: held-out accuracy of a checkpoint.

The checkpoint's weights go through the same path as in training: Megatron trainer load -> FP4 weight
sync (codec bytes, digest-checked) -> embedded engine -> greedy generation on the task's eval split ->
the task's verifier. Prints one JSON line; `--out FILE` also writes it.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a checkpoint directory (runs/NAME/checkpoints/step_XXXXXX)")
    p.add_argument("--config", help="YAML config; default: the config.yaml the run saved beside checkpoints/")
    p.add_argument("--task", help="data.task to evaluate on (default: the config's)")
    p.add_argument("--out", help="also write the result JSON here")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.eval_size=128")


def run(args: argparse.Namespace) -> int:
    from megatron_qrl.config import ConfigError, load_config

    ckpt = Path(args.checkpoint)
    if not ckpt.is_dir():
        raise ConfigError(f"checkpoint '{ckpt}' is not a directory; pass runs/NAME/checkpoints/step_XXXXXX")
    config = args.config or ckpt.parent.parent / "config.yaml"
    overrides = list(args.overrides) + ([f"data.task={args.task}"] if args.task else [])
    cfg = load_config(config, overrides + ["aqn.enabled=false"])
    result = evaluate_checkpoint(cfg, ckpt)
    line = json.dumps(result)
    print(line)
    if args.out:
        Path(args.out).write_text(line + "\n")
    return 0


def evaluate_checkpoint(cfg, ckpt: Path) -> dict:
    from megatron_qrl.pipeline import RunSetup, evaluate, sync_weights

    s = RunSetup.build(cfg)
    s.trainer.load(str(ckpt), load_optimizer=False)
    sync_weights(s.engine_ready(), s.trainer, cfg, step=0, version=0)
    out = evaluate(s.engine, s.tokenizer, s.eval_set, cfg.rollout.max_new_tokens, s.reward_fn,
                   cfg.data.reward_time_limit_s)
    return {"checkpoint": str(ckpt), "task": cfg.data.task, **out}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m megatron_qrl.launch.evaluate")
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
