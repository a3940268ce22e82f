"""Writing the checkpoint after an RL step: once per step, `latest` moved last (run_state.py), and the
engine ranks of a disaggregated job brought into the collective write (Rollouts.save)."""
from __future__ import annotations

import logging
import time

import torch.distributed as dist

from megatron_qrl import fault_inject

from .checkpoint_write import checkpoint_write
from .run_state import mark_latest, step_path

_log = logging.getLogger(__name__)


def save_checkpoint(s, step: int) -> str:
    """Trainer ranks: the checkpoint after `step` RL steps, once per step and process. A failed write leaves
    no partial directory behind; a full disk raises DiskFull (checkpoint_write)."""
    if s.extra.get("saved_step") == step:   # written already, or loaded by resume
        return s.extra["last_checkpoint"]
    s.rollouts.save(step)                   # disaggregated: the engine ranks join the collective write
    return write_checkpoint(s, step)


def write_checkpoint(s, step: int) -> str:
    """The collective write of `step`'s checkpoint that every rank of the job joins (RunSetup.side says what
    this rank holds: a trainer's state, or nothing but its part in the collective)."""
    path = step_path(s.cfg.run.output_dir, step)
    extra = {"step": step, "data": s.prompts.state_dict()}
    t0 = time.perf_counter()
    with checkpoint_write(path):
        s.side.save(str(path), extra)
    fault_inject.kill("kill_before_latest", step - 1, dist.get_rank())     # tests: saved, not yet committed
    if dist.get_rank() == 0:
        mark_latest(s.cfg.run.output_dir, path)
    dist.barrier()
    _log.info("checkpoint %s written in %.1f s: %s", path.name, time.perf_counter() - t0, path)
    s.extra.update(saved_step=step, last_checkpoint=str(path))
    fault_inject.kill("kill_after_checkpoint", step - 1, dist.get_rank())  # tests: committed, next step not begun
    return str(path)
