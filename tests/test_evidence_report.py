"""The GPU-scale evidence report (tools/evidence_report.py, tools/evidence_stats.py) on synthetic records: the
paired per-seed 95% t-interval against hand-computed values, gains over each arm's SFT start, both reference
tables, the mechanism columns (entropy, AIS factors), the PNGs, the archive of small records, and the resume
rule of the campaign (a run cut after a committed checkpoint continues; one without starts over)."""
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import evidence  # noqa: E402
import evidence_report  # noqa: E402
from evidence_stats import fmt_ci, mean_ci, paired_ci, t975  # noqa: E402


def test_paired_t_interval_by_hand():
    # d = arm - ref per seed = 0.1, 0.2, 0.3: mean 0.2, sample sd 0.1, t_{0.975,2} = 4.303,
    # half-width = 4.303 * 0.1 / sqrt(3) = 0.248434
    ci = paired_ci({0: 0.6, 1: 0.7, 2: 0.9}, {0: 0.5, 1: 0.5, 2: 0.6, 3: 0.1})
    assert ci["seeds"] == [0, 1, 2] and ci["n"] == 3
    assert ci["mean"] == pytest.approx(0.2) and ci["sd"] == pytest.approx(0.1)
    assert ci["half"] == pytest.approx(0.248434, abs=1e-6)
    assert (ci["lo"], ci["hi"]) == pytest.approx((-0.048434, 0.448434), abs=1e-6)
    assert fmt_ci(ci) == "+0.200 [-0.048, +0.448]"


def test_t_quantiles_and_edge_cases():
    assert t975(1) == 12.706 and t975(2) == 4.303 and t975(30) == 2.042
    assert t975(120) == pytest.approx(1.980, abs=2e-3) and t975(10_000) == pytest.approx(1.960, abs=1e-3)
    with pytest.raises(ValueError, match="at least 2 values"):
        t975(0)
    one = mean_ci([0.4, float("nan"), None])
    assert one["n"] == 1 and one["mean"] == 0.4 and math.isnan(one["half"]) and fmt_ci(one) == "+0.400"
    assert fmt_ci(mean_ci([])) == "-"
    assert paired_ci({0: 1.0, 1: float("nan")}, {0: 0.5, 1: 0.5})["seeds"] == [0]


def _run(root, seed, arm, evals, entropy, done=True, alpha=None):
    d = evidence.run_dir(root, seed, arm)
    d.mkdir(parents=True)
    with open(d / "metrics.jsonl", "w") as f:
        for step in range(4):
            rec = {"step": step, "time": 0.0, "reward/mean": 0.5, "policy/entropy": entropy,
                   "mismatch/logp_abs_diff": 1e-3, "time/step_s": 2.0}
            if alpha is not None:
                rec.update({"ais/alpha": alpha, "ais/alpha_ess": 0.9, "ais/alpha_mis": alpha / 0.9,
                            "ais/alpha_var": 0.0})
            if step in evals:
                rec["eval/accuracy"] = evals[step]
            f.write(json.dumps(rec) + "\n")
    (d / (evidence.DONE if done else evidence.UNFINISHED)).write_text("{}\n")


@pytest.fixture
def campaign(tmp_path):
    arms = {"bf16": ["rollout.weights=bf16"], "nvfp4": ["rl.is_method=none"], "nvfp4_ais": ["rl.is_method=ais"]}
    finals = {"bf16": [0.50, 0.60, 0.70], "nvfp4": [0.40, 0.50, 0.60], "nvfp4_ais": [0.45, 0.60, 0.70]}
    for seed in range(3):
        d = evidence.sft_dir(tmp_path, seed)
        d.mkdir(parents=True)
        (d / "sft_eval.json").write_text(json.dumps({"eval_accuracy_bf16": 0.30, "eval_accuracy_nvfp4": 0.25}))
        for arm, acc in finals.items():
            _run(tmp_path, seed, arm, {1: acc[seed] - 0.1, 3: acc[seed]},
                 entropy=0.5 + 0.1 * seed + (0.05 if arm == "nvfp4_ais" else 0.0),
                 alpha=0.27 if arm == "nvfp4_ais" else None)
    return tmp_path, arms, finals


def test_report_gains_paired_tables_and_plots(campaign, tmp_path_factory):
    root, arms, finals = campaign
    out = tmp_path_factory.mktemp("fig")
    md = evidence_report.write_report(root, out, arms, [0, 1, 2], last_n=2, partial=False)
    summary = json.loads((out / "summary.json").read_text())
    runs = summary["runs"]
    assert runs["bf16"]["1"]["start"] == 0.30 and runs["nvfp4"]["1"]["start"] == 0.25   # each arm's engine
    assert runs["bf16"]["2"]["gain"] == pytest.approx(0.40)
    # nvfp4_ais - nvfp4: 0.05, 0.10, 0.10 -> mean 0.08333, sd 0.028868, half 4.303*0.028868/sqrt(3) = 0.071717
    ci = summary["paired"]["nvfp4"]["nvfp4_ais"]["final_eval"]
    assert ci["mean"] == pytest.approx(0.083333, abs=1e-6) and ci["half"] == pytest.approx(0.071717, abs=1e-5)
    assert summary["paired"]["bf16"]["nvfp4"]["final_eval"]["mean"] == pytest.approx(-0.1)
    assert summary["paired"]["nvfp4"]["nvfp4_ais"]["policy/entropy"]["mean"] == pytest.approx(0.05)
    assert "| arm - bf16 (paired per seed) |" in md and "| arm - nvfp4 (paired per seed) |" in md
    assert "| nvfp4_ais | 3 | +0.083 [+0.012, +0.155] |" in md
    # gain of bf16 over its SFT start: 0.2, 0.3, 0.4 -> +0.300 [+0.052, +0.548]
    assert "| bf16 | 3 | 0.300 ± 0.000 | 0.600 ± 0.100 | +0.300 [+0.052, +0.548] |" in md
    row = next(line for line in md.splitlines() if line.startswith("| nvfp4_ais | 0.650 ± 0.100 |"))
    assert "2.70e-01 ± 0.00e+00" in row and "0.900 ± 0.000" in row          # ais/alpha and alpha_ess columns
    for name in ("eval_accuracy.png", "reward.png", "mismatch.png", "entropy.png", "paired_vs_bf16.png",
                 "paired_vs_nvfp4.png"):
        assert 0 < (out / name).stat().st_size < 150_000, name


def test_archive_copies_only_small_records(campaign, tmp_path_factory):
    root, arms, _ = campaign
    ck = evidence.run_dir(root, 0, "bf16") / "checkpoints/step_000004"
    ck.mkdir(parents=True)
    (ck / "model.bin").write_bytes(b"x" * 1000)
    dest = tmp_path_factory.mktemp("records")
    files = evidence_report.archive(root, dest, list(arms), [0, 1, 2])
    assert len(files) == 3 + 9 * 2                                   # sft_eval.json per seed; metrics + DONE per run
    assert not list(dest.rglob("*.bin")) and (evidence.run_dir(dest, 2, "nvfp4_ais") / "metrics.jsonl").is_file()
    big = evidence.run_dir(root, 1, "nvfp4") / "metrics.jsonl"
    big.write_bytes(b"{}\n" * 1000)
    with pytest.raises(SystemExit, match="not a small record"):
        evidence_report.archive(root, dest, list(arms), [0, 1, 2], max_bytes=2000)


def test_resume_rule_keeps_checkpointed_runs(tmp_path):
    from megatron_qrl.run_dir import mark_latest

    cut = evidence.run_dir(tmp_path, 0, "a")
    (cut / "checkpoints/step_000010").mkdir(parents=True)
    (cut / "checkpoints/step_000010/manifest.json").write_text("{}")     # complete (written last by a save)
    mark_latest(cut, cut / "checkpoints/step_000010")
    (cut / "metrics.jsonl").write_text('{"step": 0}\n')
    (cut / evidence.UNFINISHED).write_text("{}\n")
    fresh = evidence.run_dir(tmp_path, 0, "b")
    fresh.mkdir(parents=True)
    (fresh / "metrics.jsonl").write_text('{"step": 0}\n')
    assert evidence.resumable(cut) and not evidence.resumable(fresh)
    evidence.prepare_for_restart(cut)
    evidence.prepare_for_restart(fresh)
    assert (cut / "metrics.jsonl").is_file() and not (cut / evidence.UNFINISHED).exists()
    assert fresh.is_dir() and not any(fresh.iterdir())


def test_gpu_arms_valid_and_qerl_starts_from_the_packed_sft(tmp_path):
    from megatron_qrl.config import load_config

    arms = evidence.load_arms(ROOT / "configs/evidence/gpu_arms.yaml")
    assert list(arms) == ["bf16", "nvfp4", "nvfp4_tis", "nvfp4_ais", "nvfp4_trace_ais", "nvfp4_trace_ais_aqn", "qerl"]
    base = str(ROOT / "configs/evidence/gpu_base.yaml")
    for arm in arms:
        ov = evidence.arm_overrides(tmp_path, 2, arm, arms, None)
        cfg = load_config(base, ov)
        init = next(o for o in ov if o.startswith("run.init_checkpoint="))
        want = evidence.lora_checkpoint(tmp_path, 2) if arm == "qerl" else evidence.sft_checkpoint(tmp_path, 2)
        assert init == f"run.init_checkpoint={want}"
        fp4 = arm != "bf16"
        assert (cfg.rollout.kv_cache == "fp4") == fp4 and (cfg.rollout.weights == "nvfp4") == fp4
        assert cfg.quant.targets == "all_linears" and cfg.trace.num_cached_layers == cfg.model.num_layers
        assert cfg.run.checkpoint_every > 0 and cfg.data.seed == 2
    assert load_config(base, evidence.arm_overrides(tmp_path, 0, "qerl", arms, None)).lora.enabled


def test_a_seed_without_its_sft_checkpoint_is_redone_whole(tmp_path):
    from megatron_qrl.run_dir import mark_latest

    arms = ["a", "b"]
    for seed in (0, 1):
        d = evidence.sft_dir(tmp_path, seed)
        d.mkdir(parents=True)
        (d / "sft_eval.json").write_text("{}")
        for arm in arms:
            evidence.run_dir(tmp_path, seed, arm).mkdir(parents=True)
            (evidence.run_dir(tmp_path, seed, arm) / evidence.DONE).write_text("{}")
    (evidence.run_dir(tmp_path, 1, "b") / evidence.DONE).unlink()          # seed 1: one arm left to run
    evidence.redo_orphaned_seed(tmp_path, 0, arms)                           # all DONE: the records stay
    evidence.redo_orphaned_seed(tmp_path, 1, arms)
    assert evidence.seed_done(tmp_path, 0, arms) and (evidence.sft_dir(tmp_path, 0) / "sft_eval.json").is_file()
    assert not evidence.sft_dir(tmp_path, 1).exists() and not (tmp_path / "seed1").exists()
    ck = evidence.sft_checkpoint(tmp_path, 0)                               # with its checkpoint: ready, kept
    ck.mkdir(parents=True)
    (ck / "manifest.json").write_text("{}")
    mark_latest(evidence.sft_dir(tmp_path, 0), ck)
    (evidence.run_dir(tmp_path, 0, "a") / evidence.DONE).unlink()
    evidence.redo_orphaned_seed(tmp_path, 0, arms)
    assert evidence.sft_ready(tmp_path, 0) and (evidence.run_dir(tmp_path, 0, "b") / evidence.DONE).is_file()


def test_campaign_options_reach_the_child_commands(monkeypatch, tmp_path):
    arms_file = ROOT / "configs/evidence/gpu_arms.yaml"
    monkeypatch.setattr(evidence, "ARMS", arms_file)
    monkeypatch.setattr(evidence, "SETS", ["run.total_steps=2"])
    cmd = evidence.sft_command(tmp_path, 3)
    assert cmd[-4:] == ["--arms-file", str(arms_file), "--set", "run.total_steps=2"]
    run = evidence.run_command(tmp_path, 3, "nvfp4", evidence.load_arms(), None)
    assert run.index("run.total_steps=2") < run.index("rl.is_method=none")   # the arm's overrides come last
