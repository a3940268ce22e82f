"""`qrl eval runs/X/checkpoints/step_N` reports what the run logged as eval/* for its N-th step (record step N-1).

Both score the same weights -- those after the step's updates, i.e. the checkpoint -- through the same FP4
weight sync, without AQN noise, greedily, on the same held-out prompts. Before, the loop scored the weights
synced at the *start* of the step (one update earlier) with that step's AQN noise, so the two disagreed
(0.719 logged vs 0.75 from `qrl eval` on the main job). A large RL learning rate makes one update move the
greedy outputs, so the comparison would catch an evaluation that is one update off again."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = ["run.sft_steps=30", "run.eval_every=1", "run.checkpoint_every=1", "trainer.lr=3e-3",
             "rollout.prompts_per_step=4", "rollout.group_size=4", "data.eval_size=32", "run.wandb_mode=disabled"]
KEYS = ("eval/accuracy", "eval/reward_mean", "eval/response_len_mean", "eval/num_prompts")


def _env():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "QRL_NO_PROGRESS": "1", "WANDB_MODE": "disabled"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "QRL_FAULT_INJECT"):
        env.pop(k, None)
    return env


def _run(*args, timeout=900):
    r = subprocess.run([sys.executable, *args], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    return r


def test_qrl_eval_of_a_checkpoint_equals_the_runs_logged_eval(tmp_path):
    out = tmp_path / "run"
    _run("-m", "megatron_qrl.launch.train", "--config", str(ROOT / "configs/tiny_cpu.yaml"), f"run.output_dir={out}",
         "run.total_steps=2", *OVERRIDES)
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for record in logged:   # record step k: the weights after k+1 steps = checkpoint step_{k+1}
        ckpt = out / "checkpoints" / f"step_{record['step'] + 1:06d}"
        r = _run("-m", "megatron_qrl.launch.evaluate", str(ckpt))
        result = json.loads(r.stdout.strip().splitlines()[-1])
        assert {k: result[k] for k in KEYS} == {k: record[k] for k in KEYS}, (ckpt.name, result, record)
    assert logged[0]["eval/response_len_mean"] != logged[1]["eval/response_len_mean"], \
        "one update did not move the greedy outputs: the test could not tell the weights apart"
