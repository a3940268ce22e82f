"""A disaggregated job's engine ranks: they follow trainer rank 0's commands (pipeline/commands.py) until Stop.

Generate  receive and install the step's weights and AQN draw (BroadcastReceiver), generate this engine's
          share of the prompt groups (a failed engine is restarted and the batch retried: pipeline/retry.py),
          seal the TRACE cache of the share (the engine's recorder), send samples and rollouts (a handle each,
          no captures) to every rank, ship the cache to the trainer ranks (rollouts/hand_over.py)
Evaluate  receive and install the weights without AQN noise; engine 0 scores the held-out set
Save      join the collective checkpoint write with no state of their own
"""
from __future__ import annotations

import time

import torch.distributed as dist

from megatron_qrl.trace.recorder import without_captures

from ..checkpoints import write_checkpoint
from ..commands import CommandChannel, Evaluate, Generate, Save, Stop
from ..evaluate import evaluate
from ..prompt_limits import check_encoded
from ..retry import EngineRetry, restart_keeping_rng
from ..rollout_batch import encode_prompts
from ..sync import BroadcastReceiver
from ..wire import gather_from_engines
from .colocated import engine_share
from .hand_over import exchange_trace, trace_active


class EngineRank:
    """One engine rank of a disaggregated job (RunSetup `s` holds its engine, with its TRACE recorder, and data)."""

    def __init__(self, s, place, group):
        self.s, self.place = s, place
        self.commands = CommandChannel(group)
        self.weights = BroadcastReceiver(s.cfg, group)
        self.retry = EngineRetry(s.cfg.rollout.max_generate_retries)   # this rank alone: no agreement
        self.me = place.engine_index(dist.get_rank())
        self._handlers = {Generate: self.generate, Evaluate: self.evaluate, Save: self.save}

    def follow_commands(self) -> None:
        """Commands from trainer rank 0 until Stop."""
        while not isinstance(command := self.commands.receive(), Stop):
            self._handlers[type(command)](command)

    def generate(self, command: Generate) -> None:
        s, step, G = self.s, command.step, self.s.cfg.rollout.group_size
        self.weights.receive(s.engine)
        prompts = next(s.prompts)
        first, stop = engine_share(len(prompts), self.me, len(self.place.engine_ranks))
        samples = [p for p in prompts[first:stop] for _ in range(G)]
        t0 = time.perf_counter()
        rollouts = self._generate(samples, step, first * G) if samples else []
        generate_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        traced = trace_active(s.cfg)
        # batch position = sample index: engine ranks draw one batch per step (no dynamic sampling)
        cache = s.engine.trace_recorder.seal(range(first * G, stop * G), step, first * G) if traced else None
        build_s = time.perf_counter() - t0
        gather_from_engines({"samples": samples, "rollouts": without_captures(rollouts), "generate_s": generate_s,
                             "trace_build_s": build_s}, self.place)
        if traced:
            exchange_trace(s.cfg, self.place, cache, len(prompts) * G)

    def _generate(self, samples: list, step: int, index_offset: int) -> list:
        s = self.s
        prompts = encode_prompts(s.tokenizer, samples)
        check_encoded(prompts, s.cfg)   # an input error: a restart cannot fix it

        def restart() -> None:
            restart_keeping_rng(s.restart_engine)
            self.weights.reinstall(s.engine)   # the same bytes and AQN draw: the same tokens
        return self.retry.run(lambda: s.engine.generate(prompts, s.sampling(step, index_offset)), restart, step)

    def evaluate(self, command: Evaluate) -> None:
        """The weights after the step's updates (no AQN noise): engine 0 scores the held-out set."""
        s = self.s
        self.weights.receive(s.engine)
        gather_from_engines(evaluate(s.engine, s.tokenizer, s.eval_set, s.cfg.rollout.max_new_tokens, s.reward_fn,
                                     s.cfg.data.reward_time_limit_s) if self.me == 0 else None, self.place)

    def save(self, command: Save) -> None:
        write_checkpoint(self.s, command.step)
