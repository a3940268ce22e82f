"""MetricsLogger: durable JSONL stream, resume without duplicates, W&B mirror with a stable run id."""
import json
import math
from pathlib import Path

import pytest
import torch

from megatron_qrl.config import QRLConfig
from megatron_qrl.logging import MetricsLogger, read_metrics, resolve_wandb_mode, sanitize_metrics
from megatron_qrl.logging.metrics import truncate_metrics
from megatron_qrl.logging.wandb_sink import WANDB_ID_FILE

NO_WANDB = {"WANDB_MODE": "disabled"}


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_one_json_line_per_step_with_nonfinite_as_null(tmp_path):
    with MetricsLogger(tmp_path, rank=0, env=NO_WANDB) as logger:
        logger.log({"reward/mean": 0.5, "train/loss": float("nan"), "train/grad_norm": float("inf"),
                    "sync/hash_ok": True, "train/lr": torch.tensor(1e-4)}, step=0)
        logger.log({"reward/mean": torch.tensor([0.75])}, step=1)
    rows = _lines(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[0]["train/loss"] is None and rows[0]["train/grad_norm"] is None
    assert rows[0]["sync/hash_ok"] is True
    assert rows[0]["train/lr"] == pytest.approx(1e-4)
    assert rows[1]["reward/mean"] == 0.75
    assert "time" in rows[0]


def test_sanitize_flattens_and_rejects_arrays():
    assert sanitize_metrics({"ais": {"alpha": 0.5, "alpha_mis": -math.inf}}) == {"ais/alpha": 0.5,
                                                                                  "ais/alpha_mis": None}
    with pytest.raises(TypeError, match="reward/all.*3 elements"):
        sanitize_metrics({"reward/all": torch.ones(3)})
    with pytest.raises(TypeError, match="has type list"):
        sanitize_metrics({"x": [1, 2]})


def test_only_rank0_writes(tmp_path):
    logger = MetricsLogger(tmp_path / "r1", rank=1, env=NO_WANDB)
    assert logger.log({"a": 1.0}, step=0) is None
    logger.close()
    assert not (tmp_path / "r1").exists()


def test_resume_drops_replayed_steps(tmp_path):
    with MetricsLogger(tmp_path, env=NO_WANDB) as logger:
        for step in range(6):
            logger.log({"reward/mean": float(step)}, step=step)
    # checkpoint was taken after step 3: the restarted loop logs 4, 5, 6 again
    with MetricsLogger(tmp_path, start_step=4, env=NO_WANDB) as logger:
        for step in range(4, 7):
            logger.log({"reward/mean": 10.0 + step}, step=step)
    rows = _lines(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(7))
    assert [r["reward/mean"] for r in rows[4:]] == [14.0, 15.0, 16.0]


def test_torn_last_line_is_repaired_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "a": 1}\n{"step": 1, "a": 2}\n{"step": 2, "a"')  # crash mid-write
    assert [r["step"] for r in read_metrics(path)] == [0, 1]
    with MetricsLogger(tmp_path, start_step=2, env=NO_WANDB) as logger:
        logger.log({"a": 3}, step=2)
    assert [r["step"] for r in _lines(path)] == [0, 1, 2]
    assert not path.with_name("metrics.jsonl.tmp").exists()


def test_truncate_is_noop_when_nothing_to_drop(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n')
    before = path.stat().st_ino
    assert truncate_metrics(path, 5) == 1
    assert path.stat().st_ino == before  # not rewritten


@pytest.mark.parametrize("cfg_mode, env, expected", [
    ("disabled", {"WANDB_API_KEY": "k"}, "disabled"),
    (None, {"WANDB_API_KEY": "k"}, "online"),
    (None, {}, "offline"),
    (None, {"WANDB_MODE": "dryrun", "WANDB_API_KEY": "k"}, "offline"),
    (None, {"WANDB_MODE": "disabled"}, "disabled"),
])
def test_wandb_mode_resolution(cfg_mode, env, expected):
    assert resolve_wandb_mode(cfg_mode, env) == expected


def test_wandb_offline_run_is_continued_on_resume(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = QRLConfig()
    cfg.run.output_dir = str(tmp_path)
    with MetricsLogger(tmp_path, cfg, env={}) as logger:
        assert logger._wandb.run.settings.mode == "offline"
        logger.log({"reward/mean": 1.0, "train/loss": float("nan")}, step=0)
        first_id = logger._wandb.run.id
    assert (tmp_path / WANDB_ID_FILE).read_text().strip() == first_id
    with MetricsLogger(tmp_path, cfg, start_step=1, env={}) as logger:
        assert logger._wandb.run.id == first_id
        logger.log({"reward/mean": 2.0}, step=1)
    # both segments recorded under the same run id (a segment that starts within the same second as the last one
    # gets a "-1" suffix on its directory: wandb's name is offline-run-<second>-<id>)
    runs = sorted(p for p in (tmp_path / "wandb").glob(f"offline-run-*-{first_id}*")
                  if p.name.endswith(first_id) or p.name.rsplit("-", 1)[-1].isdigit())
    assert len(runs) == 2
    cfg.run.resume = False
    with MetricsLogger(tmp_path, cfg, env={}) as logger:
        assert logger._wandb.run.id != first_id


def test_missing_wandb_package_only_warns(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # import wandb -> ImportError
    with MetricsLogger(tmp_path, QRLConfig(), env={"WANDB_MODE": "offline"}) as logger:
        logger.log({"reward/mean": 1.0}, step=0)
    assert "wandb is not installed" in caplog.text
    assert _lines(tmp_path / "metrics.jsonl")[0]["reward/mean"] == 1.0
