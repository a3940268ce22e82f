"""Everything one RL run holds, built once: trainer (with its TRACE replay), engine (with its TRACE recorder),
tokenizer, data, reward.

Also the small per-step helpers the loop in launch/train.py calls (sharded generation across
data-parallel ranks, the trainer batch, resume / SFT warm start, checkpoints, step metrics).
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
from megatron_qrl.trace.recorder import without_captures

from .guards import StepGuard
from .losses import sft_loss
from .rollout_batch import RolloutBatch, encode_prompts, sft_batch
from .rollout_service import build_rollouts, engine_share, from_bytes, to_bytes
from megatron_qrl.run_dir import RunDirPlan
from .run_state import complete_checkpoints, mark_latest, step_path
from .weight_sync import check_rl_layout

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
    rollouts: Any = None                # the loop's rollout interface (rollout_service.py)
    guard: Optional[StepGuard] = None   # non-finite step skipping, engine restarts (guards.py)

    @classmethod
    def build(cls, cfg) -> "RunSetup":
        from megatron_qrl.platform import Placement, init_distributed
        from megatron_qrl.platform.distributed import init_process_group
        from megatron_qrl.trace import TraceReplay
        from megatron_qrl.trainer import Trainer

        check_rl_layout(cfg)
        t0 = time.perf_counter()
        tokenizer, train_set, eval_set = prepare_inputs(cfg)   # checked before any process group or file
        # disaggregated: engines wait in a collective while the trainers run the SFT warm start
        init_process_group(timeout_minutes=120 if cfg.rollout.placement == "disaggregated" else 10)
        place = Placement.from_config(cfg, dist.get_world_size())
        me = dist.get_rank()   # disaggregated: trainer ranks hold no engine, engine ranks no trainer
        trainer = Trainer(cfg, trace=TraceReplay.for_config(cfg)) if place.is_trainer(me) else None
        if trainer is None:
            init_distributed(cfg)           # the engine rank's one-rank Megatron world
        if cfg.rollout.engine == "sglang":    # in-process per rank, or trainer rank 0 -> servers (sglang_rollouts.py)
            from .sglang_rollouts import build_sglang_run_engine

            engine = build_sglang_run_engine(cfg, me)
        else:
            engine = build_engine(cfg) if place.is_engine(me) else None
        prompts = PromptBatches(train_set, cfg.rollout.prompts_per_step, seed=cfg.data.seed)
        reward_fn = cfg.data.reward or task_reward(cfg.data)
        s = cls(cfg, trainer, engine, tokenizer, train_set, eval_set, prompts, reward_fn)
        s.placement = place
        s.rollouts = build_rollouts(s, place)
        s.guard = StepGuard(s) if trainer is not None else None   # engine ranks of a disaggregated job: none
        _log.info("built in %.1f s: %s", time.perf_counter() - t0, s.describe())
        return s

    def describe(self) -> str:
        """One line for the log: model, layout, engine, data (what a reader checks first)."""
        cfg, m, t = self.cfg, self.cfg.model, self.cfg.trainer
        params = sum(p.numel() for c in self.trainer.model for p in c.parameters()) if self.trainer else 0
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
        from megatron_qrl.trainer import checkpoint as ckpt

        if self.trainer is None:
            return ckpt.load(None, path, load_optimizer)
        return self.trainer.load(path, load_optimizer=load_optimizer)

    def restart_engine(self) -> None:
        """Replace a failed engine by a fresh one of the same kind (weights: sync_weights afterwards)."""
        if self.cfg.rollout.engine == "sglang":   # the adapter restarts its Engine / launched servers itself
            self.engine.restart()
            return
        old, self.engine = self.engine, None
        try:
            old.release_memory()
        except Exception:  # noqa: BLE001 - a broken engine may not even release cleanly
            pass
        self.engine = build_engine(self.cfg)

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
        """Colocated placement: the engine gives its memory back while the trainer runs."""
        if self.cfg.rollout.placement == "colocated":
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


class InEngineWorld:
    """An engine whose every method call runs in its own Megatron world (platform.engine_world): the
    colocated engine beside a sharded trainer builds and runs the whole model as a one-rank world."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        from megatron_qrl.platform import engine_world

        attr = getattr(self._engine, name)
        if not callable(attr):
            return attr

        def in_world(*args, **kwargs):
            with engine_world():
                return attr(*args, **kwargs)
        return in_world


def build_engine(cfg):
    """The embedded engine of this rank (built in its Megatron world; see InEngineWorld)."""
    from megatron_qrl.platform import engine_world
    from megatron_qrl.platform.distributed import engine_world_active
    from megatron_qrl.rollout.embedded import EmbeddedEngine

    with engine_world():
        engine = EmbeddedEngine(engine_config(cfg))
    return InEngineWorld(engine) if engine_world_active() else engine


def engine_config(cfg):
    """The engine builds the whole model: the same config with a 1x1x1 trainer layout (the model definition
    reads its pipeline split from the config)."""
    one = {"tensor_parallel": 1, "pipeline_parallel": 1, "expert_parallel": 1, "expert_tensor_parallel": 1}
    return cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update=one)})


def check_job(cfg, world_size: int) -> None:
    """What can be checked before any process group starts: the RL layout, then the rank count."""
    from megatron_qrl.platform import Placement

    check_rl_layout(cfg)
    cfg.check_world_size(Placement.from_config(cfg, world_size).num_trainers)


def generate_shard(s: RunSetup, prompts: list, step: int, first_index: int = 0):
    """Colocated: each rank's engine generates a contiguous share of the prompt groups (the same shares,
    seeds and sample indices as that many disaggregated engines); all ranks get all. Sample indices start
    at first_index (a step's later generate calls draw fresh seeds)."""
    G = s.cfg.rollout.group_size
    rank, world = dist.get_rank(), dist.get_world_size()
    first, stop = engine_share(len(prompts), rank, world)
    samples = [p for p in prompts[first:stop] for _ in range(G)]
    sampling = s.sampling(step, index_offset=first_index + first * G)
    rollouts = s.guard.generate(encode_prompts(s.tokenizer, samples), sampling, step)  # restarts a failed engine
    rollouts = without_captures(rollouts)   # TRACE captures stay with the engine's recorder: a handle travels
    if world > 1:
        parts: list = [None] * world
        dist.all_gather_object(parts, to_bytes((samples, rollouts)))
        parts = [from_bytes(p) for p in parts]
        samples = [x for p in parts for x in p[0]]
        rollouts = [x for p in parts for x in p[1]]
    return samples, rollouts


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
    elif cfg.model.hf_path and s.trainer is not None:   # the model directory's safetensors, into every shard
        from megatron_qrl.convert.load_hf import load_hf_weights

        load_hf_weights(s.trainer, cfg.model.hf_path)
        _log.info("new run in %s from the Hugging Face weights of %s", cfg.run.output_dir, cfg.model.hf_path)
    else:
        _log.info("new run in %s", cfg.run.output_dir)
    if cfg.run.sft_steps and s.trainer is not None:
        sft_warm_start(s)
    return 0


def sft_warm_start(s: RunSetup) -> None:
    """Supervised steps on the task's reference responses at a constant run.sft_lr; the RL LR schedule then
    starts from its beginning (the scheduler's state is restored afterwards)."""
    from megatron_qrl.logging import ProgressLines, progress_bar

    cfg, sched = s.cfg, s.trainer.scheduler
    lr = cfg.run.sft_lr or cfg.trainer.lr
    groups = s.trainer.optimizer.param_groups
    saved = (sched.max_lr, sched.min_lr, sched.num_steps, [(g.get("max_lr"), g.get("min_lr")) for g in groups])
    sched.max_lr = sched.min_lr = lr
    for g in groups:  # Megatron's groups carry their own max/min LR, which the scheduler prefers
        g["max_lr"] = g["min_lr"] = lr
    sched.step(increment=0)
    bs = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    lines = ProgressLines("SFT warm start", cfg.run.sft_steps)
    _log.info("SFT warm start: %d steps of %d reference responses at lr %g", cfg.run.sft_steps, bs, lr)
    for i in progress_bar(range(cfg.run.sft_steps), desc="SFT warm start", rank=dist.get_rank(), unit="step"):
        rows = [s.train_set[(i * bs + j) % len(s.train_set)] for j in range(bs)]
        stats = s.trainer.train_step(sft_batch(rows, s.tokenizer), sft_loss)
        s.extra["sft/loss"] = stats.get("sft/loss")
        lines.update(i + 1, loss=s.extra["sft/loss"])
    sched.max_lr, sched.min_lr, sched.num_steps, group_lrs = saved
    for g, (hi, lo) in zip(groups, group_lrs):
        for key, value in (("max_lr", hi), ("min_lr", lo)):
            if value is None:
                g.pop(key, None)
            else:
                g[key] = value
    sched.step(increment=0)


def save_checkpoint(s: RunSetup, step: int) -> str:
    """The checkpoint after `step` RL steps, once per step and process; `latest` moves to it last (run_state.py).
    A failed write leaves no partial directory behind; a full disk raises DiskFull (checkpoint_write)."""
    from megatron_qrl import fault_inject

    from .checkpoint_write import checkpoint_write

    if s.trainer is not None and s.extra.get("saved_step") == step:   # written already, or loaded by resume
        # (engine ranks of a disaggregated job save when trainer rank 0 announces it: always)
        return s.extra["last_checkpoint"]
    path = step_path(s.cfg.run.output_dir, step)
    if hasattr(s.rollouts, "announce_save"):   # disaggregated: engine ranks join the collective write
        s.rollouts.announce_save(step)
    extra = {"step": step, "data": s.prompts.state_dict()}
    t0 = time.perf_counter()
    with checkpoint_write(path):
        if s.trainer is None:   # an engine rank of a disaggregated job joins the collective write
            from megatron_qrl.trainer import checkpoint as ckpt

            ckpt.save(None, str(path), extra)
        else:
            s.trainer.save(str(path), extra)
    fault_inject.kill("kill_before_latest", step - 1, dist.get_rank())     # tests: saved, not yet committed
    if dist.get_rank() == 0:
        mark_latest(s.cfg.run.output_dir, path)
    dist.barrier()
    _log.info("checkpoint %s written in %.1f s: %s", path.name, time.perf_counter() - t0, path)
    s.extra.update(saved_step=step, last_checkpoint=str(path))
    fault_inject.kill("kill_after_checkpoint", step - 1, dist.get_rank())  # tests: committed, next step not begun
    return str(path)
