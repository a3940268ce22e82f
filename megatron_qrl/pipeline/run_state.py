"""Checkpoint paths and the `latest` rule now live in megatron_qrl/run_dir.py (light: no torch, so `qrl train`
checks a run directory before importing Megatron-Core); these names stay importable from here."""
from megatron_qrl.run_dir import (checkpoint_dir, complete_checkpoints, latest_checkpoint, mark_latest, step_of,
                                  step_path, uncommitted_checkpoints)

__all__ = ["checkpoint_dir", "complete_checkpoints", "latest_checkpoint", "mark_latest", "step_of", "step_path",
           "uncommitted_checkpoints"]
