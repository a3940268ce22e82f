"""Run-time guards of the RL loop's trainer ranks: a non-finite step is skipped, a failed engine is restarted.

Non-finite steps. Megatron's fp32 optimizer (CPU, and fp32 GPU runs) never checks for NaN/Inf: it would
step Adam with NaN gradients and poison the weights for good. `StepGuard` wraps the optimizer's
`prepare_grads` (the hook Megatron's mixed-precision optimizers use for their own found-inf check): when
this step's rewards/advantages are non-finite or any gradient is, every rank (one all-reduce) reports
"found inf", Megatron skips the update, and weights, Adam state, LR schedule and the trainer step stay
unchanged. The step is logged (`fault/nonfinite_skipped` = 1, a warning naming the cause); more than
`run.max_nonfinite_steps` skipped steps in a row write a checkpoint and stop the run with NonFiniteStop
(exit status 3).

Engine failures: the one retry policy of pipeline/retry.py, with every trainer rank agreeing (one
all-reduce) and a failed rank re-pushing the step's weights to its fresh engine (WeightSync.repush). Each
restart is logged and counted (`fault/engine_restarts`, cumulative).

Test hooks: megatron_qrl.fault_inject (QRL_FAULT_INJECT=nan_loss@3 ...).
"""
from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from megatron_qrl import fault_inject

from .retry import EngineFailure, EngineRetry, any_rank, restart_keeping_rng

log = logging.getLogger(__name__)
__all__ = ["EngineFailure", "NonFiniteStop", "StepGuard"]


class NonFiniteStop(SystemExit):
    """Too many non-finite steps in a row: the run stopped (after a checkpoint) with a clear message."""

    def __init__(self, message: str):
        super().__init__(3)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _trainer_groups() -> tuple:
    """Every trainer rank, without engine-only ranks: data-parallel, then model-parallel groups."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group(), ps.get_model_parallel_group()


def _finite(t) -> bool:
    return t is None or bool(torch.isfinite(t).all())


class StepGuard:
    """Non-finite step skipping and engine restarts for one RunSetup (see the module docstring)."""

    def __init__(self, s):
        self.s = s
        self.max_in_row = s.cfg.run.max_nonfinite_steps
        self.max_retries = s.cfg.rollout.max_generate_retries
        self.step = None            # the RL step in progress (None during the SFT warm start)
        self.in_row = 0             # consecutive skipped steps
        self.skipped_total = 0
        self.retry = EngineRetry(self.max_retries, lambda failed: any_rank(failed, s.trainer.device))
        self._bad_batch = False
        self._skipped_updates = 0
        self._install_grad_check(s.trainer.optimizer, s.trainer.device)   # trainer ranks only (pipeline/job.py)

    # ------------------------------------------------------------------------------ non-finite steps
    def _install_grad_check(self, optimizer, device) -> None:
        original = optimizer.prepare_grads

        def prepare_grads() -> bool:
            found_inf = bool(original())
            grads = [p.grad for p in optimizer.get_parameters() if p.grad is not None]
            if grads and fault_inject.fires("nan_grad", self.step, _rank()):
                grads[0].view(-1)[0] = float("nan")
            local = found_inf or self._bad_batch or not all(_finite(g) for g in grads)
            skip = any_rank(local, device, _trainer_groups())
            self._skipped_updates += int(skip)
            return skip

        optimizer.prepare_grads = prepare_grads  # Megatron's step() calls it first; True = skip the update

    def check_batch(self, batch, step: int) -> None:
        """Before the step's updates: NaN/Inf rewards or advantages make all of them skip."""
        self.step, self._skipped_updates = step, 0
        if fault_inject.fires("nan_reward", step, _rank()):
            batch.rewards[0] = float("nan")
            batch.advantages[0] = float("nan")
        if fault_inject.fires("nan_loss", step, _rank()):
            batch.logp_rollout[0] = float("nan")  # NaN IS ratios: the GRPO loss (and every gradient) is NaN
        self._bad_batch = not (_finite(batch.rewards) and _finite(batch.advantages))

    def end_step(self, train_stats: dict) -> dict:
        """After the step's updates: count a skipped step; returns the step's fault/* metrics."""
        skipped = self._skipped_updates > 0
        if skipped:
            causes = [c for c, bad in (("rewards/advantages", self._bad_batch),
                                       ("loss", not math.isfinite(train_stats.get("loss", 0.0)))) if bad]
            causes = causes or ["gradients"]
            self.in_row += 1
            self.skipped_total += 1
            log.warning("step %s: non-finite %s; update skipped (weights and optimizer state unchanged), "
                        "%d in a row (run.max_nonfinite_steps=%d)", self.step, " and ".join(causes), self.in_row,
                        self.max_in_row)
        else:
            self.in_row = 0
        self._bad_batch = False
        return {"fault/nonfinite_skipped": float(skipped), "fault/nonfinite_in_row": float(self.in_row),
                "fault/nonfinite_total": float(self.skipped_total),
                "fault/engine_restarts": float(self.engine_restarts)}

    def stop_if_exhausted(self, save_checkpoint, step_done: int) -> None:
        """More than run.max_nonfinite_steps skipped in a row: checkpoint, then stop with NonFiniteStop."""
        if self.in_row <= self.max_in_row:
            return
        path = save_checkpoint(self.s, step_done)
        stop = NonFiniteStop(
            f"stopping: {self.in_row} RL steps in a row (up to step {step_done - 1}) had NaN/Inf rewards, loss or "
            f"gradients, more than run.max_nonfinite_steps={self.max_in_row}. Their updates were skipped, so "
            f"the checkpoint {path} holds the last finite weights. Look for the cause (learning rate "
            "trainer.lr, the reward function, the data), then resume (same command) or raise "
            "run.max_nonfinite_steps")
        log.error("%s", stop)  # SystemExit with a status prints nothing itself
        raise stop

    # ------------------------------------------------------------------------------ engine restarts
    @property
    def engine_restarts(self) -> int:
        return self.retry.restarts

    def generate(self, prompts: list, sampling, step: int) -> list:
        """engine.generate with bounded restarts (retry.py); collective (every rank calls it, even with no prompts)."""
        from megatron_qrl.errors import PromptTooLong

        from .prompt_limits import overflow

        self.step = step
        too_long = overflow(prompts, self.s.cfg)   # an input error: no engine restart can fix it
        if any_rank(too_long is not None, self.s.trainer.device):
            raise PromptTooLong(too_long or "a prompt of this step on another rank is longer than the context "
                                "allows (that rank's message names the fix)")
        return self.retry.run(lambda: self.s.engine_ready().generate(prompts, sampling) if prompts else [],
                              lambda: self._restart_engine(step), step)

    def _restart_engine(self, step: int) -> None:
        """A fresh engine with the step's weights and AQN draw; RNG states are preserved (reproducible run)."""
        restart_keeping_rng(self.s.restart_engine)
        self.s.weights.repush(step)
