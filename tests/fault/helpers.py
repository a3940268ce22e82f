"""Shared helpers of the fault-injection suite (docs/RELIABILITY.md): launching the real RL job."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# tests/test_loop.py's tiny overrides (W4A16 so two data-parallel engines sample what one does)
OVERRIDES = ["run.eval_every=0", "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=8",
             "rollout.scheme=w4a16", "trace.enabled=false", "trainer.micro_batch_size=4", "run.sft_steps=2",
             "run.wandb_mode=disabled"]
# wall-clock quantities differ between any two runs; fault/* counters differ by design
NOT_COMPARED = ("time", "rollout/s", "rollout/tokens_per_s", "sync/s", "train/step_s", "fault/", "trace/s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_cmd(out: Path, steps: int, nproc: int = 1, extra=()) -> list[str]:
    args = ["--config", str(ROOT / "configs/tiny_cpu.yaml"), f"run.output_dir={out}", f"run.total_steps={steps}",
            *OVERRIDES, *extra]
    if nproc == 1:
        return [sys.executable, "-m", "megatron_qrl.launch.train", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
            str(free_port()), "-m", "megatron_qrl.launch.train", *args]


def train_env(inject: str = "") -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "QRL_NO_PROGRESS": "1", "WANDB_MODE": "disabled"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "QRL_FAULT_INJECT"):
        env.pop(k, None)
    if inject:
        env["QRL_FAULT_INJECT"] = inject
    return env


def run_train(out: Path, steps: int, nproc: int = 1, extra=(), inject: str = "", expect_rc: int = 0):
    r = subprocess.run(train_cmd(out, steps, nproc, extra), cwd=ROOT, env=train_env(inject), capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == expect_rc, f"rc={r.returncode}\n{r.stderr[-4000:]}"
    return r


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(NOT_COMPARED) and k != "step"}
