"""Slurm requeue of the real RL job (local one-node cluster, tools/slurm_local_up.sh): `scontrol requeue` while
slurm/trace_moe.sh runs 2 gloo ranks; the second attempt resumes from the last checkpoint (steps before it are
not re-run, the metrics stream continues with each step once) and completes."""
import json
import subprocess
import sys
import time

import pytest

from .helpers import OVERRIDES, ROOT

sys.path.insert(0, str(ROOT / "tests"))
from test_slurm_local import cancel_after, cluster, submit_trace_moe, wait_for, wait_for_state  # noqa: E402,F401

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(600)]


def test_requeued_rl_job_resumes_from_its_last_checkpoint(cluster, tmp_path, cancel_after):
    out, log = tmp_path / "run", tmp_path / "job.out"
    job = submit_trace_moe(ROOT / "configs/tiny_cpu.yaml", f"run.output_dir={out}", "run.total_steps=6",
                           "run.checkpoint_every=1", *OVERRIDES, output=log, OMP_NUM_THREADS="1",
                           WANDB_MODE="disabled", QRL_NO_PROGRESS="1")
    cancel_after(job)
    latest = out / "checkpoints" / "latest"
    metrics = out / "metrics.jsonl"
    # a step's metrics line is written before its checkpoint (run_dir.py): wait for the checkpoint of step 2
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2 and latest.exists()
             and int(latest.read_text().strip()[5:]) >= 2, 400, "2 logged and checkpointed RL steps")
    subprocess.run(["scontrol", "requeue", str(job)], check=True, capture_output=True)
    t_requeue = time.time()
    resume_from = int(latest.read_text().strip()[5:])  # a save racing the requeue can only make this later
    info = wait_for_state(job, {"COMPLETED", "FAILED"}, timeout=500)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", text[-3000:]
    assert "restart 0" in text and "restart 1" in text
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [m["step"] for m in records] == list(range(6))
    assert resume_from >= 2
    first_rerun = min(m["step"] for m in records if m["time/wall"] > t_requeue)
    assert first_rerun >= resume_from, f"the requeued job re-ran step {first_rerun}, before its checkpoint"
    assert all(m["time/wall"] < t_requeue for m in records if m["step"] < resume_from)
    assert latest.read_text().strip() == "step_000006"
