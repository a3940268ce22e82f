"""Everything one RL run holds, built once: trainer (with its TRACE replay), engine (with its TRACE recorder),
tokenizer, data, reward, and this rank's side of the job (pipeline/job.py: its Rollouts and WeightSync, or its
engine rank's loop).

Also the small helpers the loop in launch/train.py calls (the trainer batch, resume / SFT warm start,
checkpoints, step metrics).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_qrl.data import PromptBatches, Tokenizer, prepare_inputs, task_reward
from megatron_qrl.rollout.protocol import SamplingParams
from megatron_qrl.run_dir import RunDirPlan

from .checkpoints import save_checkpoint
from .engines import build_engine, engine_config
from .job import check_rl_layout, plan_rank, process_group_timeout_minutes
from .rollout_batch import RolloutBatch
from .rollouts import generate_shard
from .run_state import complete_checkpoints
from .warm_start import sft_warm_start

__all__ = ["RunSetup", "build_engine", "check_job", "engine_config", "generate_shard", "resume_or_warm_start",
           "save_checkpoint", "sft_warm_start", "trainer_batch"]
_log = logging.getLogger(__name__)
# trainer stat names -> the metric names of docs/metrics.md
_TRAIN_KEYS = {"grad_norm": "train/grad_norm", "lr": "train/lr", "time/train_step_s": "train/step_s"}


@dataclass
class RunSetup:
    cfg: Any
    trainer: Any
    engine: Any
    tokenizer: Tokenizer
    train_set: Any
    eval_set: list
    prompts: PromptBatches
    reward_fn: Any
    extra: dict = field(default_factory=dict)
    placement: Any = None               # megatron_qrl.platform.Placement: which ranks train / generate
    side: Any = None                    # job.TrainerSide / EngineSide: what this rank holds in checkpoints
    engines: Any = None                 # job.EmbeddedEngines / SGLangEngines (None: this rank holds no engine)
    weights: Any = None                 # trainer ranks: the WeightSync (pipeline/sync)
    rollouts: Any = None                # trainer ranks: the loop's Rollouts (pipeline/rollouts)
    guard: Any = None                   # trainer ranks: non-finite step skipping, engine restarts (guards.py)
    engine_rank: Any = None             # a disaggregated job's engine ranks: rollouts.EngineRank

    @classmethod
    def build(cls, cfg) -> "RunSetup":
        from megatron_qrl.platform import init_distributed
        from megatron_qrl.platform.distributed import init_process_group
        from megatron_qrl.trace import TraceReplay
        from megatron_qrl.trainer import Trainer

        check_rl_layout(cfg)
        t0 = time.perf_counter()
        tokenizer, train_set, eval_set = prepare_inputs(cfg)   # checked before any process group or file
        init_process_group(timeout_minutes=process_group_timeout_minutes(cfg))
        plan = plan_rank(cfg, dist.get_world_size(), dist.get_rank())
        trainer = Trainer(cfg, trace=TraceReplay.for_config(cfg)) if plan.trains else None
        if not plan.trains:
            init_distributed(cfg)           # the engine rank's one-rank Megatron world
        engine = plan.engines.build(cfg) if plan.engines is not None else None
        prompts = PromptBatches(train_set, cfg.rollout.prompts_per_step, seed=cfg.data.seed)
        reward_fn = cfg.data.reward or task_reward(cfg.data)
        s = cls(cfg, trainer, engine, tokenizer, train_set, eval_set, prompts, reward_fn)
        s.placement, s.side, s.engines = plan.place, plan.side(trainer), plan.engines
        plan.assemble(s)
        _log.info("built in %.1f s: %s", time.perf_counter() - t0, s.describe())
        return s

    def describe(self) -> str:
        """One line for the log: model, layout, engine, data (what a reader checks first)."""
        cfg, m, t = self.cfg, self.cfg.model, self.cfg.trainer
        params = self.side.num_params()
        model = (f"{m.num_layers} layers, hidden {m.hidden_size}, " + (f"{m.num_experts} experts top-"
                 f"{m.moe_router_topk}" if m.num_experts else "dense") + (f", {params / 1e6:.2f}M params on rank 0"
                                                                         if params else ""))
        layout = (f"TP{t.tensor_parallel} PP{t.pipeline_parallel} EP{t.expert_parallel} on "
                  f"{dist.get_world_size()} rank(s)")
        engine = f"{cfg.rollout.engine} engine ({cfg.rollout.placement}, {cfg.rollout.weights} {cfg.rollout.scheme})"
        data = f"data {cfg.data.task} ({len(self.train_set)} train / {len(self.eval_set)} eval prompts)"
        return f"model {model}; trainer {layout}, QAT {cfg.quant.format if cfg.quant.qat else 'off'}; {engine}; {data}"

    def load_checkpoint(self, path: str, load_optimizer: bool = True) -> dict:
        """The trainer's load; an engine rank of a disaggregated job joins the collective read (extra state only)."""
        return self.side.load(path, load_optimizer)

    def restart_engine(self) -> None:
        """Replace a failed engine by a fresh one of the same kind (weights: WeightSync.repush afterwards)."""
        self.engine = self.engines.restart(self.engine, self.cfg)

    def save_config(self) -> None:
        """The resolved config beside the checkpoints (rank 0, atomic)."""
        import os
        from pathlib import Path

        from megatron_qrl.config import dump_config

        if dist.get_rank() != 0:
            return
        out = Path(self.cfg.run.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / "config.yaml.tmp"
        tmp.write_text(dump_config(self.cfg))
        os.replace(tmp, out / "config.yaml")

    # ------------------------------------------------------------------------------ engine memory
    def engine_idle(self) -> None:
        """The engine gives its memory back while the trainer runs (ColocatedRollouts.idle)."""
        self.engine.release_memory()

    def engine_ready(self):
        self.engine.resume_memory()
        return self.engine

    # --------------------------------------------------------------------------------- generation
    def sampling(self, step: int, index_offset: int = 0) -> SamplingParams:
        """Seeded by (run seed, step); each response's generator by its global index in the batch."""
        seed = (self.cfg.rollout.seed * 1_000_003 + step * 101) % (2 ** 31)
        return SamplingParams.from_config(self.cfg.rollout, stop_token_ids=self.tokenizer.stop_ids, seed=seed,
                                          index_offset=index_offset)

    # ------------------------------------------------------------------------------------- metrics
    def step_metrics(self, batch: RolloutBatch, rollouts: list, rollout_s: float) -> dict:
        lens = torch.tensor([len(r.tokens) for r in rollouts], dtype=torch.float32)
        generated = float(lens.sum())
        return {"reward/mean": float(batch.rewards.mean()),
                "reward/std": float(batch.rewards.std(unbiased=False)),
                "response/len_mean": float(lens.mean()),
                "response/stop_frac": sum(r.finish_reason == "stop" for r in rollouts) / max(len(rollouts), 1),
                "rollout/tokens_per_s": generated / max(rollout_s, 1e-9), "time/wall": time.time()}

    @staticmethod
    def step_resources(t_start: float) -> dict:
        """Wall time since t_start and, on a GPU, this rank's peak allocated memory since the last call."""
        out = {"time/step_s": time.perf_counter() - t_start}
        if torch.cuda.is_available():
            out["memory/peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
            torch.cuda.reset_peak_memory_stats()
        return out

    @staticmethod
    def train_key(name: str) -> str:
        """Trainer stat names -> the metric names of docs/metrics.md."""
        return _TRAIN_KEYS.get(name, name if "/" in name else f"train/{name}")


def check_job(cfg, world_size: int) -> None:
    """What can be checked before any process group starts: the RL layout, then the rank count."""
    from megatron_qrl.platform import Placement

    check_rl_layout(cfg)
    cfg.check_world_size(Placement.from_config(cfg, world_size).num_trainers)


def trainer_batch(batch: RolloutBatch, logp_old: Optional[torch.Tensor] = None,
                  weights: Optional[torch.Tensor] = None) -> dict:
    """The trainer's batch dict (megatron_qrl.trainer.batch) for log-probs or a GRPO update (TRACE guides come
    from the trainer's own replay, loaded by the Rollouts' hand_over)."""
    out = {"tokens": batch.tokens, "loss_mask": batch.loss_mask, "r3_expert_ids": batch.r3_expert_ids}
    if batch.r3_mask is not None:
        out["r3_mask"] = batch.r3_mask
    if logp_old is not None:
        out.update(logp_old=logp_old, advantages=batch.advantages, is_weights=weights,
                   num_loss_sequences=float((batch.loss_mask.sum(-1) > 0).sum()))   # rl.loss_agg_mode
        if batch.logp_ref is not None:
            out["logp_ref"] = batch.logp_ref   # rl.kl_mode=loss
    return out


# ------------------------------------------------------------------------------ resume / warm start
def resume_or_warm_start(s: RunSetup, plan: Optional[RunDirPlan] = None) -> int:
    """Resume from the checkpoint `latest` names (returns its step), falling back to older committed ones only
    when its checksums fail (run_state.py has the rule); else load run.init_checkpoint's weights and run the SFT
    warm start (returns 0). When every committed checkpoint is corrupt the run stops rather than start over."""
    from megatron_qrl.trainer.checkpoint import CheckpointCorrupt

    cfg = s.cfg
    plan = plan or RunDirPlan(cfg.run.output_dir, cfg.run.resume, cfg.run.total_steps)
    candidates = complete_checkpoints(cfg.run.output_dir) if cfg.run.resume else []
    for path in candidates:
        try:
            extra = s.load_checkpoint(str(path))
        except CheckpointCorrupt as err:
            _log.warning("skipping a corrupt checkpoint: %s", err)
            s.extra.setdefault("corrupt_checkpoints", []).append(str(path))
            continue
        s.prompts.load_state_dict(extra["data"])
        _log.info("%s", plan.resume_line(path).replace("resume from", "resuming from", 1))
        s.extra.update(saved_step=int(extra["step"]), last_checkpoint=str(path))   # nothing to save at that step
        return int(extra["step"])
    if candidates:
        raise CheckpointCorrupt(f"every checkpoint in {cfg.run.output_dir}/checkpoints is corrupt "
                                f"({', '.join(p.name for p in candidates)}); restore one from a copy, or start over "
                                "with run.resume=false (or another run.output_dir)")
    if cfg.run.init_checkpoint:  # weights only (a converted HF model or another run's checkpoint)
        s.load_checkpoint(cfg.run.init_checkpoint, load_optimizer=False)
        _log.info("new run in %s from the weights of %s", cfg.run.output_dir, cfg.run.init_checkpoint)
    elif cfg.model.hf_path and s.side.load_hf(cfg.model.hf_path):   # the model directory's safetensors
        _log.info("new run in %s from the Hugging Face weights of %s", cfg.run.output_dir, cfg.model.hf_path)
    else:
        _log.info("new run in %s", cfg.run.output_dir)
    if cfg.run.sft_steps:
        s.side.warm_start(s)   # engine ranks: nothing (they wait in the first command's collective)
    return 0


