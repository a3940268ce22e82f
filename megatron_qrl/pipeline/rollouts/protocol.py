"""`Rollouts`: where a trainer rank's rollouts come from, as the loop in launch/train.py sees it.

One implementation per placement, chosen once when the job is built (pipeline/job.py): ColocatedRollouts
(every rank holds an engine), RemoteRollouts (engine ranks of a disaggregated job follow commands),
SGLangServerRollouts (SGLang servers outside the job). Engine ranks run no loop of their own and hold no
Rollouts: they follow the trainer's commands (pipeline/rollouts/engine_ranks.py).
"""
from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable


@runtime_checkable
class Rollouts(Protocol):
    def sync(self, step: int) -> dict:
        """The trainer's weights (FP4 bytes + digests) to the engines and this step's AQN draw; metrics."""
        ...

    def generate(self, prompts: list, step: int, first_index: int = 0) -> tuple:
        """(samples, rollouts, metrics): every trainer rank gets the whole batch; first_index is the global
        sample index of its first response (a step's later generate calls: dynamic sampling)."""
        ...

    def hand_over(self, batch, step: int) -> None:
        """The engines' records of `batch` to this rank's trainer: the TRACE caches their recorders seal, through
        one trace.exchange into the trainer's replay (rollouts/hand_over.py; a no-op without TRACE)."""
        ...

    def idle(self) -> None:
        """The trainer's turn: engines give back what they do not need meanwhile."""
        ...

    def evaluate(self, step: int) -> dict:
        """Held-out accuracy of the weights after this step's updates, without AQN noise (as `qrl eval`)."""
        ...

    def save(self, step: int) -> None:
        """Before the collective checkpoint write of `step`: bring the engine side into it (if it takes part)."""
        ...

    def close(self, error: Optional[type] = None) -> None:
        """The end of the run (error None) or its abort with exception type `error`."""
        ...


class RolloutsContext:
    """`with rollouts:` closes them with the exception type that ended the block (None on success)."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(exc_type)
        return None


class SyncingRollouts(RolloutsContext):
    """Rollouts whose sync is their WeightSync's push (the run's RunSetup `s`, its WeightSync `weights`)."""

    def __init__(self, s, weights):
        self.s, self.weights = s, weights

    def sync(self, step: int) -> dict:
        return self.weights.push(step)
