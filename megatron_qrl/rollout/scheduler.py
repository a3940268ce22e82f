"""Continuous batching: which sequences run in the next engine step and which tokens each one feeds.

Sequences wait in FIFO order and are admitted whenever fewer than `max_batch_size` run and a KV slot is
free, so a finished sequence's place is taken at the very next step (no waiting for the batch to drain).
An admitted sequence first feeds its prompt (prefill), in chunks when `max_tokens_per_step` bounds the
step; afterwards it feeds its last sampled token (decode). Prefill chunks and decodes of different
sequences share one packed step (attention.StepBatch).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import torch

from .kv_cache import KVCache
from .protocol import SamplingParams


@dataclass(eq=False)
class Sequence:
    """The engine's state of one prompt being generated (compared by identity)."""

    index: int                          # position in the generate() call
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    slot: int = -1
    num_cached: int = 0                 # positions already written to the KV cache
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: Optional[str] = None
    routed: list[torch.Tensor] = field(default_factory=list)          # per-step [n, L, k] chunks
    trace: dict = field(default_factory=dict)                         # layer -> role -> list of chunks

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.tokens

    def pending(self) -> list[int]:
        """Tokens not yet in the cache (the prompt rest, or the last sampled token)."""
        return self.sequence[self.num_cached:]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def accept(self, token: int, logprob: Optional[float]) -> None:
        """Append a sampled token and decide whether the sequence is done."""
        self.tokens.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        if token in self.params.stop_token_ids:
            self.finish_reason = "stop"
        elif len(self.tokens) >= self.params.max_new_tokens:
            self.finish_reason = "length"


@dataclass
class StepPlan:
    """What one engine step runs: per sequence the tokens it feeds and whether it samples afterwards."""

    sequences: list[Sequence]
    feeds: list[list[int]]
    samples: list[bool]       # False while a chunked prefill has prompt tokens left


class ContinuousBatchScheduler:
    """FIFO admission up to max_batch_size running sequences, one KV slot each."""

    def __init__(self, cache: KVCache, max_batch_size: int, max_tokens_per_step: Optional[int] = None):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_tokens_per_step is not None and max_tokens_per_step < max_batch_size:
            raise ValueError(f"max_tokens_per_step ({max_tokens_per_step}) must be >= max_batch_size "
                             f"({max_batch_size}) so every running sequence can decode each step")
        self.cache = cache
        self.max_batch_size = min(max_batch_size, cache.max_slots)
        self.max_tokens_per_step = max_tokens_per_step
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.peak_running = 0

    def submit(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch_size and self.cache.free_slots:
            seq = self.waiting.popleft()
            seq.slot = self.cache.acquire_slot()
            self.running.append(seq)
        self.peak_running = max(self.peak_running, len(self.running))

    def plan(self) -> StepPlan:
        """Admit what fits, then give each running sequence its tokens for this step."""
        self._admit()
        if not self.running:
            raise RuntimeError("scheduler.plan() called with nothing to run")
        budget = self.max_tokens_per_step
        decoding = [s for s in self.running if len(s.pending()) == 1 and s.num_cached >= len(s.prompt)]
        if budget is not None:
            budget -= len(decoding)          # decodes always run, prefills share the rest
        seqs, feeds, samples = [], [], []
        for s in self.running:
            pending = s.pending()
            if budget is not None and s not in decoding:
                if budget <= 0:
                    continue
                pending = pending[:budget]
                budget -= len(pending)
            seqs.append(s)
            feeds.append(pending)
            samples.append(s.num_cached + len(pending) == len(s.sequence))
        return StepPlan(seqs, feeds, samples)

    def retire_finished(self) -> list[Sequence]:
        """Free the slots of finished sequences and return them."""
        done = [s for s in self.running if s.finished]
        for s in done:
            self.cache.free_slot(s.slot)
            s.slot = -1
        self.running = [s for s in self.running if not s.finished]
        return done
