"""Test-only fault injection, switched on by one environment variable (never by the config).

    QRL_FAULT_INJECT="KIND@STEP[xCOUNT][rRANK],..."     e.g. "nan_loss@3,engine_crash@1x2r1"

KIND fires at RL step STEP, COUNT times (default 1), on rank RANK only (default: every rank). Kinds and
where they fire (tests/fault/ and docs/RELIABILITY.md use them):
    nan_reward       rewards of the step's batch become NaN            (pipeline/guards.py, before training)
    nan_loss         one response's rollout log-probs become NaN, so the GRPO loss is NaN (guards.py)
    nan_grad         one gradient element becomes NaN after the DP all-reduce (guards.py, before the step)
    engine_crash     the engine's generate raises RuntimeError          (pipeline/retry.py, generate with restarts;
                     trainer ranks and disaggregated engine ranks alike)
    stall_in_save    sleep QRL_FAULT_STALL_S (default 120) inside the checkpoint save, after the shard files
                     are written and before the manifest (trainer/checkpoint.py), so a test can kill -9 there
    The kill_* kinds end the process with SIGKILL (no cleanup, as kill -9 would) at a boundary of step STEP:
    kill_after_metrics     the step's metrics line is written (fsync'd), its checkpoint not begun (logging/metrics.py)
    torn_metrics           half of the step's metrics line is written, then the kill (logging/metrics.py)
    kill_before_latest     the checkpoint after the step is complete, `latest` not yet moved (pipeline/checkpoints.py)
    kill_after_checkpoint  the checkpoint is committed (`latest` names it), the next step not begun (checkpoints.py)
Unset (the normal case) every check is a dictionary lookup that finds nothing.
"""
from __future__ import annotations

import os
import re
import signal
import sys
import time
from typing import Optional

ENV = "QRL_FAULT_INJECT"
KINDS = ("nan_reward", "nan_loss", "nan_grad", "engine_crash", "stall_in_save", "kill_after_metrics", "torn_metrics",
         "kill_before_latest", "kill_after_checkpoint")
_SPEC = re.compile(r"^(\w+)@(\d+)(?:x(\d+))?(?:r(\d+))?$")
_plan: Optional[dict] = None
_plan_source: Optional[str] = None


def _parse(text: str) -> dict:
    plan: dict = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        m = _SPEC.match(item)
        if not m or m.group(1) not in KINDS:
            raise ValueError(f"{ENV}: cannot parse '{item}'; use KIND@STEP[xCOUNT][rRANK] with KIND one of "
                             f"{', '.join(KINDS)} (e.g. nan_loss@3 or engine_crash@1x2r1)")
        kind, step, count, rank = m.group(1), int(m.group(2)), int(m.group(3) or 1), m.group(4)
        plan[(kind, step)] = {"left": count, "rank": None if rank is None else int(rank)}
    return plan


def _current_plan() -> dict:
    global _plan, _plan_source
    text = os.environ.get(ENV, "")
    if text != _plan_source:
        _plan, _plan_source = _parse(text), text
    return _plan or {}


def fires(kind: str, step: Optional[int], rank: int = 0) -> bool:
    """True when an injected `kind` fault is due at `step` on `rank` (consumes one of its occurrences)."""
    if step is None:
        return False
    entry = _current_plan().get((kind, step))
    if not entry or entry["left"] <= 0 or (entry["rank"] is not None and entry["rank"] != rank):
        return False
    entry["left"] -= 1
    print(f"fault-inject: {kind} at step {step} on rank {rank}", file=sys.stderr, flush=True)
    return True


def stall(kind: str, step: Optional[int], rank: int = 0) -> None:
    """Sleep here when `kind` is due, giving a test the window to kill the process mid-operation."""
    if fires(kind, step, rank):
        time.sleep(float(os.environ.get("QRL_FAULT_STALL_S", "120")))


def kill(kind: str, step: Optional[int], rank: int = 0) -> None:
    """SIGKILL this process when `kind` is due: the abrupt end a kill -9 or a node failure gives."""
    if fires(kind, step, rank):
        sigkill()


def sigkill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
