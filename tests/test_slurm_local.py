"""A real one-node Slurm cluster on localhost (tools/slurm_local_up.sh): sbatch, srun, requeue, trace_moe.sh.

These run by default (CI is root); deselect locally with `-m "not slurm"`. Job state is read from
`scontrol show job` and, after the controller forgets a job, from the jobcomp/filetxt log (no slurmdbd).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable, Optional

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(170)]

ROOT = Path(__file__).resolve().parents[1]
JOBCOMP_LOG = Path("/var/log/slurm/jobcomp.log")
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                "BOOT_FAIL", "DEADLINE"}


# --- helpers (also what a test of the real training entry through trace_moe.sh will use) --------------------

@pytest.fixture(scope="module")
def cluster():
    """Bring the local cluster up (idempotent, ~2 s when already running)."""
    if os.geteuid() != 0:
        pytest.fail("the Slurm tests start munged/slurmctld/slurmd and need root; run as root (CI does) or "
                    "deselect them with -m 'not slurm'")
    up = subprocess.run(["bash", str(ROOT / "tools/slurm_local_up.sh")], capture_output=True, text=True,
                        timeout=300)
    assert up.returncode == 0, f"tools/slurm_local_up.sh failed:\n{up.stdout}\n{up.stderr}"
    return True


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without launcher variables that would confuse the job's processes."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items()
           if k not in drop and not k.startswith(("SLURM_", "PMI_", "OMPI_", "PMIX_", "MPI_LOCAL"))}
    env.update(extra)
    return env


def sbatch(args: Iterable[str], env: Optional[dict] = None, cwd: Path = ROOT) -> int:
    out = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True, env=env or clean_env(),
                         cwd=cwd, timeout=30)
    assert out.returncode == 0, f"sbatch failed: {out.stderr}"
    return int(out.stdout.strip().split(";")[0])


def _fields(line: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S*)", line))


def job_info(job_id: int) -> dict[str, str]:
    """Fields of `scontrol show job`; from the jobcomp log once the controller has purged the job."""
    out = subprocess.run(["scontrol", "-o", "show", "job", str(job_id)], capture_output=True, text=True,
                         timeout=30)
    if out.returncode == 0 and out.stdout.strip():
        return _fields(out.stdout)
    return jobcomp_record(job_id) or {}


def jobcomp_record(job_id: int) -> Optional[dict[str, str]]:
    """The last jobcomp/filetxt line of a job (what sacct would show, without slurmdbd)."""
    if not JOBCOMP_LOG.exists():
        return None
    records = [_fields(line) for line in JOBCOMP_LOG.read_text().splitlines() if line.startswith(f"JobId={job_id} ")]
    return records[-1] if records else None


def wait_for_state(job_id: int, states: set[str], timeout: float, release_requeued: bool = True) -> dict:
    """Poll until JobState is in `states`.

    A requeued job waits ~2 min (Reason=BeginTime) before it may start again; `release_requeued` starts it
    after a few seconds instead. Not at once: slurmd compares job credentials with the revocation time of
    the killed attempt at one-second resolution and refuses a restart within the same second.
    """
    deadline = time.monotonic() + timeout
    info: dict = {}
    held_since = None
    while time.monotonic() < deadline:
        info = job_info(job_id)
        state = info.get("JobState", "")
        if state in states:
            return info
        if state in FINAL_STATES:
            raise AssertionError(f"job {job_id} ended {state} while waiting for {states}: {info}")
        if release_requeued and state == "PENDING" and info.get("Reason") == "BeginTime":
            held_since = held_since or time.monotonic()
            if time.monotonic() - held_since > 2.5:
                subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], capture_output=True)
        time.sleep(0.3)
    raise AssertionError(f"job {job_id} not in {states} after {timeout}s; last: {info}")


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def submit_trace_moe(config: str | Path, *overrides: str, output: Path, nproc: int = 2,
                     sbatch_args: Iterable[str] = (), **env: str) -> int:
    """`sbatch slurm/trace_moe.sh CONFIG OVERRIDES` as a one-node CPU job (gloo, `nproc` ranks).

    Extra keyword arguments become environment variables of the job (e.g. QRL_TRAIN_MODULE, QRL_OUTPUT_DIR).
    """
    job_env = clean_env(QRL_DEVICE="cpu", QRL_NPROC_PER_NODE=str(nproc), **env)
    args = ["--nodes=1", "--gpus-per-node=0", f"--output={output}", "--job-name=trace-moe-test", *sbatch_args,
            str(ROOT / "slurm/trace_moe.sh"), str(config), *overrides]
    return sbatch(args, env=job_env, cwd=ROOT)


@pytest.fixture
def cancel_after():
    """Jobs registered here are cancelled at teardown, so a failed test leaves no job running."""
    jobs: list[int] = []
    yield jobs.append
    for job_id in jobs:
        subprocess.run(["scancel", str(job_id)], capture_output=True)


# --- tests -------------------------------------------------------------------------------------------------

def test_trivial_batch_job_completes(cluster, tmp_path, cancel_after):
    out = tmp_path / "hello.out"
    job = sbatch([f"--output={out}", "--wrap", "echo hello from $SLURM_JOB_ID on $(hostname -s)"])
    cancel_after(job)
    info = wait_for_state(job, {"COMPLETED"}, timeout=60)
    assert info["ExitCode"] == "0:0"
    assert out.read_text().strip() == f"hello from {job} on {subprocess.getoutput('hostname -s')}"
    record = wait_for(lambda: jobcomp_record(job), 10, "the jobcomp record")
    assert record["JobState"] == "COMPLETED"


def test_srun_tasks_discover_their_ranks(cluster):
    probe = ("import json; from megatron_qrl.launch.dist_env import discover; d = discover(); "
             "print(json.dumps([d.rank, d.world_size, d.local_rank, d.launcher, d.master_addr]))")
    out = subprocess.run(["srun", "--nodes=1", "--ntasks=2", sys.executable, "-c", probe], capture_output=True,
                         text=True, env=clean_env(), timeout=90)
    assert out.returncode == 0, out.stderr
    rows = sorted(json.loads(line) for line in out.stdout.splitlines())
    host = subprocess.getoutput("hostname -s")
    assert rows == [[0, 2, 0, "slurm", host], [1, 2, 1, "slurm", host]]


COUNTER_JOB = """#!/bin/bash
#SBATCH --requeue
#SBATCH --open-mode=append
# A stand-in for training: resumes from the counter ("checkpoint") a previous attempt left behind.
start=$(cat "$CKPT" 2>/dev/null || echo 0)
echo "attempt restart=${SLURM_RESTART_COUNT:-0} resume_from=$start"
for ((i = start; i < TOTAL; i++)); do
    sleep 0.3
    echo $((i + 1)) > "$CKPT.tmp" && mv "$CKPT.tmp" "$CKPT"
done
echo "finished at $(cat "$CKPT")"
"""


def test_requeued_job_resumes_from_its_checkpoint(cluster, tmp_path, cancel_after):
    script, ckpt, out = tmp_path / "counter.sh", tmp_path / "ckpt", tmp_path / "counter.out"
    script.write_text(COUNTER_JOB)
    job = sbatch([f"--output={out}", str(script)], env=clean_env(CKPT=str(ckpt), TOTAL="12"))
    cancel_after(job)
    wait_for(lambda: ckpt.exists() and int(ckpt.read_text() or 0) >= 3, 60, "3 steps before the requeue")
    subprocess.run(["scontrol", "requeue", str(job)], check=True, capture_output=True)
    info = wait_for_state(job, {"COMPLETED"}, timeout=90)
    assert info["Restarts"] == "1"
    attempts = re.findall(r"attempt restart=(\d+) resume_from=(\d+)", out.read_text())
    assert attempts[0] == ("0", "0")
    assert attempts[1][0] == "1" and int(attempts[1][1]) >= 3  # continued, did not start over
    assert "finished at 12" in out.read_text()


FAKE_TRAIN = '''"""Stand-in for megatron_qrl.launch.train: gloo ranks, resume from a counter, one record per rank."""
import argparse, json, os, sys, time
from pathlib import Path
import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--config", required=True)
p.add_argument("overrides", nargs="*")
args = p.parse_args()
out = Path(os.environ["FAKE_TRAIN_OUT"])
ckpt = out / "checkpoint_step"
resume = "run.resume=true" in args.overrides
start = int(ckpt.read_text()) if resume and ckpt.exists() else 0  # read before the rendezvous: all ranks agree
total = int([o.split("=", 1)[1] for o in args.overrides if o.startswith("run.total_steps=")][-1])
dist.init_process_group(os.environ["QRL_DIST_BACKEND"])
rank, world = dist.get_rank(), dist.get_world_size()
with open(out / "attempts.jsonl", "a") as f:
    f.write(json.dumps({"rank": rank, "world": world, "restart": int(os.environ.get("SLURM_RESTART_COUNT", 0)),
                        "start": start, "config": args.config, "overrides": args.overrides,
                        "python": sys.prefix, "device": os.environ["QRL_DEVICE"]}) + "\\n")
for step in range(start, total):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world
    time.sleep(0.4)
    if rank == 0:
        (out / "tmp").write_text(str(step + 1))
        os.replace(out / "tmp", ckpt)
dist.barrier()
dist.destroy_process_group()
'''


def test_trace_moe_requeues_on_usr1_and_resumes(cluster, tmp_path, cancel_after):
    """The batch script's own mechanics: venv, CPU/gloo torchrun with c10d rendezvous, USR1 -> requeue."""
    (tmp_path / "fake_train.py").write_text(FAKE_TRAIN)
    config = tmp_path / "tiny.yaml"
    config.write_text("run:\n  total_steps: 14\n")
    log = tmp_path / "trace_moe.out"
    job = submit_trace_moe(config, "run.total_steps=14", output=log, QRL_TRAIN_MODULE="fake_train",
                           PYTHONPATH=str(tmp_path), FAKE_TRAIN_OUT=str(tmp_path),
                           PATH="/usr/local/bin:/usr/bin:/bin", VIRTUAL_ENV="")  # the script must activate .venv
    cancel_after(job)
    ckpt = tmp_path / "checkpoint_step"
    wait_for(lambda: ckpt.exists() and int(ckpt.read_text() or 0) >= 2, 90, "2 training steps")
    # what Slurm does --signal=B:USR1@180 before the time limit
    subprocess.run(["scancel", "--batch", "--signal=USR1", str(job)], check=True, capture_output=True)
    info = wait_for_state(job, {"COMPLETED"}, timeout=120)
    text = log.read_text()
    assert "USR1: requeueing job" in text, text
    assert info["Restarts"] == "1"
    attempts = [json.loads(line) for line in (tmp_path / "attempts.jsonl").read_text().splitlines()]
    first = [a for a in attempts if a["restart"] == 0]
    second = [a for a in attempts if a["restart"] == 1]
    assert sorted(a["rank"] for a in first) == [0, 1] and sorted(a["rank"] for a in second) == [0, 1]
    assert all(a["world"] == 2 and a["device"] == "cpu" for a in attempts)
    assert all(Path(a["python"]) == ROOT / ".venv" for a in attempts) or not (ROOT / ".venv").exists()
    assert all(a["start"] == 0 for a in first)
    assert all(a["start"] >= 2 for a in second)  # resumed from the checkpoint, not from step 0
    assert first[0]["config"] == str(config)
    assert first[0]["overrides"] == ["run.resume=true", "run.total_steps=14"]
    assert ckpt.read_text() == "14"


def test_trace_moe_runs_the_real_rl_job(cluster, tmp_path, cancel_after):
    """`sbatch slurm/trace_moe.sh configs/tiny_cpu.yaml ...` runs the actual RL loop (2 gloo ranks, TRACE,
    AIS, AQN, W&B offline) to completion and leaves its metrics and checkpoint."""
    out_dir = tmp_path / "run"
    log = tmp_path / "job.out"
    job = submit_trace_moe(ROOT / "configs/tiny_cpu.yaml", f"run.output_dir={out_dir}", "run.total_steps=2",
                           "run.sft_steps=2", "run.eval_every=2", "run.checkpoint_every=2", "data.eval_size=8",
                           "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=8",
                           output=log, WANDB_MODE="offline", OMP_NUM_THREADS="1")
    cancel_after(job)
    info = wait_for_state(job, {"COMPLETED", "FAILED"}, timeout=600)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log.read_text()[-4000:]
    metrics = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1]
    last = metrics[-1]
    for key in ("reward/mean", "ais/alpha", "aqn/sigma", "trace/code_mismatch_before", "trace/code_mismatch_after",
                "r3/router_agreement", "sync/hash_ok", "eval/accuracy"):
        assert key in last, key
    assert last["sync/hash_ok"] == 1.0 and last["trace/code_mismatch_after"] < last["trace/code_mismatch_before"]
    assert (out_dir / "checkpoints" / "latest").read_text().strip() == "step_000002"
    assert list((out_dir / "wandb").glob("offline-run-*")), "no offline W&B run was written"
