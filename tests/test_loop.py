"""The RL loop end to end: one process vs two torchrun processes (data parallel, colocated engines), and a
stopped run that resumes from its checkpoint and continues the same metrics stream."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch_ranks import torchrun_cmd

ROOT = Path(__file__).resolve().parents[1]
# W4A16 rollouts: with W4A4 the engine's per-tensor activation scale depends on which tokens share a step,
# so two data-parallel engines would not sample exactly what one engine samples.
OVERRIDES = ["run.eval_every=0", "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=8",
             "rollout.scheme=w4a16", "trace.enabled=false", "trainer.micro_batch_size=4", "run.sft_steps=2",
             "run.wandb_mode=disabled"]
EXACT = ["reward/mean", "reward/std", "response/len_mean", "aqn/sigma", "sync/hash_ok"]
# Log-probs of the two layouts agree to ~1e-6 (gradient all-reduce order); quantities built on the tiny
# train/rollout divergence (~1e-3) inherit that absolute error, hence absolute tolerances.
CLOSE = {"train/loss": 1e-5, "mismatch/logp_abs_diff": 1e-5, "ais/alpha": 1e-4, "train/grad_norm": 1e-4,
         "is/weight_mean": 1e-5}



def assert_same_metrics(ref: list, got: list, exact=EXACT, close=CLOSE, rel=None, skip_missing=False) -> None:
    """Step by step, the `exact` metrics equal and each `close` one within its absolute tolerance (and `rel`);
    skip_missing: a `close` metric the reference step lacks is not compared."""
    for r, m in zip(ref, got):
        for k in exact:
            assert m[k] == r[k], k
        for k, tol in close.items():
            if k in r or not skip_missing:
                assert m[k] == pytest.approx(r[k], rel=rel, abs=tol), k


def _train(out: Path, steps: int, nproc: int = 1, extra=(), env_extra=None, check=True):
    args = ["--config", str(ROOT / "configs/tiny_cpu.yaml"), f"run.output_dir={out}",
            f"run.total_steps={steps}", "run.checkpoint_every=1", *OVERRIDES, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "QRL_NO_PROGRESS": "1", **(env_extra or {})}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    if nproc == 1:
        cmd = [sys.executable, "-m", "megatron_qrl.launch.train", *args]
    else:
        cmd = torchrun_cmd(nproc, "-m", "megatron_qrl.launch.train", *args)
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if not check:
        return r
    assert r.returncode == 0, r.stderr[-4000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("single"), steps=3)


def test_two_data_parallel_processes_match_one(reference, tmp_path):
    dp = _train(tmp_path / "dp2", steps=3, nproc=2)
    assert [m["step"] for m in dp] == [0, 1, 2]
    assert_same_metrics(reference, dp, rel=1e-4)


def test_stopped_run_resumes_and_continues_the_metrics_stream(reference, tmp_path):
    out = tmp_path / "resumed"
    _train(out, steps=3, extra=["run.stop_after_steps=2"])  # the same 3-step job, ended after 2 steps
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000002"
    metrics = _train(out, steps=3)  # same directory: resumes at step 2
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for k in EXACT + list(CLOSE):  # same layout, same seeds: bit-exact on CPU
        assert metrics[2][k] == reference[2][k], k


def test_qrl_eval_reports_heldout_accuracy_of_a_checkpoint(reference, tmp_path):
    out = tmp_path / "evalrun"
    _train(out, steps=1)
    ckpt = out / "checkpoints" / "step_000001"
    assert (out / "config.yaml").is_file()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "megatron_qrl.launch.evaluate", str(ckpt), "data.eval_size=16",
                        "--out", str(tmp_path / "eval.json")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["eval/num_prompts"] == 16 and 0.0 <= result["eval/accuracy"] <= 1.0
    assert result["task"] == "arithmetic"
    bad = subprocess.run([sys.executable, "-m", "megatron_qrl.launch.evaluate", str(tmp_path / "missing")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "does not exist" in bad.stderr and "Traceback" not in bad.stderr


# ------------------------------------------------------------------------------------ disaggregated
# W4A4 rollouts with TRACE: one engine rank generates exactly what the single process's engine does, and
# the TRACE cache reaches the trainer over torch.distributed (trace.exchange) instead of staying local.
DISAGG = ["rollout.scheme=w4a4", "trace.enabled=true", "run.eval_every=2"]
DISAGG_EXACT = EXACT + ["trace/code_mismatch_before", "trace/code_mismatch_after", "trace/cache_bytes",
                        "eval/accuracy", "train/loss", "mismatch/logp_abs_diff", "r3/router_agreement"]


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("single_traced")
    return out, _train(out, steps=3, extra=DISAGG)


@pytest.fixture(scope="module")
def traced_reference(traced_run):
    return traced_run[1]


def test_disaggregated_trainer_and_engine_ranks_match_one_process(traced_reference, tmp_path):
    """Rank 0 trains, rank 1 serves rollouts (rollout.placement=disaggregated): same metrics stream."""
    out = tmp_path / "disagg"
    got = _train(out, steps=3, nproc=2, extra=DISAGG + ["rollout.placement=disaggregated"])
    assert [m["step"] for m in got] == [0, 1, 2]
    for ref, m in zip(traced_reference, got):
        for k in DISAGG_EXACT:
            if k in ref:
                assert m[k] == ref[k], k
        assert m["trace/transfer_s"] > 0 and m["sync/hash_ok"] == 1.0
    assert got[1]["trace/code_mismatch_before"] > 0 and got[1]["trace/code_mismatch_after"] == 0
    assert "eval/accuracy" in got[1]                      # scored by the engine rank, logged by the trainer
    # the engine rank joined the collective checkpoint writes: complete checkpoints, manifest world = trainers
    manifest = json.loads((out / "checkpoints" / "step_000003" / "manifest.json").read_text())
    assert manifest["layout"]["world_size"] == 1


def test_disaggregated_run_resumes_with_engine_ranks(traced_reference, tmp_path):
    """The first launch also loses its engine once (rank 1's generate raises at step 1): the engine rank
    rebuilds its engine, reinstalls the step's weights and AQN draw and generates the batch again."""
    out = tmp_path / "disagg_resume"
    extra = DISAGG + ["rollout.placement=disaggregated"]
    first = _train(out, steps=3, nproc=2, extra=extra + ["run.stop_after_steps=2"],
                   env_extra={"QRL_FAULT_INJECT": "engine_crash@1r1"}, check=False)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "restarting the engine and retrying" in first.stderr
    before = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for k in DISAGG_EXACT:   # the retried batch is the batch one process generated
        if k in traced_reference[1]:
            assert before[1][k] == traced_reference[1][k], k
    metrics = _train(out, steps=3, nproc=2, extra=extra)
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for k in DISAGG_EXACT:
        if k in traced_reference[2]:
            assert metrics[2][k] == traced_reference[2][k], k


def test_disaggregated_needs_a_trainer_rank(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "megatron_qrl.launch.train", "--config",
                        str(ROOT / "configs/tiny_cpu.yaml"), f"run.output_dir={tmp_path}",
                        "rollout.placement=disaggregated"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode != 0 and "leaves no trainer rank" in r.stderr


@pytest.fixture(scope="module")
def from_checkpoint(traced_run, tmp_path_factory):
    """One process started from the traced run's step-1 checkpoint: the reference of the sharded layouts,
    which Megatron would otherwise initialise differently from a TP=PP=1 model."""
    init = ["run.sft_steps=0", f"run.init_checkpoint={traced_run[0] / 'checkpoints' / 'step_000001'}"]
    return init, _train(tmp_path_factory.mktemp("from_ckpt"), steps=2, extra=DISAGG + init)


@pytest.mark.parametrize("layout", ["trainer.tensor_parallel=2", "trainer.pipeline_parallel=2"])
def test_sharded_trainer_with_an_engine_rank_matches_one_process(from_checkpoint, layout, tmp_path):
    """A TP=2 or PP=2 trainer on ranks 0-1, the engine on rank 2: each sync gathers the shards into the
    unsharded weights (gather_weights.py), TRACE replays on the shards."""
    init, ref = from_checkpoint
    got = _train(tmp_path / "sharded", steps=2, nproc=3,
                 extra=DISAGG + init + ["rollout.placement=disaggregated", layout])
    for r, m in zip(ref, got):
        for k in EXACT:
            assert m[k] == r[k], k
        assert m["train/loss"] == pytest.approx(r["train/loss"], rel=1e-5, abs=1e-7)
        assert m["train/grad_norm"] == pytest.approx(r["train/grad_norm"], rel=1e-3)
        assert m["trace/code_mismatch_after"] == 0 and m["trace/code_mismatch_before"] > 0
        # only engine-routed tokens count, not the positions padded for sequence parallelism
        assert m["r3/router_agreement"] == pytest.approx(r["r3/router_agreement"], abs=1e-3)
        # the engine holds exactly the gathered weights and TRACE replays on the shards
        assert m["mismatch/logp_abs_diff"] == pytest.approx(r["mismatch/logp_abs_diff"], rel=0.05, abs=1e-7)


@pytest.fixture(scope="module")
def from_checkpoint_all_layers(traced_run, tmp_path_factory):
    """As from_checkpoint, with every layer's expert inputs cached (trace.num_cached_layers=4)."""
    init = ["run.sft_steps=0", f"run.init_checkpoint={traced_run[0] / 'checkpoints' / 'step_000001'}",
            "trace.num_cached_layers=4"]
    return init, _train(tmp_path_factory.mktemp("from_ckpt_all"), steps=2, extra=DISAGG + init)


def test_expert_parallel_trainer_replays_trace_like_one_process(from_checkpoint_all_layers, tmp_path):
    """EP=2 trainer (ranks 0-1, so DP=2 for the dense part) with the engine on rank 2, every layer cached.
    Each local expert sees the tokens of both EP ranks (Megatron's alltoall dispatcher); the guides follow
    them (trace/lookup.py ExpertSources) and the cache brings each rank its experts' rows for both ranks'
    samples. With every expert input guided, W4A4 QAT rounds exactly as the rollout did, whichever tokens
    share a tensor, so the trainer matches one process (without the EP guides the log-prob gap is ~1e-2)."""
    init, ref = from_checkpoint_all_layers
    got = _train(tmp_path / "ep2", steps=2, nproc=3,
                 extra=DISAGG + init + ["rollout.placement=disaggregated", "trainer.expert_parallel=2"])
    for r, m in zip(ref, got):
        for k in EXACT:
            assert m[k] == r[k], k
        assert m["trace/code_mismatch_before"] > 0 and m["trace/code_mismatch_after"] == 0
        assert r["trace/code_mismatch_after"] == 0
        assert m["train/loss"] == pytest.approx(r["train/loss"], rel=1e-5, abs=1e-7)
        assert m["mismatch/logp_abs_diff"] == pytest.approx(r["mismatch/logp_abs_diff"], rel=0.05, abs=1e-6)
        assert m["mismatch/logp_abs_diff"] < 1e-4


@pytest.fixture(scope="module")
def w4a16_from_checkpoint(traced_run, tmp_path_factory):
    """One process from the traced run's step-1 checkpoint with W4A16 rollouts and weight-only QAT: numbers
    that neither the engine count (W4A4 engines scale activations per step) nor the tokens an expert's
    tensor gathers under EP (W4A4 QAT scales per tensor) can change."""
    init = ["run.sft_steps=0", f"run.init_checkpoint={traced_run[0] / 'checkpoints' / 'step_000001'}",
            "quant.scheme=w4a16"]
    return init, _train(tmp_path_factory.mktemp("w4a16_from_ckpt"), steps=2, extra=init)


@pytest.mark.parametrize("layout", ["trainer.tensor_parallel=2", "trainer.pipeline_parallel=2",
                                    "trainer.expert_parallel=2"])
def test_colocated_sharded_trainer_matches_one_process(w4a16_from_checkpoint, layout, tmp_path):
    """Two ranks, each a trainer shard (TP=2, PP=2, or EP=2 with DP=2) and an engine: every sync gathers the full
    model on every rank, each engine runs it in a one-rank Megatron world of its own
    (platform.engine_world) and generates a share of the prompts."""
    init, ref = w4a16_from_checkpoint
    got = _train(tmp_path / "colocated_sharded", steps=2, nproc=2, extra=init + [layout])
    assert_same_metrics(ref, got, skip_missing=True)


def test_colocated_sharded_trainer_refuses_lora(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "megatron_qrl.launch.train", "--config",
                        str(ROOT / "configs/tiny_cpu.yaml"), f"run.output_dir={tmp_path}", "trainer.tensor_parallel=2",
                        "lora.enabled=true"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "with a sharded colocated trainer" in r.stderr


def test_disaggregated_nonfinite_stop_releases_the_engine_ranks(tmp_path):
    """Too many NaN steps in a row: the trainer writes a checkpoint (the engine rank joins it) and stops the
    engine rank too, so the job ends with the guard's status instead of waiting for a collective timeout."""
    out = tmp_path / "disagg_nan"
    r = _train(out, steps=6, nproc=2, extra=DISAGG + ["rollout.placement=disaggregated", "run.checkpoint_every=0",
                                                       "run.max_nonfinite_steps=1"],
               env_extra={"QRL_FAULT_INJECT": "nan_loss@0,nan_loss@1"}, check=False)
    assert r.returncode != 0 and "stopping: 2 RL steps in a row" in r.stderr, r.stderr[-3000:]
    ckpt = out / "checkpoints" / "step_000002"
    assert (ckpt / "manifest.json").is_file()
