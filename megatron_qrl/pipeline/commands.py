"""The two sides of a disaggregated job talk in typed commands: trainer rank 0 sends, engine ranks follow.

Engine ranks keep no schedule of their own: each command says what to do next, so a checkpoint the trainer
writes off schedule (the non-finite guard's last one) and the end of the run reach them too.

Generate  install the step's weights (a WeightsHeader and buckets follow, sync/broadcast.py) with its AQN
          draw, generate this engine's share of the next prompt batch, send samples and rollouts to every
          rank, ship the TRACE cache
Evaluate  install the weights after the step's updates without AQN noise; engine 0 scores the held-out set
Save      join the collective checkpoint write of `step` with no state of their own
Stop      leave the command loop (the end of the run, or a stop at a step boundary)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch.distributed as dist

from .wire import broadcast_object


@dataclass(frozen=True)
class Generate:
    step: int


@dataclass(frozen=True)
class Evaluate:
    step: int


@dataclass(frozen=True)
class Save:
    step: int


@dataclass(frozen=True)
class Stop:
    pass


Command = Union[Generate, Evaluate, Save, Stop]


class CommandChannel:
    """Trainer rank `src` -> every engine rank, over `group` ({trainer rank 0} + engine ranks)."""

    def __init__(self, group, src: int = 0):
        self.group, self.src = group, src

    def send(self, command: Command) -> None:
        """Called on every trainer rank; only `src` is a member of the group and sends."""
        if dist.get_rank() == self.src:
            broadcast_object(command, src=self.src, group=self.group)

    def receive(self) -> Command:
        """Engine ranks: the next command (blocks until trainer rank 0 sends one)."""
        command = broadcast_object(None, src=self.src, group=self.group)
        if not isinstance(command, (Generate, Evaluate, Save, Stop)):
            raise TypeError(f"engine rank {dist.get_rank()}: unknown command {command!r} from trainer rank "
                            f"{self.src} (both sides must run the same megatron_qrl version)")
        return command
