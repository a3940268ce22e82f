"""tools/evidence.py aggregation on synthetic metrics files (no training run): the table's means and sample
stds over seeds, the last-N reward window, metrics an arm never logs, unfinished runs left out, small PNGs."""
import json
import math
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import evidence  # noqa: E402


def _write_run(root: Path, seed: int, arm: str, rewards, evals: dict, mismatch: float, trace: bool,
               done: bool = True) -> None:
    d = evidence.run_dir(root, seed, arm)
    d.mkdir(parents=True)
    with open(d / "metrics.jsonl", "w") as f:
        for step, r in enumerate(rewards):
            rec = {"step": step, "time": 0.0, "reward/mean": r, "mismatch/logp_abs_diff": mismatch,
                   "rollout/tokens_per_s": 100.0 + seed, "train/step_s": 0.5}
            if trace:
                rec.update({"trace/code_mismatch_before": 0.03, "trace/code_mismatch_after": 0.0})
            if step in evals:
                rec["eval/accuracy"] = evals[step]
            f.write(json.dumps(rec) + "\n")
    if done:
        (d / evidence.DONE).write_text("{}\n")


@pytest.fixture
def campaign(tmp_path):
    finals = {"a": [0.50, 0.60, 0.70], "b": [0.25, 0.75, 0.50]}
    for arm, accs in finals.items():
        for seed, acc in enumerate(accs):
            rewards = [0.1 * seed + 0.01 * s for s in range(6)]
            _write_run(tmp_path, seed, arm, rewards, {2: acc - 0.1, 5: acc}, mismatch=1e-3 * (seed + 1),
                       trace=arm == "b")
    _write_run(tmp_path, 3, "a", [1.0] * 6, {5: 1.0}, 0.0, False, done=False)  # unfinished: ignored
    return tmp_path, finals


def test_table_means_and_sample_stds(campaign):
    root, finals = campaign
    runs = evidence.collect(root, ["a", "b"], [0, 1, 2, 3], last_n=3)
    assert sorted(runs["a"]) == [0, 1, 2]
    table = evidence.aggregate(runs)
    for arm, accs in finals.items():
        m, sd = table[arm]["final_eval"]
        assert m == pytest.approx(statistics.mean(accs)) and sd == pytest.approx(statistics.stdev(accs))
        m2, sd2 = table[arm]["eval_steps"][2]
        assert m2 == pytest.approx(statistics.mean(accs) - 0.1) and sd2 == pytest.approx(statistics.stdev(accs))
    # reward over the last 3 of 6 steps: 0.1*seed + mean(0.03, 0.04, 0.05) -> seeds 0,1,2
    last = [0.1 * s + 0.04 for s in range(3)]
    assert table["a"]["reward_last"] == pytest.approx((statistics.mean(last), statistics.stdev(last)))
    assert table["a"]["mismatch/logp_abs_diff"] == pytest.approx((2e-3, 1e-3))
    assert table["a"]["rollout/tokens_per_s"] == pytest.approx((101.0, 1.0))
    assert math.isnan(table["a"]["trace/code_mismatch_before"][0])          # arm a never logs TRACE
    assert table["b"]["trace/code_mismatch_before"] == pytest.approx((0.03, 0.0))

    md = evidence.markdown_table(table, last_n=3)
    row_b = next(line for line in md.splitlines() if line.startswith("| b | 3 |"))
    assert f"{statistics.mean(finals['b']):.3f} ± {statistics.stdev(finals['b']):.3f}" in row_b  # 0.500 ± 0.250
    row_a = next(line for line in md.splitlines() if line.startswith("| a | 3 |"))
    assert "| - | - | - | - |" in row_a                                      # no TRACE, AIS, IS columns for a


def test_mean_std_edge_cases():
    assert evidence.mean_std([0.4]) == (0.4, 0.0)
    assert all(math.isnan(x) for x in evidence.mean_std([None, float("nan")]))
    assert evidence.mean_std([1.0, None, 3.0]) == pytest.approx((2.0, math.sqrt(2.0)))


def test_outputs_written_and_small(campaign, tmp_path_factory):
    root, _ = campaign
    out = tmp_path_factory.mktemp("fig")
    arms = {"a": ["rl.is_method=none"], "b": ["rl.is_method=ais"]}
    md = evidence.write_outputs(root, out, arms, [0, 1, 2], last_n=3, ref="a")
    assert (out / "table.md").read_text() == md
    assert "| arm - a (paired per seed) |" in md
    for name in ("reward.png", "eval_accuracy.png", "mismatch.png", "paired_diff.png"):
        size = (out / name).stat().st_size
        assert 0 < size < 150_000, (name, size)


def test_arm_overrides_share_the_seed_checkpoint(tmp_path):
    arms = evidence.load_arms()
    assert len(arms) == 6
    ovs = {arm: evidence.arm_overrides(tmp_path, 1, arm, arms, 40) for arm in arms}
    inits = {next(o for o in ov if o.startswith("run.init_checkpoint=")) for ov in ovs.values()}
    assert inits == {f"run.init_checkpoint={evidence.sft_checkpoint(tmp_path, 1)}"}
    assert all("run.sft_steps=0" in ov and "run.total_steps=40" in ov and "data.seed=1" in ov for ov in ovs.values())
    from megatron_qrl.config import load_config
    for ov in ovs.values():  # every arm is a valid config
        load_config(str(evidence.BASE), ov)


def test_paired_differences_per_seed(campaign):
    root, finals = campaign
    runs = evidence.collect(root, ["a", "b"], [0, 1, 2], last_n=3)
    d = evidence.paired_diffs(runs, ref="a")
    per_seed = [b - a for a, b in zip(finals["a"], finals["b"])]        # -0.25, +0.15, -0.20
    assert d["b"]["n"] == 3
    assert d["b"]["final_eval"] == pytest.approx((statistics.mean(per_seed), statistics.stdev(per_seed)))
    assert d["b"]["reward_last"] == pytest.approx((0.0, 0.0))         # same rewards in both arms
    assert "a" not in d
    assert "| b | 3 | -0.100 ± 0.218 |" in evidence.diffs_table(d, "a", 3)


def test_per_seed_table_uses_each_arms_engine_for_the_start(campaign):
    root, _ = campaign
    for seed in range(3):
        d = evidence.sft_dir(root, seed)
        d.mkdir(parents=True)
        (d / "sft_eval.json").write_text(json.dumps({"eval_accuracy_nvfp4": 0.25 + seed / 8,
                                                     "eval_accuracy_bf16": 0.5}))
    arms = {"a": ["rollout.weights=bf16"], "b": ["rl.is_method=ais"]}
    runs = evidence.collect(root, list(arms), [0, 1, 2], last_n=3)
    md = evidence.per_seed_table(runs, root, [0, 1, 2], arms)
    assert "| a | 0.500 -> 0.500 | 0.500 -> 0.600 | 0.500 -> 0.700 |" in md
    assert "| b | 0.250 -> 0.250 | 0.375 -> 0.750 | 0.500 -> 0.500 |" in md
    assert evidence.sft_baseline(root, [0, 1, 2], arms)["b"] == pytest.approx((0.375, 0.125))
