"""Run directories (megatron_qrl/run_dir.py): a run refuses an output_dir whose saved config differs in a field that
changes the run, resumes across harmless changes and says which, starts over cleanly with run.resume=false, and
takes the checkpoint `latest` names (a newer complete one was never committed). Files only: no model is built."""
import json
from pathlib import Path

import pytest
import torch.distributed as dist
import yaml

from megatron_qrl.cli import main
from megatron_qrl.config import dump_config, load_config
from megatron_qrl.errors import InputError
from megatron_qrl.run_dir import (checkpoint_due, complete_checkpoints, inspect_run_dir, prepare_run_dir,
                                  resume_hint, uncommitted_checkpoints)

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs/tiny_cpu.yaml")


def _cfg(out, *overrides):
    return load_config(TINY, [f"run.output_dir={out}", *overrides])


def _fake_run(out, steps=(2, 4), latest=4, cfg=None):
    """A run directory as a run leaves it: config.yaml, complete checkpoints (a manifest each), `latest`."""
    ck = out / "checkpoints"
    for s in steps:
        (ck / f"step_{s:06d}").mkdir(parents=True)
        (ck / f"step_{s:06d}" / "manifest.json").write_text("{}")
    if latest is not None:
        (ck / "latest").write_text(f"step_{latest:06d}\n")
    (out / "config.yaml").write_text(dump_config(cfg or _cfg(out)))
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": i}) + "\n" for i in range(max(steps) + 1)))


def test_resume_of_the_same_config_names_the_checkpoint(tmp_path):
    _fake_run(tmp_path)
    plan = inspect_run_dir(_cfg(tmp_path))
    assert plan.resume_from.name == "step_000004" and plan.changed == {}
    assert plan.describe() == f"would resume from step_000004 of {tmp_path} (4 of 100 steps done)"


def test_harmless_changes_resume_and_are_named(tmp_path):
    _fake_run(tmp_path)
    plan = inspect_run_dir(_cfg(tmp_path, "run.total_steps=200", "run.eval_every=5", "trainer.micro_batch_size=8"))
    assert plan.changed == {"run.total_steps": (100, 200), "run.eval_every": (25, 5),
                            "trainer.micro_batch_size": (64, 8)}
    line = plan.resume_line()
    assert "run.total_steps 100 -> 200" in line and "AQN noise and LR schedules" in line


@pytest.mark.parametrize("overrides,fields", [
    (["model.hidden_size=256"], ["model.hidden_size"]),
    (["trainer.lr=1e-4", "rl.is_method=tis"], ["trainer.lr", "rl.is_method"]),
    (["data.seed=3", "rollout.seed=7"], ["data.seed", "rollout.seed"]),
    (["data.task=countdown"], ["data.task"]),
    (["trace.enabled=false", "quant.format=mxfp4"], ["trace.enabled", "quant.format"]),
])
def test_run_changing_fields_are_refused_with_old_and_new_values_and_the_fix(tmp_path, overrides, fields):
    _fake_run(tmp_path)
    before = (tmp_path / "config.yaml").read_text()
    with pytest.raises(InputError) as err:
        prepare_run_dir(_cfg(tmp_path, *overrides), rank=0)
    msg = str(err.value)
    for f in fields:
        assert f"  {f}: " in msg and "(saved) -> " in msg, msg
    assert "run.output_dir=" in msg and "run.resume=false" in msg and "config.yaml" in msg
    assert (tmp_path / "config.yaml").read_text() == before and (tmp_path / "checkpoints/step_000004").is_dir()


def test_resume_false_starts_over_removing_the_previous_run(tmp_path):
    _fake_run(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    plan = prepare_run_dir(_cfg(tmp_path, "run.resume=false", "model.hidden_size=256"), rank=0)
    assert plan.resume_from is None and set(plan.previous) == {"checkpoints", "metrics.jsonl", "config.yaml"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]   # only the run's own files go


def test_other_ranks_never_remove_anything(tmp_path):
    _fake_run(tmp_path)
    prepare_run_dir(_cfg(tmp_path, "run.resume=false"), rank=1)
    assert (tmp_path / "checkpoints/step_000004").is_dir()


def test_latest_is_the_commit_point(tmp_path):
    _fake_run(tmp_path, steps=(2, 4, 6), latest=4)   # step_000006 complete, but `latest` was never moved to it
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_000004", "step_000002"]
    assert [p.name for p in uncommitted_checkpoints(tmp_path)] == ["step_000006"]
    plan = prepare_run_dir(_cfg(tmp_path), rank=0)
    assert plan.resume_from.name == "step_000004" and not (tmp_path / "checkpoints/step_000006").exists()


def test_no_latest_means_nothing_to_resume(tmp_path):
    _fake_run(tmp_path, steps=(2,), latest=None)
    assert complete_checkpoints(tmp_path) == [] and inspect_run_dir(_cfg(tmp_path)).resume_from is None


def test_missing_inputs_fail_before_anything_is_built(tmp_path):
    with pytest.raises(InputError, match="run.init_checkpoint '.*' does not exist"):
        inspect_run_dir(_cfg(tmp_path, f"run.init_checkpoint={tmp_path}/nope"))
    with pytest.raises(InputError, match="is not a megatron-qrl checkpoint"):
        inspect_run_dir(_cfg(tmp_path, f"run.init_checkpoint={tmp_path}"))
    with pytest.raises(InputError, match="data.path '.*missing.jsonl' does not exist"):
        inspect_run_dir(_cfg(tmp_path, "data.task=jsonl", f"data.path={tmp_path}/missing.jsonl"))


def test_checkpoint_every_zero_still_saves_the_end_and_save_checkpoints_false_saves_nothing(tmp_path):
    every = _cfg(tmp_path, "run.checkpoint_every=3")
    assert [n for n in range(1, 10) if checkpoint_due(every, n)] == [3, 6, 9]
    assert not any(checkpoint_due(_cfg(tmp_path, "run.checkpoint_every=0"), n) for n in range(1, 10))
    assert not any(checkpoint_due(_cfg(tmp_path, "run.save_checkpoints=false"), n) for n in range(1, 10))
    # the final save is launch/train.py's `if cfg.run.save_checkpoints: save_checkpoint(s, end)`


def test_interrupt_hint_names_the_checkpoint_and_how_to_resume(tmp_path):
    _fake_run(tmp_path)
    hint = resume_hint(_cfg(tmp_path))
    assert f"{tmp_path}/checkpoints/step_000004" in hint and "4 of 100 steps done" in hint
    assert "rerun the same command" in hint
    assert "no checkpoint was written yet" in resume_hint(_cfg(tmp_path / "fresh"))


def test_qrl_train_refuses_a_conflicting_run_dir_before_any_process_group(tmp_path, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise AssertionError("a process group was started before the run directory was checked")

    monkeypatch.setattr(dist, "init_process_group", refuse)
    _fake_run(tmp_path)
    rc = main(["train", "--config", TINY, f"run.output_dir={tmp_path}", "model.num_experts=4"])
    err = capsys.readouterr().err
    assert rc == 2 and "model.num_experts: 8 (saved) -> 4 (now)" in err and "Traceback" not in err, err
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["model"]["num_experts"] == 8


def test_a_config_without_output_dir_gets_its_own_directory(tmp_path):
    cfg_file = tmp_path / "my_experiment.yaml"
    cfg_file.write_text("trainer:\n  lr: 1.0e-4\n")
    assert load_config(cfg_file).run.output_dir == "runs/my_experiment"   # not the shared runs/tiny_cpu
    assert load_config(cfg_file, ["run.output_dir=elsewhere"]).run.output_dir == "elsewhere"
