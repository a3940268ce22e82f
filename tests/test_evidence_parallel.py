"""tools/evidence.py's parallel campaign (the H200 arms) without training: the scheduler on stand-in child
processes (SFT -> that seed's arms, GPU spreading, the deadline, a failed smoke stops everything), the
partial aggregation (runs compared over the steps all of them reached) and the per-step wall times."""
import json
import math
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import evidence  # noqa: E402

PY = sys.executable
# a stand-in RL run: writes `steps` metric records (one every `dt` s), evals every 2 steps, then exits 0
FAKE_RUN = """
import json, sys, time
out, steps, dt = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
with open(out + "/metrics.jsonl", "w") as f:
    for s in range(steps):
        rec = {"step": s, "time": 0.0, "time/wall": time.time(), "reward/mean": 0.1 * s}
        if (s + 1) % 2 == 0:
            rec["eval/accuracy"] = 0.5
        f.write(json.dumps(rec) + "\\n"); f.flush(); time.sleep(dt)
"""
FAKE_SFT = """
import json, os, sys
d = sys.argv[1]; os.makedirs(d, exist_ok=True)
json.dump({"eval_accuracy_nvfp4": 0.5, "eval_accuracy_bf16": 0.5}, open(d + "/sft_eval.json", "w"))
"""


@pytest.fixture
def fake(monkeypatch):
    """Stand-ins for the three child commands; arm 'slow' outlives the deadline, arm 'broken' exits 1."""
    monkeypatch.setenv("QRL_EVIDENCE_CUDA", "0")
    monkeypatch.setattr(evidence, "sft_command", lambda root, seed, opts=(): [
        PY, "-c", FAKE_SFT, str(evidence.sft_dir(root, seed))])

    def run_cmd(root, seed, arm, arms, steps):
        out = evidence.run_dir(root, seed, arm)
        if arm == "broken":
            return [PY, "-c", "import sys; print('Traceback (most recent call last):'); sys.exit(1)"]
        return [PY, "-c", FAKE_RUN, str(out), "1000" if arm == "slow" else "6", "0.05"]

    monkeypatch.setattr(evidence, "run_command", run_cmd)
    monkeypatch.setattr(evidence, "smoke_command", lambda root, arm, arms, steps: [
        PY, "-c", "import sys; sys.exit(0 if %r != 'bad' else 2)" % arm])
    return {"fast": [], "slow": [], "broken": [], "bad": []}


def test_parallel_campaign_markers_gpus_and_deadline(tmp_path, fake):
    t0 = time.time()
    summary = evidence.run_parallel(tmp_path, [0, 1], fake, ["fast", "slow", "broken"], None, parallel=8,
                                    gpus=["0", "1"], deadline_s=6.0, run_limit_s=None, smoke_arms=["fast"],
                                    smoke_steps=1, poll_s=0.05, min_start_s=0.5)
    assert time.time() - t0 < 20 and not summary["smoke_failed"]
    for seed in (0, 1):
        assert (evidence.run_dir(tmp_path, seed, "fast") / evidence.DONE).is_file()
        slow = json.loads((evidence.run_dir(tmp_path, seed, "slow") / evidence.UNFINISHED).read_text())
        assert slow["reason"] == "time limit"
        broken = json.loads((evidence.run_dir(tmp_path, seed, "broken") / evidence.UNFINISHED).read_text())
        assert broken["reason"] == "exit code 1"
    gpus = [j["gpu"] for j in summary["jobs"] if j["name"].startswith("seed")]
    assert len(gpus) == 6 and set(gpus) == {"0", "1"}     # spread over both GPUs (exact split: timing)
    head = (evidence.run_dir(tmp_path, 0, "fast") / "train.log").read_text().splitlines()[0]
    assert head.startswith("# CUDA_VISIBLE_DEVICES=")
    assert json.loads((tmp_path / "campaign.json").read_text())["jobs"]

    # partial aggregation: the slow runs were cut; everything is compared over the steps all runs reached
    runs = evidence.collect(tmp_path, ["fast", "slow", "broken"], [0, 1], last_n=2, partial=True, min_steps=3)
    assert "broken" not in runs                           # never logged a step
    upto = runs["fast"][0]["upto"]
    assert upto == 5 and not runs["slow"][0]["finished"] and runs["fast"][0]["finished"]
    assert max(runs["slow"][1]["reward"]) == 5 and runs["slow"][1]["last_step"] > 5
    assert runs["slow"][0]["final_eval"] == 0.5 and max(runs["slow"][0]["eval"]) == 5
    assert "slow" not in evidence.collect(tmp_path, ["fast", "slow"], [0, 1], last_n=2)  # default: DONE only
    md = evidence.write_outputs(tmp_path, tmp_path / "fig", fake, [0, 1], 2, ref="fast", partial=True,
                                min_steps=3)
    assert "Runs compared over steps 0..5" in md and "seed 0 slow (last step" in md
    assert "Left out (no run or < 3 steps): seed 0 bad, seed 0 broken" in md
    assert "(cut after step" in md


def test_failed_smoke_stops_everything(tmp_path, fake):
    t0 = time.time()
    summary = evidence.run_parallel(tmp_path, [0], fake, ["slow"], None, parallel=4, gpus=[], deadline_s=30,
                                    run_limit_s=None, smoke_arms=["bad"], smoke_steps=1, poll_s=0.05, min_start_s=0.5)
    assert summary["smoke_failed"] and time.time() - t0 < 10
    slow = evidence.run_dir(tmp_path, 0, "slow")
    assert not (slow / evidence.DONE).is_file()


def test_pick_gpu_and_step_walls():
    class J:
        def __init__(self, gpu):
            self.gpu = gpu

    assert evidence.pick_gpu([], []) is None
    assert evidence.pick_gpu(["0", "1"], [J("0"), J("0"), J("1")]) == "1"
    assert evidence.pick_gpu(["0", "1"], [J("1")]) == "0"
    recs = [{"step": 0, "time/wall": 10.0}, {"step": 1, "time/wall": 12.0, "eval/accuracy": 0.5},
            {"step": 2, "time/wall": 20.0}, {"step": 3, "time/wall": 23.0}]
    assert evidence.step_walls(recs) == [2.0, 3.0]         # 1 -> 2 includes step 1's eval: left out
    s = evidence.summarize_run(recs, last_n=2, upto=2)
    assert s["step_wall_s"] == 2.0 and s["last_step"] == 3 and s["steps"] == 3
    assert math.isnan(evidence.summarize_run([], 2)["step_wall_s"])


def test_h200_base_valid_for_every_arm_and_sized():
    from megatron_qrl.config import load_config
    from megatron_qrl.models.sizes import count_parameters

    base = ROOT / "configs/evidence/h200_base.yaml"
    arms = evidence.load_arms()
    for arm in arms:
        load_config(str(base), evidence.arm_overrides(Path("/tmp/x"), 0, arm, arms, None))
    n = count_parameters(load_config(str(base), []))
    assert 0.3e9 < n["total"] < 1e9 and n["experts"] > 0.9 * n["total"]
    cmd = evidence.sft_command(Path("/tmp/r"), 1, ["--sft-target", "0.6"])
    assert cmd[2:] == ["sft", "--root", "/tmp/r", "--seed", "1", "--base", str(evidence.BASE), "--sft-target", "0.6"]
