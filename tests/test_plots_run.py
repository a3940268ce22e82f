"""plot_run: one PNG per chart with data, missing metrics skipped, clear error without metrics.jsonl."""
import json
import math

import pytest

from megatron_qrl.plotting import MetricsNotFoundError, main, plot_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write(run_dir, rows):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _full_row(step):
    return {"step": step, "reward/mean": 0.1 * step, "reward/std": 0.05, "eval/accuracy": 0.2,
            "mismatch/logp_abs_diff": 0.01 / (step + 1), "trace/code_mismatch_before": 0.1,
            "trace/code_mismatch_after": 0.01, "ais/alpha": 0.8, "ais/alpha_ess": 0.9, "ais/alpha_mis": 1.0,
            "ais/alpha_var": 0.95, "is/weight_mean": 1.0, "aqn/sigma": 1e-2 * 0.5 ** step,
            "rollout/tokens_per_s": 1000.0, "train/step_s": 2.0, "sync/s": 0.3}


def test_all_charts_written(tmp_path):
    rows = [_full_row(s) for s in range(5)]
    rows[2]["train/loss"] = None  # non-finite values were logged as null
    rows[3]["reward/mean"] = None
    _write(tmp_path, rows)
    paths = plot_run(tmp_path)
    assert sorted(p.name for p in paths) == ["ais.png", "aqn.png", "mismatch.png", "reward.png",
                                             "throughput.png"]
    for p in paths:
        assert p.parent == tmp_path / "plots"
        assert p.read_bytes()[:8] == PNG_MAGIC


def test_missing_keys_are_skipped(tmp_path):
    _write(tmp_path, [{"step": s, "reward/mean": float(s)} for s in range(3)] + [{"step": 3}])
    paths = plot_run(tmp_path, out_dir=tmp_path / "figs")
    assert [p.name for p in paths] == ["reward.png"]
    assert paths[0].parent == tmp_path / "figs"


def test_no_known_metric_gives_no_png(tmp_path, capsys):
    _write(tmp_path, [{"step": 0, "something/else": 1.0}])
    assert plot_run(tmp_path) == []
    assert main([str(tmp_path)]) == 0
    assert "none of the plotted metrics" in capsys.readouterr().out


def test_clear_error_without_metrics(tmp_path, capsys):
    with pytest.raises(MetricsNotFoundError, match="no metrics.jsonl in .*run.output_dir"):
        plot_run(tmp_path)
    assert main([str(tmp_path / "nope")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_log_axis_survives_zero_and_null(tmp_path):
    rows = [{"step": 0, "aqn/sigma": 0.0}, {"step": 1, "aqn/sigma": None}, {"step": 2, "aqn/sigma": math.pi}]
    _write(tmp_path, rows)
    assert [p.name for p in plot_run(tmp_path)] == ["aqn.png"]


def test_qrl_cli_plot(tmp_path, capsys):
    from megatron_qrl.cli import main as qrl

    _write(tmp_path, [{"step": 0, "aqn/sigma": 0.01}])
    assert qrl(["plot", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip().endswith("aqn.png")
