"""kill -9 of a trainer rank (torchrun, 2 gloo processes) mid-step and mid-checkpoint-write: the restarted job
resumes from the last complete checkpoint, never a partial one, and its metrics equal an uninterrupted run's
bit for bit (CPU). The first launch also loses its engine once (injected crash on rank 1, retried)."""
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from .helpers import ROOT, comparable, metrics, run_train, train_cmd, train_env

STEPS = ["run.checkpoint_every=2"]


def _workers(agent_pid: int) -> dict:
    """{RANK: pid} of the torchrun agent's worker processes (from /proc)."""
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != agent_pid:
                continue
            env = dict(kv.split("=", 1) for kv in (d / "environ").read_bytes().decode().split("\0") if "=" in kv)
        except (OSError, ValueError, IndexError):
            continue
        if "RANK" in env:
            found[int(env["RANK"])] = int(d.name)
    return found


def _wait(pred, timeout, what, proc):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the job ended (rc {proc.returncode}) before {what}:\n{proc.stderr.read()[-3000:]}")
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _launch(out: Path, inject: str):
    env = {**train_env(inject), "QRL_FAULT_STALL_S": "300"}
    return subprocess.Popen(train_cmd(out, 6, nproc=2, extra=STEPS), cwd=ROOT, env=env, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


def _kill_rank(proc, rank: int) -> int:
    pid = _workers(proc.pid)[rank]
    os.kill(pid, signal.SIGKILL)
    try:
        rc = proc.wait(timeout=120)  # torchrun notices the dead worker, stops the other, fails
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return rc


def _lines(out: Path) -> int:
    f = out / "metrics.jsonl"
    return len(f.read_text().splitlines()) if f.exists() else 0


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    run_train(out, 6, nproc=2, extra=STEPS)
    return metrics(out)


def test_kill9_mid_step_and_mid_checkpoint_resume_bit_exact(reference, tmp_path):
    out, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    # 1) kill -9 rank 1 while step 3 runs (steps 0-2 logged, step_000002 saved); rank 1's engine crashed at step 1
    p = _launch(out, inject="engine_crash@1r1")
    _wait(lambda: _lines(out) >= 3, 600, "3 logged steps", p)
    assert _kill_rank(p, 1) != 0
    assert (ckpts / "latest").read_text().strip() == "step_000002"
    # 2) restart; kill -9 rank 0 inside the step-4 checkpoint save (shard files written, no manifest yet)
    p = _launch(out, inject="stall_in_save@4")
    _wait(lambda: any((d / ".metadata").exists() for d in ckpts.glob(".step_000004.tmp-*")), 600,
          "the step-4 checkpoint's files", p)
    assert _kill_rank(p, 0) != 0
    partial = list(ckpts.glob(".step_000004.tmp-*"))
    assert partial and not (partial[0] / "manifest.json").exists() and not (ckpts / "step_000004").exists()
    assert (ckpts / "latest").read_text().strip() == "step_000002"
    # 3) restart: resumes from step 2 (not the partial step 4), cleans the orphan, finishes
    r = run_train(out, 6, nproc=2, extra=STEPS)
    got = metrics(out)
    assert [m["step"] for m in got] == list(range(6))
    assert not list(ckpts.glob(".step_*")), "orphan tmp dir of the killed save was not cleaned"
    assert (ckpts / "latest").read_text().strip() == "step_000006" and (ckpts / "step_000004" / "manifest.json").exists()
    assert got[1]["fault/engine_restarts"] == 1.0 and reference[1]["fault/engine_restarts"] == 0.0
    for ref, m in zip(reference, got):
        assert comparable(m) == comparable(ref), f"step {m['step']} differs from the uninterrupted run"
    assert "fault-inject" not in r.stderr
