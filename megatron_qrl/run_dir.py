"""A run directory holds one run: its config.yaml, checkpoints and metrics.jsonl belong together.

This module is light on purpose (no torch): `qrl train` checks the directory before it spends seconds
importing Megatron-Core, and `qrl eval` finds checkpoints with it.

Checkpoints: `{output_dir}/checkpoints/step_XXXXXX`, plus a `latest` pointer written atomically (temp file +
rename) only after the checkpoint itself is complete. One rule decides what a restart resumes from:
`latest` is the commit point. A checkpoint counts once `latest` names it or a later step; a complete
`step_*` newer than `latest` (killed between its rename and the pointer update) has not been committed: it
is removed at the next start and its steps run again; with no `latest` there is nothing to resume. Among
the committed ones resume takes the one `latest` names, and falls back to older complete ones only when its
checksums fail (pipeline/setup.resume_or_warm_start). The metrics stream follows the same rule: the loop
writes a step's metrics line before the checkpoint of that step, and on resume the lines of steps at or
after the resumed one are cut (logging/metrics.py), so each step is in metrics.jsonl exactly once.

Configuration: resume is on by default and output_dir often stays the same between commands, so rerunning
with another model shape, data set, seed or algorithm would otherwise continue (or break) the old run and
leave a config.yaml that no longer describes the checkpoints. Before anything is built, `inspect_run_dir`
compares the new config with the saved one when there is a committed checkpoint to resume:
- fields that change what the run computes (everything not in RESUMABLE) must be equal, else the run is
  refused with a message naming each field (saved -> now) and the ways out: a new run.output_dir,
  run.resume=false (start over here), or the saved values;
- RESUMABLE fields (how long, how often it reports or saves, where it writes, how it is laid out on ranks:
  checkpoints load under any layout) may change; the resume line names them.
run.resume=false starts over: the previous run's files (checkpoints/, metrics.jsonl, config.yaml,
wandb_run_id) are removed first, so no old checkpoint can be mistaken for the new run's.
config.yaml itself is written only after the checkpoint loaded (RunSetup.save_config).
"""
from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from megatron_qrl.errors import InputError

_log = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"
RUN_FILES = ("checkpoints", "metrics.jsonl", CONFIG_FILE, "wandb_run_id")
# Dotted fields (or prefixes ending in ".") that a resumed run may change: none changes the trajectory
# (run.total_steps stretches the AQN and LR schedules to the new length; docs/RELIABILITY.md says so).
RESUMABLE = (
    "run.output_dir", "run.total_steps", "run.stop_after_steps", "run.eval_every", "run.checkpoint_every",
    "run.save_checkpoints", "run.resume", "run.wandb_project", "run.wandb_mode", "run.max_nonfinite_steps",
    "run.init_checkpoint",   # only read when the run has no checkpoint of its own
    "trainer.tensor_parallel", "trainer.pipeline_parallel", "trainer.expert_parallel",
    "trainer.expert_tensor_parallel", "trainer.sequence_parallel", "trainer.micro_batch_size",
    "rollout.placement", "rollout.num_engine_ranks", "rollout.max_batch_size", "rollout.max_generate_retries",
    "rollout.sglang_server_urls", "rollout.sglang_router_url", "rollout.sglang_mem_fraction",
    "rollout.sglang_max_restarts", "rollout.sglang_update_group_addr", "rollout.sglang_update_group_port",
    "rollout.weight_sync_bucket_mb", "trace.spill_dir", "trace.memory_budget_mb",
    "data.eval_size", "data.reward_time_limit_s",
)
_ABSENT = "(absent)"


# ------------------------------------------------------------------------------------ checkpoints
def checkpoint_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def step_path(output_dir: str | Path, step: int) -> Path:
    return checkpoint_dir(output_dir) / f"step_{step:06d}"


def step_of(path: str | Path) -> int:
    return int(Path(path).name[5:])


def latest_checkpoint(output_dir: str | Path) -> Optional[Path]:
    pointer = checkpoint_dir(output_dir) / "latest"
    if not pointer.is_file():
        return None
    path = checkpoint_dir(output_dir) / pointer.read_text().strip()
    return path if path.is_dir() else None


def _complete(output_dir: str | Path) -> list[Path]:
    """`step_*` directories holding a manifest (written last, so a save killed midway never qualifies; its
    `.step_*.tmp-*` directory does not match either), newest first."""
    found = [d for d in checkpoint_dir(output_dir).glob("step_*")
             if d.is_dir() and d.name[5:].isdigit() and (d / "manifest.json").is_file()]
    return sorted(found, key=step_of, reverse=True)


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Resume candidates, newest first: the complete checkpoints `latest` has committed (see the module
    docstring). Checksums are verified when one is loaded (trainer/checkpoint.py)."""
    pointer = checkpoint_dir(output_dir) / "latest"
    if not pointer.is_file():
        return []
    name = pointer.read_text().strip()
    if not (name.startswith("step_") and name[5:].isdigit()):
        return []
    return [d for d in _complete(output_dir) if step_of(d) <= step_of(name)]


def uncommitted_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete `step_*` directories that `latest` never named (newer than it, or any when it is absent)."""
    committed = set(complete_checkpoints(output_dir))
    return [d for d in _complete(output_dir) if d not in committed]


def mark_latest(output_dir: str | Path, path: str | Path) -> None:
    pointer = checkpoint_dir(output_dir) / "latest"
    tmp = pointer.with_suffix(".tmp")
    tmp.write_text(Path(path).name + "\n")
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, pointer)


# ------------------------------------------------------------------------- the saved configuration


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists stay values."""
    if not isinstance(tree, dict):
        return {prefix.rstrip("."): tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def is_resumable(name: str) -> bool:
    return any(name == f or (f.endswith(".") and name.startswith(f)) for f in RESUMABLE)


def config_changes(saved: dict, cfg) -> dict[str, tuple[Any, Any]]:
    """{field: (saved value, new value)} for every field that differs. The saved file is first completed with
    today's defaults when it still validates (a field added since then is not a change)."""
    from megatron_qrl.config import ConfigError, from_dict

    try:
        saved = from_dict(saved).model_dump()
    except (ConfigError, ValueError, TypeError):
        pass
    old, new = flatten(saved), flatten(cfg.model_dump())
    return {k: (old.get(k, _ABSENT), new.get(k, _ABSENT)) for k in sorted(old.keys() | new.keys())
            if old.get(k, _ABSENT) != new.get(k, _ABSENT)}


@dataclass
class RunDirPlan:
    """What this command will do with run.output_dir (read-only: computed identically on every rank)."""

    output_dir: Path
    resume: bool
    total_steps: int = 0
    resume_from: Optional[Path] = None          # the committed checkpoint `latest` names
    changed: dict = field(default_factory=dict)  # resumable fields that differ from the saved config
    previous: list = field(default_factory=list)  # run files that run.resume=false removes
    uncommitted: list = field(default_factory=list)

    def describe(self) -> str:
        if self.resume_from is not None:
            return f"would {self.resume_line()}"
        if self.previous:
            return (f"would start over in {self.output_dir} (run.resume=false) after removing its previous run "
                    f"({', '.join(self.previous)})")
        return f"would start a new run in {self.output_dir}"

    def resume_line(self, path: Optional[Path] = None) -> str:
        path = path or self.resume_from
        text = f"resume from {path.name} of {self.output_dir} ({step_of(path)} of {self.total_steps} steps done)"
        if self.changed:
            changes = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in self.changed.items())
            text += f"; changed since it was saved: {changes}"
            if "run.total_steps" in self.changed:
                text += " (the AQN noise and LR schedules follow the new length)"
        return text


def _saved_config(out: Path) -> Optional[dict]:
    path = out / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise InputError(f"{path} is not valid YAML ({err}); it belongs to the run whose checkpoints are in "
                         f"{checkpoint_dir(out)}: restore it, or start over with run.resume=false, or choose "
                         "another run.output_dir") from None
    return data if isinstance(data, dict) else None


def _conflict(out: Path, ckpt: Path, diffs: dict) -> InputError:
    lines = "\n".join(f"  {k}: {a!r} (saved) -> {b!r} (now)" for k, (a, b) in diffs.items())
    return InputError(
        f"{out} holds a run (checkpoint {ckpt.name}) made with another configuration; resuming it would mix two "
        f"runs:\n{lines}\nChoose a new run.output_dir (e.g. run.output_dir={out}_2), or start over in this "
        f"directory with run.resume=false (removes its checkpoints and metrics), or set these fields back to "
        f"the values in {out / CONFIG_FILE}")


def _check_data_path(cfg) -> None:
    """data.path exists: checked here, before the seconds of start-up, not when the data set is built."""
    if cfg.data.task in ("jsonl", "parquet", "gsm8k") and cfg.data.path and not Path(cfg.data.path).is_file():
        raise InputError(f"data.path '{cfg.data.path}' does not exist (data.task={cfg.data.task} reads it); set "
                         "data.path to a local .jsonl or .parquet file")


# the model fields a checkpoint's tensors are shaped by (trainer/checkpoint.py refuses a mismatch at load)
SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                "ffn_hidden_size", "num_experts", "moe_ffn_hidden_size", "moe_shared_expert_ffn_hidden_size",
                "vocab_size")


def _check_init_checkpoint(cfg) -> None:
    """run.init_checkpoint is a checkpoint of this model's shape (read only by a run without a checkpoint of its
    own): checked from its manifest, before the start-up, with the overrides that would make the shapes agree."""
    import json

    path = cfg.run.init_checkpoint
    if not path:
        return
    manifest = Path(path) / "manifest.json"
    if not manifest.is_file():
        what = "does not exist" if not Path(path).exists() else "is not a megatron-qrl checkpoint (no manifest.json)"
        raise InputError(f"run.init_checkpoint '{path}' {what}; point it to a checkpoint directory (a run's "
                         "checkpoints/step_XXXXXX, or the output of `qrl convert hf-to-mcore`)")
    try:
        saved = json.loads(manifest.read_text()).get("model") or {}
    except (ValueError, AttributeError):
        return   # a damaged manifest: the load names it (CheckpointCorrupt)
    mine = cfg.model.model_dump()
    for m in (saved, mine):   # kv_channels None means hidden / heads: compare the head dims themselves
        if m.get("kv_channels") is None and m.get("hidden_size") and m.get("num_attention_heads"):
            m["kv_channels"] = m["hidden_size"] // m["num_attention_heads"]
    diff = {k: (saved[k], mine.get(k)) for k in SHAPE_FIELDS if k in saved and saved[k] != mine.get(k)}
    if diff:
        raise InputError(f"run.init_checkpoint '{path}' holds a model of another shape ("
                         + ", ".join(f"model.{k} {a} there, {b} here" for k, (a, b) in diff.items())
                         + "); set " + " ".join(f"model.{k}={a}" for k, (a, _) in diff.items())
                         + f", or copy the `model` section of {manifest} into the run's config")


def inspect_run_dir(cfg) -> RunDirPlan:
    """Decide (without writing) what the run does with its output_dir; raises InputError on a conflict."""
    out = Path(cfg.run.output_dir)
    plan = RunDirPlan(out, cfg.run.resume, cfg.run.total_steps)
    _check_data_path(cfg)
    if not cfg.run.resume:
        plan.previous = [name for name in RUN_FILES if (out / name).exists()]
        _check_init_checkpoint(cfg)
        return plan
    candidates = complete_checkpoints(out)
    plan.uncommitted = uncommitted_checkpoints(out)
    if not candidates:
        _check_init_checkpoint(cfg)
        return plan
    plan.resume_from = latest_checkpoint(out) or candidates[0]
    saved = _saved_config(out)
    if saved is not None:
        diffs = config_changes(saved, cfg)
        fatal = {k: v for k, v in diffs.items() if not is_resumable(k)}
        if fatal:
            raise _conflict(out, plan.resume_from, fatal)
        plan.changed = {k: v for k, v in diffs.items() if k not in ("run.output_dir", "run.resume")}
    return plan


def prepare_run_dir(cfg, rank: int) -> RunDirPlan:
    """inspect_run_dir, then (rank 0) carry out its removals: run.resume=false's previous run, and complete
    checkpoints newer than `latest` (never committed; the run recomputes those steps)."""
    plan = inspect_run_dir(cfg)
    if rank != 0:
        return plan
    if plan.previous:
        _log.info("run.resume=false: starting over in %s; removing its previous run (%s)", plan.output_dir,
                  ", ".join(plan.previous))
        for name in plan.previous:
            target = plan.output_dir / name
            shutil.rmtree(target) if target.is_dir() else target.unlink()
    for path in plan.uncommitted:
        _log.info("removing %s: its save finished but `latest` never named it (the job was killed in between); "
                  "its steps run again", path)
        shutil.rmtree(path, ignore_errors=True)
    return plan


def checkpoint_due(cfg, steps_done: int) -> bool:
    """A periodic checkpoint after `steps_done` RL steps (the loop also saves the last step; see config)."""
    return cfg.run.save_checkpoints and bool(cfg.run.checkpoint_every) and steps_done % cfg.run.checkpoint_every == 0


def resume_hint(cfg) -> str:
    """What is on disk after an interrupted `qrl train`, and how to continue (the Ctrl-C line)."""
    from megatron_qrl.logging import read_metrics

    out = Path(cfg.run.output_dir)
    latest = latest_checkpoint(out)
    try:
        logged = len({r["step"] for r in read_metrics(out) if isinstance(r.get("step"), int)})
    except OSError:
        logged = 0
    if not cfg.run.save_checkpoints:
        return f"run.save_checkpoints=false: nothing was saved to resume from ({logged} steps in metrics.jsonl)"
    if latest is None:
        return (f"no checkpoint was written yet ({logged} steps in metrics.jsonl); rerun the same command to start "
                "the run again")
    done = step_of(latest)
    return (f"the last checkpoint is {latest} ({done} of {cfg.run.total_steps} steps done; metrics.jsonl holds "
            f"{logged} steps, the ones after it run again); rerun the same command to resume from it")
