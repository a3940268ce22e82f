"""Issue-30 features in the real RL loop: KL to the frozen initial policy, DAPO dynamic sampling with overlong
shaping, a sequence-level IS correction and a per-sequence loss normalisation. Two data-parallel processes
log what one process logs; a stopped run resumes with the reference reloaded from its step-0 checkpoint;
a disaggregated job's engine rank joins the reference's collective save and load."""
import json

import pytest

from test_loop import DISAGG, _train, assert_same_metrics

FEATURES = ["rl.kl_coef=0.05", "rl.dynamic_sampling.enabled=true", "rl.dynamic_sampling.max_generate_calls=3",
            "rl.overlong_buffer_len=2", "rl.loss_agg_mode=seq-mean-token-mean", "rl.is_level=geo"]
EXACT = ["reward/mean", "reward/std", "response/len_mean", "dynamic_sampling/generate_calls",
         "dynamic_sampling/dropped_groups", "dynamic_sampling/kept_groups", "dynamic_sampling/reward_mean_generated",
         "overlong/penalty_mean"]
# log-probs of two layouts agree to ~1e-6, the KL values are ~1e-5: absolute tolerances
CLOSE = {"kl/ref_mean": 1e-7, "kl/ref_k1": 1e-6, "train/kl_loss": 1e-7, "train/loss": 1e-5,
         "mismatch/kl_k3": 1e-7, "mismatch/chi2": 1e-5, "is/seq_ratio_mean": 1e-5}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("features_single")
    return out, _train(out, steps=3, extra=FEATURES)


def test_features_are_logged_and_the_reference_is_the_initial_policy(single):
    out, metrics = single
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert metrics[0]["kl/ref_mean"] == 0.0 and metrics[0]["kl/ref_k1"] == 0.0   # reference = step-0 weights
    assert metrics[2]["kl/ref_k3"] > 0 and metrics[2]["train/kl_loss"] > 0
    assert (out / "checkpoints" / "step_000000" / "manifest.json").is_file()     # the initial policy, on disk
    assert any(m["dynamic_sampling/extra_generate_calls"] > 0 and m["dynamic_sampling/dropped_groups"] > 0
               for m in metrics)                                                # refills did happen
    for m in metrics:
        assert m["dynamic_sampling/generate_calls"] >= 1 and m["dynamic_sampling/kept_groups"] >= 1
        assert {"mismatch/kl_k1", "mismatch/log_ppl_diff", "mismatch/outside_window_frac", "is/seq_ratio_max",
                "overlong/penalty_mean"} <= set(m)


def test_features_two_data_parallel_processes_match_one(single, tmp_path):
    got = _train(tmp_path / "dp2", steps=3, nproc=2, extra=FEATURES)
    assert_same_metrics(single[1], got, EXACT, CLOSE, rel=1e-3)


def test_a_resumed_run_reloads_the_reference_from_its_step0_checkpoint(single, tmp_path):
    out = tmp_path / "resumed"
    _train(out, steps=3, extra=FEATURES + ["run.stop_after_steps=2"])
    metrics = _train(out, steps=3, extra=FEATURES)
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for k in EXACT + list(CLOSE) + ["kl/ref_k2", "kl/ref_k3"]:   # same layout: bit-exact on CPU
        assert metrics[2][k] == single[1][2][k], k


def test_reward_mode_with_a_named_reference(single, tmp_path):
    ref = single[0] / "checkpoints" / "step_000003"
    out = tmp_path / "reward_mode"
    metrics = _train(out, steps=2, extra=FEATURES + ["rl.kl_mode=reward", "rl.kl_estimator=low_var_kl",
                                                     f"rl.kl_reference={ref}"])
    assert metrics[0]["kl/ref_mean"] > 0 and metrics[0]["kl/reward_penalty_mean"] > 0   # not the initial weights
    assert "train/kl_loss" not in metrics[0]                                              # no loss term
    assert not (out / "checkpoints" / "step_000000").exists()                             # nothing to write


def test_disaggregated_engine_rank_joins_the_reference_save_and_load(tmp_path):
    kl = ["rl.kl_coef=0.05", "rl.is_level=seq"]
    one = _train(tmp_path / "one", steps=2, extra=DISAGG + kl)
    out = tmp_path / "disagg"
    extra = DISAGG + kl + ["rollout.placement=disaggregated"]
    _train(out, steps=2, nproc=2, extra=extra + ["run.stop_after_steps=1"])   # writes step_000000 with rank 1
    got = _train(out, steps=2, nproc=2, extra=extra)                           # loads it, rank 1 joining
    manifest = json.loads((out / "checkpoints" / "step_000000" / "manifest.json").read_text())
    assert manifest["layout"]["world_size"] == 1
    assert [m["step"] for m in got] == [0, 1]
    for k in ("kl/ref_mean", "kl/ref_k1", "train/kl_loss", "train/loss", "reward/mean", "mismatch/kl_k3"):
        assert got[1][k] == one[1][k], k
