"""metrics.jsonl holds every step exactly once across kill -9 at each boundary of a step (one process, CPU).

The loop writes a step's metrics line (fsync'd), then the checkpoint after that step, whose `latest` pointer
moves last (megatron_qrl/run_dir.py has the rule). One run directory is killed four times in a row, each time
at another boundary (QRL_FAULT_INJECT kill_* kinds, megatron_qrl/fault_inject.py), and restarted:
    kill_after_metrics@1     line of step 1 written, checkpoint step_000002 not begun -> resume from step 1
    kill_before_latest@2     step_000003 complete but `latest` still names step_000002 -> resume from step 2
    torn_metrics@3           half of step 3's line written                              -> resume from step 3
    kill_after_checkpoint@3  step_000004 committed, step 4 not begun                   -> resume from step 4
The kills mid-step and mid-checkpoint-write (2 ranks) are in test_kill_resume.py. After the last restart the
stream equals an uninterrupted run's, each step once, bit for bit (every metric but wall-clock times)."""
import json
import signal

import pytest

from .helpers import comparable, run_train

STEPS = 5
EXTRA = ["run.checkpoint_every=1"]
# (injected kind, step it fires at, the checkpoint the restart must resume from)
KILLS = [("kill_after_metrics", 1, "step_000001"), ("kill_before_latest", 2, "step_000002"),
         ("torn_metrics", 3, "step_000003"), ("kill_after_checkpoint", 3, "step_000004")]


def _steps(out) -> list:
    """Steps of the intact lines (a torn last line is skipped, as read_metrics does)."""
    steps = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        try:
            steps.append(json.loads(line)["step"])
        except json.JSONDecodeError:
            pass
    return steps


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    run_train(out, STEPS, extra=EXTRA)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_each_step_once_across_kills_at_every_step_boundary(reference, tmp_path):
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    previous = None
    for kind, step, resume_from in KILLS:
        r = run_train(out, STEPS, extra=EXTRA, inject=f"{kind}@{step}", expect_rc=-signal.SIGKILL)
        assert f"fault-inject: {kind} at step {step}" in r.stderr
        if previous:   # the restart took the checkpoint `latest` named (not a newer uncommitted one)
            assert f"resuming from {previous} of {out}" in r.stderr, r.stderr[-3000:]
        logged = _steps(out)
        assert logged == list(range(len(logged))) and logged[-1] == (step - 1 if kind == "torn_metrics" else step)
        latest = (ckpts / "latest").read_text().strip()
        if kind == "kill_before_latest":   # saved but not committed: `latest` names the previous one
            assert (ckpts / f"step_{step + 1:06d}" / "manifest.json").is_file()
        if kind == "torn_metrics":
            assert not (out / "metrics.jsonl").read_text().endswith("\n")
        assert latest == resume_from, (kind, latest)
        previous = resume_from
    r = run_train(out, STEPS, extra=EXTRA)
    assert f"resuming from {previous} of {out}" in r.stderr
    got = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in got] == list(range(STEPS))
    for ref, m in zip(reference, got):
        assert comparable(m) == comparable(ref), f"step {m['step']} differs from the uninterrupted run"
    assert (ckpts / "latest").read_text().strip() == f"step_{STEPS:06d}"
