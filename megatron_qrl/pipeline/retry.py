"""The one retry policy for a failed rollout engine: restart it, restore the step's weights, try again.

An exception from generate (the embedded engine runs in-process; SGLang raises when its server dies) is
retried at most `rollout.max_generate_retries` times per batch, then EngineFailure. Every failed rank
restarts its engine (`restart`: a fresh engine with the step's weights and AQN draw, so the retried batch
is what the first attempt would have sampled); ranks that generate together first agree whether any of
them failed (`agree`, a collective), so all of them make the same number of attempts.
"""
from __future__ import annotations

import logging
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from megatron_qrl import fault_inject

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineFailure(RuntimeError):
    """The rollout engine failed on every allowed retry of one batch."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class EngineRetry:
    """Bounded engine restarts (see the module docstring); counts restarts for fault/engine_restarts."""

    def __init__(self, max_retries: int, agree: Callable[[bool], bool] = lambda failed: failed):
        self.max_retries, self.agree = max_retries, agree
        self.restarts = 0

    def run(self, generate: Callable[[], T], restart: Callable[[], None], step: int) -> T:
        attempt, result, done, error = 0, None, False, None
        while True:
            if not done:
                try:
                    if fault_inject.fires("engine_crash", step, _rank()):
                        raise RuntimeError("injected engine crash (QRL_FAULT_INJECT)")
                    result, done = generate(), True
                except Exception as err:  # noqa: BLE001 - any engine failure is retried, bounded
                    error = err
                    log.warning("step %d rank %d: engine generate failed (attempt %d of %d): %s: %s", step,
                                _rank(), attempt + 1, self.max_retries + 1, type(err).__name__, err)
            if not self.agree(not done):
                return result
            if attempt >= self.max_retries:
                raise EngineFailure(
                    f"step {step}: the rollout engine failed {attempt + 1} times on the same batch "
                    f"(rollout.max_generate_retries={self.max_retries})"
                    + (f"; last error on this rank: {type(error).__name__}: {error}" if not done else "")
                    + ". Check the engine log/health; resume from the last checkpoint with the same command")
            attempt += 1
            self.restarts += 1  # counted on every rank that agreed: the metric is the same everywhere
            if not done:
                log.warning("step %d rank %d: restarting the engine and retrying with the step's weights", step,
                            _rank())
                restart()


def restart_keeping_rng(restart: Callable[[], None]) -> None:
    """`restart()` (building an engine draws from the RNGs) with the torch and Megatron RNG states kept, so
    the run stays reproducible."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker().get_states()
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
        restart()
    get_cuda_rng_tracker().set_states(tracker)


def any_rank(flag: bool, device, groups=(None,)) -> bool:
    """True on every rank of `groups` (default: the world) when `flag` is True on any of them (collective)."""
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        for group in groups:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item() > 0)
