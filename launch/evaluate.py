"""`qrl eval CKPT [--config C] [--task T] [overrides]`: held-out accuracy of a checkpoint.

The checkpoint's weights go through the same path as in training: Megatron trainer load -> FP4 weight
sync (codec bytes, digest-checked) -> embedded engine -> greedy generation on the task's eval split ->
the task's verifier, without AQN noise. Prints one JSON line; `--out FILE` also writes it. The run's own
`eval/accuracy` at step N is measured the same way on the weights after step N's updates, i.e. on the
checkpoint step_{N+1}: `qrl eval runs/NAME/checkpoints/step_{N+1}` reports the same number.
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
    from megatron_qrl.config import load_config

    ckpt = check_checkpoint_dir(Path(args.checkpoint))
    config = args.config or ckpt.parent.parent / "config.yaml"
    if not Path(config).is_file():
        from megatron_qrl.errors import InputError

        raise InputError(f"no config for checkpoint '{ckpt}': {config} does not exist (a run writes it beside "
                         "checkpoints/); pass the run's config with --config C")
    overrides = list(args.overrides) + ([f"data.task={args.task}"] if args.task else [])
    cfg = load_config(config, overrides + ["aqn.enabled=false"])
    result = evaluate_checkpoint(cfg, ckpt)
    line = json.dumps(result)
    print(line)
    if args.out:
        Path(args.out).write_text(line + "\n")
    return 0


def check_checkpoint_dir(path: Path) -> Path:
    """`path` if it is a checkpoint (has manifest.json); else an InputError naming what to pass instead."""
    from megatron_qrl.errors import InputError
    from megatron_qrl.pipeline.run_state import latest_checkpoint

    if (path / "manifest.json").is_file():
        return path
    if not path.exists():
        raise InputError(f"checkpoint '{path}' does not exist; pass runs/NAME/checkpoints/step_XXXXXX")
    hint = "pass runs/NAME/checkpoints/step_XXXXXX"
    for run_dir in (path, path.parent, path.parent.parent):   # a run dir, its checkpoints/, a broken step_*
        latest = latest_checkpoint(run_dir)
        if latest is not None:
            hint = f"pass a checkpoint directory, e.g. the run's latest: {latest}"
            break
    what = "an interrupted save" if path.name.startswith(".") else "not a checkpoint"
    raise InputError(f"'{path}' is {what} (no manifest.json in it); {hint}")


def evaluate_checkpoint(cfg, ckpt: Path) -> dict:
    from megatron_qrl.pipeline import RunSetup, evaluate, sync_weights

    s = RunSetup.build(cfg)
    s.trainer.load(str(ckpt), load_optimizer=False)
    sync_weights(s.engine_ready(), s.trainer, cfg, step=0, version=0)
    out = evaluate(s.engine, s.tokenizer, s.eval_set, cfg.rollout.max_new_tokens, s.reward_fn,
                   cfg.data.reward_time_limit_s)
    return {"checkpoint": str(ckpt), "task": cfg.data.task, **out}


if __name__ == "__main__":
    from megatron_qrl.errors import script_main

    raise SystemExit(script_main("eval", "python -m megatron_qrl.launch.evaluate", add_arguments, run))
