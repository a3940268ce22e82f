"""Which side of the job this rank is, resolved once: what it holds, its Rollouts and its WeightSync.

colocated      every rank trains and holds an engine (embedded, or an in-process sglang.Engine);
               ColocatedRollouts, the in-process WeightSync of its capability (sync.in_process_sync)
disaggregated  trainer ranks 0..T-1 hold no engine: RemoteRollouts + BroadcastSync; engine ranks T..N-1 hold
               no trainer and follow trainer rank 0's commands (rollouts/engine_ranks.py)
SGLang servers rollout.engine=sglang with placement disaggregated: the servers are not ranks of this job,
               every rank trains; trainer rank 0 holds the adapter (SGLangServerRollouts + SGLangServerSync)
Nothing after `plan_rank` asks which placement, engine or capability the job has.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from megatron_qrl.config import ConfigError

from .sync.base import is_sharded


def check_rl_layout(cfg) -> None:
    """Layouts the RL loop runs: any trainer layout with embedded engines, colocated or disaggregated."""
    if cfg.lora.enabled and cfg.rollout.placement == "disaggregated":
        raise ConfigError("lora.enabled with rollout.placement=disaggregated is not implemented (the adapters-only "
                         "sync runs in-process): use rollout.placement=colocated for QeRL mode")
    t = cfg.trainer
    colocated_sharded = is_sharded(cfg) and cfg.rollout.placement == "colocated"
    if colocated_sharded and (cfg.lora.enabled or cfg.rollout.engine != "embedded"):
        what = "lora.enabled" if cfg.lora.enabled else f"rollout.engine={cfg.rollout.engine}"
        raise ConfigError(
            f"{what} with a sharded colocated trainer (trainer.tensor_parallel={t.tensor_parallel}, pipeline_parallel="
            f"{t.pipeline_parallel}, expert_parallel={t.expert_parallel}) is not implemented: use data parallelism "
            "only, or rollout.placement=disaggregated")
    if t.expert_parallel > 1 and t.tensor_parallel > 1 and cfg.trace.enabled:
        raise ConfigError("TRACE replay under trainer.expert_parallel>1 together with tensor_parallel>1 is not "
                         "implemented (each dispatch source holds a sequence shard; trace/lookup.py ExpertSources): "
                         "set trace.enabled=false or trainer.tensor_parallel=1")


def process_group_timeout_minutes(cfg) -> int:
    """Disaggregated engine ranks wait in a collective while the trainers run the SFT warm start."""
    return 120 if cfg.rollout.placement == "disaggregated" else 10


# --------------------------------------------------------------------------------- what a rank holds
class TrainerSide:
    """A rank that trains: checkpoints are the trainer's state."""

    trains = True

    def __init__(self, trainer):
        self.trainer = trainer

    def num_params(self) -> int:
        return sum(p.numel() for c in self.trainer.model for p in c.parameters())

    def load(self, path: str, load_optimizer: bool = True) -> dict:
        return self.trainer.load(path, load_optimizer=load_optimizer)

    def save(self, path: str, extra: dict) -> None:
        self.trainer.save(path, extra)

    def load_hf(self, hf_path: str) -> bool:
        """The model directory's safetensors, into every shard."""
        from megatron_qrl.convert.load_hf import load_hf_weights

        load_hf_weights(self.trainer, hf_path)
        return True

    def warm_start(self, s) -> None:
        from .warm_start import sft_warm_start

        sft_warm_start(s)


class EngineSide:
    """An engine rank of a disaggregated job: no trainer; it joins the collective checkpoint read and write
    (extra state only) and gets its weights from the trainers' sync."""

    trains = False
    trainer = None

    def num_params(self) -> int:
        return 0

    def load(self, path: str, load_optimizer: bool = True) -> dict:
        from megatron_qrl.trainer import checkpoint as ckpt

        return ckpt.load(None, path, load_optimizer)

    def save(self, path: str, extra: dict) -> None:
        from megatron_qrl.trainer import checkpoint as ckpt

        ckpt.save(None, path, extra)

    def load_hf(self, hf_path: str) -> bool:
        return False

    def warm_start(self, s) -> None:
        pass


# ------------------------------------------------------------------------------------------ engines
class EmbeddedEngines:
    """Builds (and after a failure rebuilds) this rank's embedded engine."""

    def build(self, cfg):
        from .engines import build_engine

        return build_engine(cfg)

    def restart(self, old, cfg):
        try:
            old.release_memory()
        except Exception:  # noqa: BLE001 - a broken engine may not even release cleanly
            pass
        return self.build(cfg)


class SGLangEngines:
    """This rank's SGLangEngine; the adapter restarts its Engine / launched servers itself."""

    def build(self, cfg):
        import torch

        from megatron_qrl.rollout.sglang import build_sglang_engine
        from megatron_qrl.rollout.sglang.names import qwen3_moe_name_map

        gpu = torch.cuda.current_device() if torch.cuda.is_available() else 0
        return build_sglang_engine(cfg, name_map=qwen3_moe_name_map(cfg.model), base_gpu_id=gpu)

    def restart(self, old, cfg):
        old.restart()
        return old


# -------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class RankPlan:
    """What this rank is, resolved once from the config, the placement and the rank."""

    place: object                            # megatron_qrl.platform.Placement
    trains: bool                             # holds a Trainer (else: a disaggregated job's engine rank)
    engines: Optional[object]                # EmbeddedEngines / SGLangEngines, or None: holds no engine
    assemble: Callable                       # (s) -> None: sets s.weights, s.rollouts, s.guard / s.engine_rank

    def side(self, trainer):
        return TrainerSide(trainer) if self.trains else EngineSide()


def plan_rank(cfg, world_size: int, rank: int) -> RankPlan:
    """Resolve this rank's side of the job (see the module docstring)."""
    from megatron_qrl.platform import Placement

    place = Placement.from_config(cfg, world_size)
    if cfg.rollout.engine == "sglang" and cfg.rollout.placement == "disaggregated":
        return RankPlan(place, True, SGLangEngines() if rank == 0 else None, _sglang_servers)
    if not place.disaggregated:
        engines = SGLangEngines() if cfg.rollout.engine == "sglang" else EmbeddedEngines()
        return RankPlan(place, True, engines, _colocated)
    if place.is_trainer(rank):
        return RankPlan(place, True, None, _remote_trainer)
    return RankPlan(place, False, EmbeddedEngines(), _engine_rank)


def _trainer_guard(s) -> None:
    from .guards import StepGuard

    s.guard = StepGuard(s)


def _colocated(s) -> None:
    from .rollouts import ColocatedRollouts
    from .sync import in_process_sync

    s.weights = in_process_sync(s.cfg, s.trainer, s.engine_ready)
    s.rollouts = ColocatedRollouts(s, s.weights)
    _trainer_guard(s)


def _sglang_servers(s) -> None:
    from .rollouts import SGLangServerRollouts
    from .sync import SGLangServerSync

    s.weights = SGLangServerSync(s.cfg, s.trainer, lambda: s.engine)
    s.rollouts = SGLangServerRollouts(s, s.weights)
    _trainer_guard(s)


def _remote_trainer(s) -> None:
    from megatron_qrl.platform.distributed import weight_sync_group

    from .commands import CommandChannel
    from .rollouts import RemoteRollouts
    from .sync import BroadcastSync

    group = weight_sync_group()
    s.weights = BroadcastSync(s.cfg, s.trainer, group)
    s.rollouts = RemoteRollouts(s, s.placement, s.weights, CommandChannel(group))
    _trainer_guard(s)


def _engine_rank(s) -> None:
    from megatron_qrl.platform.distributed import weight_sync_group

    from .rollouts import EngineRank

    s.engine_rank = EngineRank(s, s.placement, weight_sync_group())
