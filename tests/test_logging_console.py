"""Plain log lines for people (megatron_qrl/logging/console.py, run_report.py): rank 0 says what happens in any output
(a file, not a terminal), library noise is filtered, other ranks stay quiet; the RL job's output has a line per stage,
per step (reward, response length, tokens/s, time split, ETA), per checkpoint, and a summary."""
import io
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_qrl.logging import ProgressLines, RunReport, format_duration
from megatron_qrl.logging.console import LIBRARY_NOISE, setup_console

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def console():
    """setup_console into a buffer; the root logger's handlers and level are restored afterwards."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level, logging.getLogger("megatron_qrl").level, warnings.showwarning)
    buf = io.StringIO()

    def install(rank=0, debug=False):
        setup_console(rank, debug=debug, stream=buf)
        return buf
    with warnings.catch_warnings():
        warnings.simplefilter("always")   # pytest.ini ignores UserWarning; setup_console adds its own filters
        yield install
    root.handlers[:], (root.level) = saved[0], saved[1]
    logging.getLogger("megatron_qrl").setLevel(saved[2])
    warnings.showwarning = saved[3]


def _emit_mixed_lines():
    """What a run's ranks log: our info and warning lines, library warnings worth showing, and library noise."""
    logging.getLogger("megatron_qrl.run").info("step 1/2: reward 0.5")
    logging.getLogger("megatron_qrl.pipeline.guards").warning("engine restarted")
    logging.getLogger("megatron.core.models.gpt.gpt_model").warning("GPTModel IS DEPRECATED. GPTModel is only ...")
    logging.getLogger("megatron.core.x").warning("a real problem")
    logging.getLogger("megatron.core.x").warning("library warning")
    warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.", UserWarning)
    warnings.warn("something a user should know", UserWarning)
    warnings.warn("a library's UserWarning", UserWarning)


def test_rank0_shows_our_lines_and_useful_library_warnings_but_not_the_noise(console):
    out = console(rank=0)
    _emit_mixed_lines()
    text = out.getvalue()
    assert "step 1/2: reward 0.5" in text and text.startswith("[qrl ")
    assert "warning (megatron.core.x): a real problem" in text and "something a user should know" in text
    assert not any(pattern in text for pattern in LIBRARY_NOISE), text


def test_other_ranks_show_only_warnings_and_errors_of_ours(console):
    out = console(rank=1)
    _emit_mixed_lines()
    text = out.getvalue()
    assert "step 1/2" not in text and "library" not in text
    assert "[qrl rank 1 " in text and "warning: engine restarted" in text


def test_debug_filters_nothing(console):
    out = console(rank=0, debug=True)
    logging.getLogger("megatron.core.models").warning("GPTModel IS DEPRECATED.")
    logging.getLogger("megatron_qrl.x").debug("detail")
    assert "GPTModel IS DEPRECATED" in out.getvalue() and "detail" in out.getvalue()


def test_step_lines_eval_line_and_summary(console, caplog):
    caplog.set_level(logging.INFO, logger="megatron_qrl.run")
    cfg = SimpleNamespace(run=SimpleNamespace(total_steps=100, output_dir="runs/x"),
                          rl=SimpleNamespace(is_method="ais"),
                          rollout=SimpleNamespace(prompts_per_step=8, group_size=8))
    report = RunReport(cfg, start=50, end=100)
    report.begin()
    report.step({"step": 50, "reward/mean": 0.5, "response/len_mean": 6.25, "rollout/tokens_per_s": 812.4,
                 "time/step_s": 1.23, "sync/s": 0.05, "rollout/s": 0.41, "time/logprobs_s": 0.2, "time/train_s": 0.5,
                 "time/eval_s": 0.07, "eval/accuracy": 0.75, "eval/num_prompts": 64.0, "eval/reward_mean": 0.75})
    report.step(None)   # off rank 0 the logger returns None: nothing to say
    report.step({"step": 51, "reward/mean": 0.7})
    report.summary(2, checkpoint="runs/x/checkpoints/step_000052")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "RL: steps 51..100 of 100 (ais, 8 prompts x 8 responses per step)"
    assert lines[1].startswith("step 51/100: reward 0.500, response 6.2 tokens, 812 tokens/s, 1.23 s (sync 0.05, "
                               "rollout 0.41, logprobs 0.20, train 0.50, eval 0.07), ETA ")
    assert lines[2] == "eval after step 51: accuracy 0.750 on 64 held-out prompts (greedy), reward 0.750"
    assert lines[3].startswith("step 52/100: reward 0.700, response n/a tokens")
    assert "2 RL steps in" in lines[4] and "reward 0.500 -> 0.700" in lines[4]
    assert "held-out accuracy 0.750 after step 51" in lines[4] and "step_000052" in lines[4]
    assert lines[4].startswith("stopped at step 100 of 100") or lines[4].startswith("finished")


def test_progress_lines_and_durations(caplog):
    caplog.set_level(logging.INFO, logger="megatron_qrl.run")
    lines = ProgressLines("SFT warm start", 40)
    for i in range(1, 41):
        lines.update(i, loss=1.0 / i)
    got = [r.getMessage() for r in caplog.records]
    assert len(got) == 10 and got[0].startswith("SFT warm start 4/40: loss 0.25, ") and "ETA" in got[0]
    assert got[-1].startswith("SFT warm start 40/40: loss 0.025")
    assert [format_duration(s) for s in (4.25, 42, 245, 3725)] == ["4.2s", "42s", "4m05s", "1h02m"]


def test_the_rl_job_says_what_it_does_in_a_log_file(tmp_path):
    """`qrl train` with stderr to a file (as under Slurm or nohup): the stages and steps are there, noise is not.
    Also: run.checkpoint_every=0 still writes the last step's checkpoint (and only that one)."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "QRL_FAULT_INJECT", "QRL_NO_PROGRESS"):
        env.pop(k, None)
    with open(tmp_path / "job.log", "w") as log:
        r = subprocess.run([sys.executable, "-m", "megatron_qrl.cli", "train", "--config",
                            str(ROOT / "configs/tiny_cpu.yaml"), f"run.output_dir={out}", "run.total_steps=2",
                            "run.sft_steps=4", "run.eval_every=2", "run.checkpoint_every=0",
                            "rollout.prompts_per_step=4", "rollout.group_size=4"],
                           cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=600)
    text = (tmp_path / "job.log").read_text()
    assert r.returncode == 0, text[-3000:]
    for expected in ("loading Megatron-Core", "built in", "new run in", "SFT warm start 4/4: loss", "RL: steps 1..2",
                     "W&B offline run in", "step 1/2: reward", "tokens/s", "ETA", "eval after step 2: accuracy",
                     f"checkpoint step_000002 written in", "finished: 2 RL steps"):
        assert expected in text, f"'{expected}' missing from the log:\n{text}"
    assert not any(pattern in text for pattern in LIBRARY_NOISE), text
    assert "wandb:" not in text and "\r" not in text and "Warning" not in text, text
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_000002"]
