"""Mirror of the metrics stream to Weights & Biases.

The run id is stored in {output_dir}/wandb_run_id so a requeued or resumed job continues the same W&B run.
Charts use our `step` as x axis (define_metric), not W&B's internal counter: after a restart from an older
checkpoint the replayed steps are still recorded instead of being dropped as "step went backwards".
"""
from __future__ import annotations

import logging
import os
import secrets
import string
from pathlib import Path
from typing import Any, Mapping, Optional

log = logging.getLogger(__name__)

WANDB_ID_FILE = "wandb_run_id"
WANDB_MODES = ("online", "offline", "disabled")
_ENV_ALIASES = {"dryrun": "offline", "run": "online"}


def resolve_wandb_mode(cfg_mode: Optional[str], env: Mapping[str, str]) -> str:
    """cfg.run.wandb_mode, else $WANDB_MODE, else online with $WANDB_API_KEY and offline without.

    Offline needs no network and writes a local run that `wandb sync` can upload later.
    """
    if cfg_mode:
        if cfg_mode not in WANDB_MODES:
            raise ValueError(f"run.wandb_mode must be one of {WANDB_MODES}, got {cfg_mode!r}")
        return cfg_mode
    env_mode = env.get("WANDB_MODE", "").strip().lower()
    env_mode = _ENV_ALIASES.get(env_mode, env_mode)
    if env_mode in WANDB_MODES:
        return env_mode
    return "online" if env.get("WANDB_API_KEY") else "offline"


def new_run_id() -> str:
    """8 lowercase alphanumerics, the shape of ids W&B generates itself."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def _run_id(output_dir: Path, resume: bool) -> str:
    """The stored id when resuming, else a fresh one written (atomically) for the next resume."""
    id_file = output_dir / WANDB_ID_FILE
    if resume and id_file.is_file():
        stored = id_file.read_text().strip()
        if stored:
            return stored
    run_id = new_run_id()
    tmp = id_file.with_name(WANDB_ID_FILE + ".tmp")
    tmp.write_text(run_id + "\n")
    os.replace(tmp, id_file)
    return run_id


class WandbSink:
    """One W&B run per output_dir; a missing wandb package only warns (the JSONL stream is the record)."""

    def __init__(self, output_dir: str | Path, project: str, mode: str, config: Optional[dict] = None,
                 resume: bool = True, name: Optional[str] = None):
        self.run = None
        try:
            import wandb
        except ImportError:
            log.warning("wandb is not installed: metrics go to metrics.jsonl only "
                        "(pip install wandb, or set run.wandb_mode=disabled to silence this)")
            return
        output_dir = Path(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        self.run_id = _run_id(output_dir, resume)
        # silent: W&B's own banner and end-of-run summary (~40 lines) say nothing metrics.jsonl does not;
        # the one line below says where the run is
        self.run = wandb.init(project=project, dir=str(output_dir), mode=mode, config=config,
                              id=self.run_id, resume="allow", name=name or output_dir.resolve().name,
                              settings=wandb.Settings(silent=True))
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        if mode == "offline":
            log.info("W&B offline run in %s (upload later: wandb sync %s)", self.run.dir.rsplit("/files", 1)[0],
                     self.run.dir.rsplit("/files", 1)[0])
        else:
            log.info("W&B run %s", getattr(self.run, "url", None) or self.run_id)

    def log(self, record: Mapping[str, Any]) -> None:
        if self.run is not None:
            self.run.log({k: v for k, v in record.items() if v is not None and k != "time"})

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
