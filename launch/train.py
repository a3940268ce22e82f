"""`qrl train --config C [overrides]` and `torchrun ... -m megatron_qrl.launch.train --config C`: the RL job.

The whole cycle is `train()` below: sync -> generate -> rewards/advantages (DAPO refills) -> the engines'
records (TRACE caches) to the trainer -> log-probs (and the reference's, for a KL) -> IS weights -> GRPO updates -> metrics -> eval /
checkpoint. Everything else lives in small modules (megatron_qrl.pipeline, .trainer, .rollout, .rl, .trace).
"""
from __future__ import annotations

import argparse
import logging
import sys
import time

from megatron_qrl.config import load_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML config, e.g. configs/tiny_cpu.yaml")
    p.add_argument("--dry-run", action="store_true",
                   help="print the resolved config (YAML) and what the run would do with its output_dir, then exit")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-4 run.total_steps=10")


def run(args: argparse.Namespace) -> int:
    from megatron_qrl.errors import Interrupted
    from megatron_qrl.run_dir import inspect_run_dir, resume_hint

    cfg = load_config(args.config, args.overrides)
    if args.dry_run:
        return dry_run(cfg)
    inspect_run_dir(cfg)        # a conflicting output_dir or a missing input fails here, before the imports
    log = logging.getLogger("megatron_qrl.launch.train")   # a fixed name: __name__ is __main__ under torchrun
    log.info("qrl train %s%s -> %s: loading Megatron-Core and building the run", args.config,
             f" + {len(args.overrides)} override(s)" if args.overrides else "", cfg.run.output_dir)
    try:
        train(cfg)
    except KeyboardInterrupt:   # Ctrl-C / SIGTERM: say what is on disk and how to go on (megatron_qrl.errors)
        raise Interrupted(resume_hint(cfg)) from None
    return 0


def dry_run(cfg) -> int:
    """The resolved config on stdout; on stderr, what a real run would do with run.output_dir. Starts nothing."""
    from megatron_qrl.config import dump_config
    from megatron_qrl.launch.dist_env import discover
    from megatron_qrl.pipeline import check_job
    from megatron_qrl.run_dir import inspect_run_dir

    check_job(cfg, discover().world_size)
    plan = inspect_run_dir(cfg)
    sys.stdout.write(dump_config(cfg))
    print(f"qrl train --dry-run: {plan.describe()}; nothing was started", file=sys.stderr)
    return 0


def train(cfg) -> dict:
    """Run (or resume) an RL job; returns the last step's metrics."""
    from megatron_qrl.launch.dist_env import discover
    from megatron_qrl.logging import MetricsLogger, RunReport, progress_bar
    from megatron_qrl.pipeline import (RunSetup, batch_collector, check_job, checkpoint_due, grpo_loss,
                                       prepare_run_dir, reference_kl, resume_or_warm_start, save_checkpoint,
                                       trainer_batch)
    from megatron_qrl.rl import is_weights

    env = discover()
    if env.launcher != "single":          # a lone process lets init_process_group pick a free port
        env.export()
    check_job(cfg, env.world_size)                # layout, placement, rank count: before any process group
    plan = prepare_run_dir(cfg, env.rank)         # same run's config (resume) or refuse; resume=false: empty it
    s = RunSetup.build(cfg)                       # this rank's side: trainer (+ TRACE replay), engine (+ recorder), Rollouts, WeightSync
    start = resume_or_warm_start(s, plan)         # the checkpoint `latest` names, else the SFT warm start
    s.save_config()                               # runs/NAME/config.yaml (what `qrl eval` reloads), now valid
    kl = reference_kl(s, start)                   # frozen reference for rl.kl_coef > 0 (else a no-op)
    collect = batch_collector(cfg)                # one generate call, or DAPO dynamic sampling
    last: dict = {}
    end = min(cfg.run.total_steps, start + (cfg.run.stop_after_steps or cfg.run.total_steps))
    if s.engine_rank is not None:                 # a disaggregated job's engine rank: follow the trainers'
        s.engine_rank.follow_commands()           # commands (generate / evaluate / save / stop)
        return last
    r = s.rollouts                                # this rank's engine, or engine ranks / servers elsewhere
    report = RunReport(cfg, start, end)           # rank 0's log lines: a line per step, the summary
    report.begin()
    with MetricsLogger(cfg.run.output_dir, cfg, rank=env.rank, start_step=start) as log, r:
        for step in progress_bar(range(start, end), total=cfg.run.total_steps, initial=start,
                                 desc="RL", rank=env.rank, unit="step"):
            t_step = time.perf_counter()
            m = r.sync(step)                                                   # FP4 bytes + digests, AQN draw
            batch, gen_m = collect(s, r, step)                      # generate, rewards, advantages: every rank
            s.guard.check_batch(batch, step)                               # NaN/Inf: the updates will skip
            r.hand_over(batch, step)                              # engine records -> the trainer's replay
            r.idle()                                                           # colocated: free engine memory
            t_logp = time.perf_counter()
            logp_old = s.trainer.logprobs(trainer_batch(batch))
            m["time/logprobs_s"] = time.perf_counter() - t_logp
            batch, kl_m = kl.apply(batch, logp_old)              # reference log-probs: loss term or reward
            weights, is_m = is_weights(logp_old, batch.logp_rollout, batch.advantages, batch.loss_mask,
                                       cfg.rl.is_method, cfg.rl)
            t_train = time.perf_counter()
            for _ in range(cfg.rl.updates_per_batch):
                train_m = s.trainer.train_step(trainer_batch(batch, logp_old, weights), grpo_loss(cfg.rl))
            m["time/train_s"] = time.perf_counter() - t_train
            m.update(s.step_metrics(batch, batch.rollouts, gen_m["rollout/s"]), **gen_m, **is_m, **kl_m,
                     **s.guard.end_step(train_m), **{s.train_key(k): v for k, v in train_m.items()})
            if cfg.run.eval_every and (step + 1) % cfg.run.eval_every == 0:
                m.update(r.evaluate(step))              # the weights after this step's updates, as `qrl eval`
            report.step(log.log({**m, **s.step_resources(t_step)}, step=step))       # metrics.jsonl, then a line
            if checkpoint_due(cfg, step + 1):     # after the step's metrics line: a kill in between re-runs the step
                save_checkpoint(s, step + 1)
            last = m
            s.guard.stop_if_exhausted(save_checkpoint, step + 1)           # too many NaN steps: ckpt + stop
        if cfg.run.save_checkpoints:                                       # the last step, always (once)
            save_checkpoint(s, end)
    report.summary(end - start, checkpoint=s.extra.get("last_checkpoint"))
    return last


if __name__ == "__main__":
    from megatron_qrl.errors import script_main

    raise SystemExit(script_main("train", "python -m megatron_qrl.launch.train", add_arguments, run))
