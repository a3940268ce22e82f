"""One error presentation for every `qrl` command (megatron_qrl/errors.py): bad input is one line naming the problem,
the file or field and the fix, exit 2, no traceback unless --debug; Ctrl-C/SIGTERM is one line saying what was saved
and how to resume, exit 130; a full disk is named as such and leaves no partial checkpoint. Also --version, --help
and --dry-run."""
import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_qrl.cli import main
from megatron_qrl.config import load_config
from megatron_qrl.errors import DiskFull, present

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs/tiny_cpu.yaml")
SMALL = ["run.sft_steps=2", "rollout.prompts_per_step=4", "rollout.group_size=4", "run.eval_every=0",
         "run.wandb_mode=disabled"]


def _env(**extra):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "QRL_FAULT_INJECT", "QRL_DEBUG"):
        env.pop(k, None)
    return {**env, **extra}


def _qrl(*args, timeout=600, **env):
    return subprocess.run([sys.executable, "-m", "megatron_qrl.cli", *args], cwd=ROOT, env=_env(**env),
                          capture_output=True, text=True, timeout=timeout)


def _one_error(r, command="train") -> str:
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert r.stderr.count(f"qrl {command}: error:") == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    return r.stderr


def test_version_and_help(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("qrl (megatron-qrl) ")
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "docs/configuration.md" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "docs/configuration.md" in out and "--dry-run" in out and "--debug" in out


def test_dry_run_prints_the_resolved_config_and_starts_nothing(tmp_path, capsys):
    out = tmp_path / "never"
    rc = main(["train", "--config", TINY, f"run.output_dir={out}", "run.total_steps=7", "--dry-run"])
    cap = capsys.readouterr()
    assert rc == 0 and not out.exists()
    assert yaml.safe_load(cap.out) == load_config(TINY, [f"run.output_dir={out}", "run.total_steps=7"]).model_dump()
    assert f"would start a new run in {out}" in cap.err


def test_yaml_syntax_error_names_file_and_line_and_debug_shows_the_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  num_layers: 4\n  hidden_size 128\ntrainer:\n  lr: 1e-5\n")
    err = _one_error(_qrl("train", "--config", str(bad)))
    assert f"{bad}:3:3: YAML syntax error" in err and "could not find expected ':'" in err
    debug = _qrl("train", "--config", str(bad), "--debug")
    assert debug.returncode == 2 and "Traceback" in debug.stderr and "YAML syntax error" in debug.stderr
    assert "Traceback" in _qrl("train", "--config", str(bad), QRL_DEBUG="1").stderr


def test_data_file_errors_name_the_file(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    err = _one_error(_qrl("train", "--config", TINY, f"run.output_dir={tmp_path}/run", "data.task=jsonl",
                          f"data.path={empty}", *SMALL))
    assert f"data file '{empty}' holds no rows" in err
    err = _one_error(_qrl("train", "--config", TINY, f"run.output_dir={tmp_path}/run", "data.task=jsonl",
                          f"data.path={tmp_path}/missing.jsonl"))
    assert f"data.path '{tmp_path}/missing.jsonl' does not exist" in err


def test_prompt_longer_than_the_context_is_an_input_error_not_an_engine_failure(tmp_path):
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(80)]
    rows[7]["prompt"] = "1+" * 100 + "1="
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    err = _one_error(_qrl("train", "--config", TINY, f"run.output_dir={tmp_path}/run", "data.task=jsonl",
                          f"data.path={data}", "data.eval_size=8", *SMALL))
    assert "1 train prompt(s) are too long for the model's context, e.g. row 7: 203 prompt tokens" in err
    line = next(x for x in err.splitlines() if x.startswith("qrl train: error:"))
    assert "rollout.max_new_tokens" in line and "model.max_sequence_length" in line and "engine" not in line


def test_eval_of_a_directory_that_is_not_a_checkpoint(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    (run / "checkpoints" / "step_000002" / "manifest.json").write_text("{}")
    (run / "checkpoints" / "latest").write_text("step_000002\n")
    err = _one_error(_qrl("eval", str(run)), "eval")
    assert f"'{run}' is not a checkpoint (no manifest.json in it)" in err
    assert f"the run's latest: {run}/checkpoints/step_000002" in err
    err = _one_error(_qrl("eval", str(tmp_path / "nope")), "eval")
    assert "does not exist; pass runs/NAME/checkpoints/step_XXXXXX" in err
    err = _one_error(_qrl("eval", str(run / "checkpoints" / "step_000002")), "eval")
    assert f"{run}/config.yaml does not exist" in err and "--config" in err


def test_present_maps_errors_to_one_line_and_exit_status(capsys):
    def raises(exc):
        def body():
            raise exc
        return body

    assert present("x", raises(KeyboardInterrupt())) == 130
    assert capsys.readouterr().err == "qrl x: interrupted\n"
    assert present("x", raises(OSError(errno.ENOSPC, "No space left on device", "/d/metrics.jsonl"))) == 1
    assert "disk full writing '/d/metrics.jsonl'" in capsys.readouterr().err
    with pytest.raises(RuntimeError):   # a bug keeps its traceback
        present("x", raises(RuntimeError("bug")))


def test_a_failed_checkpoint_write_on_a_full_disk_is_named_and_leaves_no_partial_dir(tmp_path, monkeypatch):
    from megatron_qrl.pipeline import checkpoint_write as cw

    path = tmp_path / "checkpoints" / "step_000001"
    monkeypatch.setattr(cw, "free_bytes", lambda p: 4096)
    with pytest.raises(DiskFull, match="disk full while writing checkpoint step_000001 .*0.0 MiB free"):
        with cw.checkpoint_write(path):   # what PyTorch's writer raises on ENOSPC: no errno anywhere
            (path.parent / ".step_000001.tmp-123").mkdir(parents=True)
            (path.parent / ".step_000001.tmp-123" / "__0_0.distcp").write_bytes(b"partial")
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert list(path.parent.iterdir()) == []
    monkeypatch.setattr(cw, "free_bytes", lambda p: 10 << 30)
    with pytest.raises(RuntimeError, match="not a disk problem"):   # plenty of space: not called disk full
        with cw.checkpoint_write(path):
            raise RuntimeError("not a disk problem")


def _train_until(out, line, extra=(), timeout=600):
    cmd = [sys.executable, "-m", "megatron_qrl.cli", "train", "--config", TINY, f"run.output_dir={out}", *SMALL,
           *extra]
    p = subprocess.Popen(cmd, cwd=ROOT, env=_env(QRL_NO_PROGRESS="1"), stderr=subprocess.PIPE, text=True)
    seen = []
    for text in p.stderr:
        seen.append(text)
        if line in text:
            return p, seen
    p.wait(timeout=timeout)
    raise AssertionError(f"the run ended (rc {p.returncode}) before '{line}':\n{''.join(seen)[-3000:]}")


def test_sigterm_ends_cleanly_with_one_line_saying_how_to_resume(tmp_path):
    out = tmp_path / "run"
    p, _ = _train_until(out, "step 3/50", ["run.total_steps=50", "run.checkpoint_every=2"])
    p.send_signal(signal.SIGTERM)
    rest = p.stderr.read()
    assert p.wait(timeout=120) == 130, rest
    assert "Traceback" not in rest and "KeyboardInterrupt" not in rest, rest
    last = rest.strip().splitlines()[-1]
    assert last.startswith("qrl train: interrupted; the last checkpoint is ") and "rerun the same command" in last
    assert f"{out}/checkpoints/step_0000" in last and not list((out / "checkpoints").glob(".step_*"))


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return r.returncode == 0


def test_a_real_full_disk_during_training(tmp_path):
    disk = tmp_path / "small"
    if os.geteuid() != 0 or not _mount_tmpfs(disk, "3m"):
        pytest.skip("needs root to mount a 3 MiB tmpfs")
    try:
        r = _qrl("train", "--config", TINY, f"run.output_dir={disk}/run", "run.total_steps=1", *SMALL)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert "qrl train: error: disk full while writing checkpoint step_000001" in r.stderr
        assert not list((disk / "run" / "checkpoints").glob(".step_*"))
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
