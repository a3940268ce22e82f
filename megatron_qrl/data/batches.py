"""Deterministic, resumable iteration over prompt batches.

Epoch e visits the dataset in a permutation seeded by (seed, e); a batch never spans epochs (the tail that
does not fill a batch is skipped, a different tail each epoch). The state is just (epoch, position), so a
checkpointed run resumes with exactly the batches it would have seen.
"""
from __future__ import annotations

import random
from typing import Any, Sequence

from megatron_qrl.data.sample import Sample


class PromptBatches:
    """Infinite iterator of lists of `batch_size` Samples; state_dict()/load_state_dict() for resume."""

    def __init__(self, dataset: Sequence[Sample], batch_size: int, seed: int = 0, shuffle: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 (got {batch_size})")
        if len(dataset) < batch_size:
            raise ValueError(f"the dataset has {len(dataset)} prompts, fewer than one batch of {batch_size}; "
                             "lower rollout.prompts_per_step or add data")
        self.dataset, self.batch_size, self.seed, self.shuffle = dataset, batch_size, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order: list[int] = []
        self._order_epoch = -1

    def _epoch_order(self) -> list[int]:
        if self._order_epoch != self.epoch:
            order = list(range(len(self.dataset)))
            if self.shuffle:
                random.Random(f"batches|{self.seed}|{self.epoch}").shuffle(order)
            self._order, self._order_epoch = order, self.epoch
        return self._order

    def __iter__(self):
        return self

    def __next__(self) -> list[Sample]:
        if self.position + self.batch_size > len(self.dataset):
            self.epoch, self.position = self.epoch + 1, 0
        idx = self._epoch_order()[self.position:self.position + self.batch_size]
        self.position += self.batch_size
        return [self.dataset[i] for i in idx]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "batch_size": self.batch_size, "size": len(self.dataset)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "batch_size", "size"):
            if key in state and state[key] != self.state_dict()[key]:
                raise ValueError(f"cannot resume prompt batches: checkpoint has {key}={state[key]}, this run "
                                 f"{self.state_dict()[key]}; resume with the same data settings")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
