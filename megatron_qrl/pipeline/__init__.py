"""The RL job's building blocks; launch/train.py strings them together in one screen."""
from .batch_sampling import batch_collector
from .evaluate import evaluate
from .losses import grpo_loss, sft_loss
from .reference_kl import reference_kl
from .rollout_batch import RolloutBatch, build_batch, encode_prompts, generate, sft_batch
from .rollouts import ColocatedRollouts, EngineRank, RemoteRollouts, Rollouts, SGLangServerRollouts, generate_shard
from megatron_qrl.run_dir import checkpoint_due, inspect_run_dir, prepare_run_dir, resume_hint
from .run_state import latest_checkpoint, mark_latest, step_path
from .setup import RunSetup, check_job, resume_or_warm_start, save_checkpoint, trainer_batch
from .sync import WeightSync, sync_weights

__all__ = ["ColocatedRollouts", "EngineRank", "RemoteRollouts", "RolloutBatch", "Rollouts", "RunSetup",
           "SGLangServerRollouts", "WeightSync", "batch_collector", "build_batch", "check_job",
           "checkpoint_due", "encode_prompts", "evaluate", "generate", "generate_shard", "grpo_loss",
           "inspect_run_dir", "latest_checkpoint", "mark_latest", "prepare_run_dir", "reference_kl", "resume_hint",
           "resume_or_warm_start", "save_checkpoint", "sft_batch", "sft_loss", "step_path", "sync_weights",
           "trainer_batch"]
