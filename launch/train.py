"""`qrl train --config C [overrides]` and `torchrun ... -m megatron_qrl.launch.train --config C`: the RL job.

The whole cycle is `train()` below: sync -> generate -> rewards/advantages (DAPO refills) -> TRACE + R3 to
the trainer -> log-probs (and the reference's, for a KL) -> IS weights -> GRPO updates -> metrics -> eval /
checkpoint. Everything else lives in small modules (megatron_qrl.pipeline, .trainer, .rollout, .rl, .trace).
"""
from __future__ import annotations

import argparse
import time

from megatron_qrl.config import load_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML config, e.g. configs/tiny_cpu.yaml")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-4 run.total_steps=10")


def run(args: argparse.Namespace) -> int:
    train(load_config(args.config, args.overrides))
    return 0


def train(cfg) -> dict:
    """Run (or resume) an RL job; returns the last step's metrics."""
    from megatron_qrl.launch.dist_env import discover
    from megatron_qrl.logging import MetricsLogger, progress_bar
    from megatron_qrl.pipeline import (RunSetup, batch_collector, check_job, grpo_loss, reference_kl,
                                       resume_or_warm_start, save_checkpoint, serve_rollouts, trainer_batch)
    from megatron_qrl.rl import is_weights

    env = discover()
    if env.launcher != "single":          # a lone process lets init_process_group pick a free port
        env.export()
    check_job(cfg, env.world_size)                # layout, placement, rank count: before any process group
    s = RunSetup.build(cfg)                       # trainer, engine(s), tokenizer, data, reward, TRACE bridge
    s.save_config()                               # runs/NAME/config.yaml: what `qrl eval` reloads
    start = resume_or_warm_start(s)
    kl = reference_kl(s, start)                   # frozen reference for rl.kl_coef > 0 (else a no-op)
    collect = batch_collector(cfg)                # one generate call, or DAPO dynamic sampling
    last: dict = {}
    end = min(cfg.run.total_steps, start + (cfg.run.stop_after_steps or cfg.run.total_steps))
    r = s.rollouts                                # this rank's engine, or engine ranks elsewhere
    if r is None:                                 # a disaggregated job's engine rank: serve the trainers
        serve_rollouts(s, s.placement)
        return last
    with MetricsLogger(cfg.run.output_dir, cfg, rank=env.rank, start_step=start) as log, r:
        for step in progress_bar(range(start, end), total=cfg.run.total_steps, initial=start,
                                 desc="RL", rank=env.rank, unit="step"):
            t_step = time.perf_counter()
            m = r.sync(step)                                                   # FP4 bytes + digests, AQN draw
            batch, gen_m = collect(s, r, step)                      # generate, rewards, advantages: every rank
            s.guard.check_batch(batch, step)                               # NaN/Inf: the updates will skip
            guides, trace_m = r.trace(batch, step)                             # this rank's TRACE cache
            r.idle()                                                           # colocated: free engine memory
            t_logp = time.perf_counter()
            logp_old = s.trainer.logprobs(trainer_batch(batch, guides))
            m["time/logprobs_s"] = time.perf_counter() - t_logp
            trace_m = {**s.trace.after_logprobs(), **trace_m}                             # code mismatch
            batch, kl_m = kl.apply(batch, logp_old)              # reference log-probs: loss term or reward
            weights, is_m = is_weights(logp_old, batch.logp_rollout, batch.advantages, batch.loss_mask,
                                       cfg.rl.is_method, cfg.rl)
            for _ in range(cfg.rl.updates_per_batch):
                train_m = s.trainer.train_step(trainer_batch(batch, guides, logp_old, weights), grpo_loss(cfg.rl))
            m.update(s.step_metrics(batch, batch.rollouts, gen_m["rollout/s"]), **gen_m, **is_m, **kl_m, **trace_m,
                     **s.guard.end_step(train_m), **{s.train_key(k): v for k, v in train_m.items()})
            if cfg.run.eval_every and (step + 1) % cfg.run.eval_every == 0:
                m.update(r.evaluate(step))
            if cfg.run.checkpoint_every and (step + 1) % cfg.run.checkpoint_every == 0:
                save_checkpoint(s, step + 1)
            log.log({**m, **s.step_resources(t_step)}, step=step)                 # step time, peak memory
            last = m
            s.guard.stop_if_exhausted(save_checkpoint, step + 1)           # too many NaN steps: ckpt + stop
        if cfg.run.checkpoint_every and end % cfg.run.checkpoint_every:
            save_checkpoint(s, end)
    return last


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m megatron_qrl.launch.train")
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
