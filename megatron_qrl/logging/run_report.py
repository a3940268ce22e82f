"""The run's log lines (rank 0, through `logging`, see console.py): one per stage, per RL step, per checkpoint,
per evaluation, and a final summary. They carry what a person checks first (is it learning, how fast, when
does it end); every number is also in metrics.jsonl, which stays the record.
"""
from __future__ import annotations

import logging
import time
from typing import Mapping, Optional

log = logging.getLogger("megatron_qrl.run")

# the parts of a step's wall time, as the loop and its helpers measure them (docs/metrics.md)
STEP_PARTS = (("sync", "sync/s"), ("rollout", "rollout/s"), ("logprobs", "time/logprobs_s"),
              ("train", "time/train_s"), ("eval", "time/eval_s"))


def format_duration(seconds: float) -> str:
    """12s, 4m05s, 1h02m: short enough for a log line, exact enough for an ETA."""
    seconds = max(0.0, float(seconds))
    if seconds < 60:
        return f"{seconds:.0f}s" if seconds >= 10 else f"{seconds:.1f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class Rate:
    """Items per second and the ETA of a loop, from the items done in this process (a resumed run's
    earlier steps do not count: they ran at another time, maybe on another machine)."""

    def __init__(self, total: int, start: int = 0):
        self.total, self.start, self.t0 = total, start, time.perf_counter()

    def per_s(self, done: int) -> float:
        return (done - self.start) / max(time.perf_counter() - self.t0, 1e-9)

    def eta(self, done: int) -> str:
        rate = self.per_s(done)
        return format_duration((self.total - done) / rate) if rate > 0 else "?"


class ProgressLines:
    """A log line every `every` items and at the last one (e.g. the SFT warm start's loss)."""

    def __init__(self, name: str, total: int, every: Optional[int] = None, unit: str = "steps"):
        self.name, self.total, self.unit = name, total, unit
        self.every = every or max(1, total // 10)
        self.rate = Rate(total)

    def update(self, done: int, **fields) -> None:
        if done % self.every and done != self.total:
            return
        parts = [f"{k} {_num(v)}" for k, v in fields.items() if v is not None]
        log.info("%s %d/%d: %s%s%.1f %s/s, ETA %s", self.name, done, self.total, ", ".join(parts),
                 ", " if parts else "", self.rate.per_s(done), self.unit, self.rate.eta(done))


def _num(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class RunReport:
    """The RL loop's lines. `step(record)` takes what MetricsLogger.log returned (None off rank 0: silent).

    Steps are counted from 1 in these lines, as checkpoints are: "step 25/100" is the 25th step, whose
    metrics.jsonl record has step 24 (0-based) and whose weights are checkpoint step_000025."""

    def __init__(self, cfg, start: int, end: int):
        self.cfg, self.start, self.end = cfg, start, end
        self.total = cfg.run.total_steps
        self.rate = Rate(end, start)
        self.rewards: list[float] = []
        self.last_eval: Optional[tuple[int, float]] = None
        self.t0 = time.perf_counter()

    def begin(self) -> None:
        if self.start >= self.end:
            log.info("nothing to run: %s has finished step %d of run.total_steps=%d; raise run.total_steps to "
                     "continue it, or choose a new run.output_dir", self.cfg.run.output_dir, self.start, self.total)
            return
        log.info("RL: steps %d..%d of %d (%s, %d prompts x %d responses per step)", self.start + 1, self.end,
                 self.total, self.cfg.rl.is_method, self.cfg.rollout.prompts_per_step, self.cfg.rollout.group_size)

    def step(self, record: Optional[Mapping]) -> None:
        if not record:
            return
        step = int(record["step"])
        reward = record.get("reward/mean")
        if reward is not None:
            self.rewards.append(reward)
        parts = [f"{name} {record[key]:.2f}" for name, key in STEP_PARTS if record.get(key) is not None]
        log.info("step %d/%d: reward %s, response %s tokens, %s tokens/s, %s s (%s), ETA %s", step + 1, self.total,
                 _fmt(reward, ".3f"), _fmt(record.get("response/len_mean"), ".1f"),
                 _fmt(record.get("rollout/tokens_per_s"), ".0f"), _fmt(record.get("time/step_s"), ".2f"),
                 ", ".join(parts), self.rate.eta(step + 1))
        if record.get("eval/accuracy") is not None:   # the weights after this step: checkpoint step_{step+1}
            self.last_eval = (step + 1, record["eval/accuracy"])
            log.info("eval after step %d: accuracy %.3f on %d held-out prompts (greedy), reward %.3f", step + 1,
                     record["eval/accuracy"], int(record.get("eval/num_prompts") or 0),
                     record.get("eval/reward_mean") or 0.0)
        if record.get("fault/nonfinite_skipped"):
            log.warning("step %d: update skipped (non-finite values; see the warning above)", step + 1)

    def summary(self, steps_run: int, checkpoint: Optional[str] = None) -> None:
        out = self.cfg.run.output_dir
        if steps_run <= 0:
            return
        wall = time.perf_counter() - self.t0
        plural = "s" if steps_run != 1 else ""
        parts = [f"{steps_run} RL step{plural} in {format_duration(wall)} ({wall / steps_run:.2f} s/step)"]
        n = min(10, len(self.rewards) // 2)
        if n:
            first, last = self.rewards[:n], self.rewards[-n:]
            parts.append(f"reward {sum(first) / n:.3f} -> {sum(last) / n:.3f} (mean of the first and last {n} steps)")
        if self.last_eval:
            parts.append(f"held-out accuracy {self.last_eval[1]:.3f} after step {self.last_eval[0]}")
        done = "finished" if self.end >= self.total else f"stopped at step {self.end} of {self.total}"
        if checkpoint:
            parts.append(f"last checkpoint {checkpoint}")
        log.info("%s: %s; metrics in %s/metrics.jsonl", done, "; ".join(parts), out)


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)
