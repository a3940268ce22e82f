"""The trainer ranks' rollouts of a disaggregated job: engine ranks generate, trainer rank 0 commands them.

Per step: trainer rank 0 sends Generate and the weights (BroadcastSync); each engine generates its
contiguous share of the prompt groups (same seeds and sample indices as one engine would use); samples and
rollouts (without TRACE captures: a handle each) go to every rank; each engine's recorder seals the TRACE cache of
its samples and hand_over's `megatron_qrl.trace.exchange` ships every trainer rank the samples it trains
(rollouts/hand_over.py), which its replay loads.
"""
from __future__ import annotations

import time
from typing import Optional

from ..commands import Evaluate, Generate, Save, Stop
from ..wire import gather_from_engines
from .hand_over import hand_over_to_replay
from .protocol import RolloutsContext


class RemoteRollouts(RolloutsContext):
    """Trainer ranks' Rollouts: `weights` is the BroadcastSync, `commands` the CommandChannel to the engines."""

    def __init__(self, s, place, weights, commands):
        self.s, self.place, self.weights, self.commands = s, place, weights, commands
        self._build_s = 0.0

    def sync(self, step: int) -> dict:
        self.commands.send(Generate(step))
        return self.weights.push(step)

    def generate(self, prompts: list, step: int, first_index: int = 0):
        if first_index:   # config validation refuses rl.dynamic_sampling here
            raise ValueError("disaggregated engine ranks generate one batch per step (no dynamic sampling)")
        parts = gather_from_engines(None, self.place)
        samples = [x for p in parts for x in p["samples"]]
        rollouts = [x for p in parts for x in p["rollouts"]]
        self._build_s = max(p["trace_build_s"] for p in parts)
        return samples, rollouts, {"rollout/s": max(p["generate_s"] for p in parts)}

    def hand_over(self, batch, step: int) -> None:
        """The engine ranks' TRACE caches (sealed before they sent the samples) through the exchange."""
        if self.s.trainer.trace is not None:
            hand_over_to_replay(self.s, self.place, None, batch, step, self._build_s)

    def idle(self) -> None:
        pass

    def evaluate(self, step: int) -> dict:
        """As ColocatedRollouts.evaluate: the weights after this step's updates, no AQN noise (engine 0 scores)."""
        t0 = time.perf_counter()
        self.commands.send(Evaluate(step))
        self.weights.push(step, aqn=False)
        return {**gather_from_engines(None, self.place)[0], "time/eval_s": time.perf_counter() - t0}

    def save(self, step: int) -> None:
        self.commands.send(Save(step))   # the engine ranks join the collective checkpoint write

    def close(self, error: Optional[type] = None) -> None:
        """The end of the run, or a stop at a step boundary (SystemExit, e.g. the non-finite guard's): release the
        engine ranks from their command loop. After any other exception the engines may sit in another
        collective, so nothing is sent: the launcher (torchrun) tears the job down."""
        if error is None or issubclass(error, SystemExit):
            self.commands.send(Stop())
