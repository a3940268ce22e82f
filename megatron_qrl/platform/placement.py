"""Which ranks train and which generate: colocated (every rank both) or disaggregated (separate ranks).

Disaggregated: of the job's N ranks the first N - E train (Megatron's world, ranks 0..N-E-1) and the
last E = rollout.num_engine_ranks run engines. torch.distributed's default group still spans all N
ranks: it is the bridge that carries weights, rollouts and TRACE caches between the two sides. Megatron
gets a world of its own on each side: `initialize_model_parallel(local_world_size=..., rank_offset=...)`
with groups created by local synchronization (only members take part), so the trainer's TP/PP/EP/DP
groups never include an engine rank and each engine rank is a one-rank Megatron world (TP=PP=EP=1,
what the embedded engine's unsharded model needs).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    mode: str            # "colocated" | "disaggregated"
    world_size: int
    num_trainers: int    # trainer ranks are 0 .. num_trainers - 1

    @classmethod
    def from_config(cls, cfg, world_size: int) -> "Placement":
        ro = cfg.rollout
        if ro.placement == "colocated" or ro.engine == "sglang":
            # SGLang's disaggregated servers are not ranks of this job (rollout.sglang_server_urls): all ranks train
            return cls("colocated", world_size, world_size)
        trainers = world_size - ro.num_engine_ranks
        if trainers < 1:
            raise ValueError(f"rollout.placement=disaggregated with rollout.num_engine_ranks={ro.num_engine_ranks} "
                             f"leaves no trainer rank in a job of {world_size} ranks: launch at least "
                             f"{ro.num_engine_ranks + 1} processes or lower rollout.num_engine_ranks")
        return cls("disaggregated", world_size, trainers)

    @property
    def disaggregated(self) -> bool:
        return self.mode == "disaggregated"

    @property
    def engine_ranks(self) -> tuple[int, ...]:
        start = self.num_trainers if self.disaggregated else 0
        return tuple(range(start, self.world_size))

    def is_trainer(self, rank: int) -> bool:
        return rank < self.num_trainers

    def is_engine(self, rank: int) -> bool:
        return rank in self.engine_ranks

    def engine_index(self, rank: int) -> int:
        """0-based position of an engine rank among the engines."""
        return self.engine_ranks.index(rank)
