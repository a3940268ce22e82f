"""The SFT warm start before the first RL step (run.sft_steps)."""
from __future__ import annotations

import logging

import torch.distributed as dist

from .losses import sft_loss
from .rollout_batch import sft_batch

_log = logging.getLogger(__name__)


def sft_warm_start(s: RunSetup) -> None:
    """Supervised steps on the task's reference responses at a constant run.sft_lr; the RL LR schedule then
    starts from its beginning (the scheduler's state is restored afterwards)."""
    from megatron_qrl.logging import ProgressLines, progress_bar

    cfg, sched = s.cfg, s.trainer.scheduler
    lr = cfg.run.sft_lr or cfg.trainer.lr
    groups = s.trainer.optimizer.param_groups
    saved = (sched.max_lr, sched.min_lr, sched.num_steps, [(g.get("max_lr"), g.get("min_lr")) for g in groups])
    sched.max_lr = sched.min_lr = lr
    for g in groups:  # Megatron's groups carry their own max/min LR, which the scheduler prefers
        g["max_lr"] = g["min_lr"] = lr
    sched.step(increment=0)
    bs = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    lines = ProgressLines("SFT warm start", cfg.run.sft_steps)
    _log.info("SFT warm start: %d steps of %d reference responses at lr %g", cfg.run.sft_steps, bs, lr)
    for i in progress_bar(range(cfg.run.sft_steps), desc="SFT warm start", rank=dist.get_rank(), unit="step"):
        rows = [s.train_set[(i * bs + j) % len(s.train_set)] for j in range(bs)]
        stats = s.trainer.train_step(sft_batch(rows, s.tokenizer), sft_loss)
        s.extra["sft/loss"] = stats.get("sft/loss")
        lines.update(i + 1, loss=s.extra["sft/loss"])
    sched.max_lr, sched.min_lr, sched.num_steps, group_lrs = saved
    for g, (hi, lo) in zip(groups, group_lrs):
        for key, value in (("max_lr", hi), ("min_lr", lo)):
            if value is None:
                g.pop(key, None)
            else:
                g[key] = value
    sched.step(increment=0)
