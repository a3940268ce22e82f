"""CPU smoke of tools/bench_trainer.py (the QAT on/off trainer benchmark) on the tiny config.

One subprocess (Megatron is imported once, torch.distributed stays out of the pytest process) runs the
benchmark (both modes in one process, tiny batch, a time budget that forces the minimum of 2 timed steps)
and the trainer smoke (--smoke); the JSON of both is checked. Plus in-process checks of the batch builder
and the report, which need no Megatron.
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import bench_trainer  # noqa: E402

DRIVER = """
import sys
sys.path.insert(0, {tools!r})
import bench_trainer as b
rc = b.main(["--config", "configs/tiny_cpu.yaml", "--device", "cpu", "--global-batch", "8", "--seq-len", "16",
             "--warmup", "1", "--steps", "3", "--time-budget", "0.01", "--out", {bench!r}])
assert rc == 0, rc
rc = b.main(["--smoke", "--device", "cpu", "--global-batch", "8", "--seq-len", "16", "--out", {smoke!r}])
sys.exit(rc)
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_trainer")
    bench, smoke = out / "bench.json", out / "smoke.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    code = DRIVER.format(tools=str(ROOT / "tools"), bench=str(bench), smoke=str(smoke))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return json.loads(bench.read_text()), json.loads(smoke.read_text()), proc.stdout


def test_bench_runs_both_modes_in_one_process(results):
    res, _, stdout = results
    assert res["same_process"] and list(res["modes"]) == ["off", "on"]
    assert res["device"] == "cpu" and res["global_batch"] == 8 and res["seq_len"] == 16
    on, off = res["modes"]["on"], res["modes"]["off"]
    assert on["quant"]["qat"] and not off["quant"]["qat"]
    assert on["qat_linears"] > 0 and off["qat_linears"] == 0  # the switch really changes the model
    assert on["params_this_rank"] == off["params_this_rank"]
    for m in (on, off):
        assert m["freed"], "the first trainer must be released before the second is built"
        assert m["steps"] == 2, "a time budget that is already spent leaves the minimum of 2 timed steps"
        assert len(m["step_s_all"]) == 2 and m["step_s_median"] > 0 and m["tokens_per_s"] > 0
        assert m["memory_kind"] == "cpu_rss" and m["rss_after_steps_gib"] > 0
        assert all(math.isfinite(x) for x in m["losses"] + m["grad_norms"])
        assert m["num_micro_batches"] == 1.0  # 8 sequences / micro_batch_size 8
    # the same initial weights and batch: the first GRPO losses agree up to the FP4 effect
    assert abs(on["losses"][0] - off["losses"][0]) < 0.05
    r = res["ratio"]
    assert r["step_time"] == pytest.approx(on["step_s_median"] / off["step_s_median"])
    assert isinstance(r["meets_target"], bool)
    assert "QAT on / off step time" in stdout and "| mode | QAT |" in stdout


def test_trainer_smoke_passes_on_cpu(results):
    _, smoke, stdout = results
    assert smoke["ok"], smoke["checks"]
    assert smoke["param_device"] == "cpu" and smoke["qat_linears"] > 0
    assert smoke["logprobs_vs_loss_abs"] <= smoke["tolerance"]
    assert "SMOKE OK" in stdout


def test_batch_is_grpo_shaped():
    from megatron_qrl.config import load_config

    cfg = load_config(ROOT / "configs/tiny_cpu.yaml")
    b = bench_trainer.make_batch(cfg, 16, 32, seed=3)
    assert b["tokens"].shape == (16, 32) and int(b["tokens"].max()) < cfg.model.vocab_size
    assert b["loss_mask"][:, :8].sum() == 0 and (b["loss_mask"].sum(1) >= 12).all()
    g = cfg.rollout.group_size
    for s in range(0, 16, g):  # advantages standardised within each GRPO group
        a = b["advantages"][s:s + g]
        assert abs(float(a.mean())) < 1e-5 and abs(float(a.std(unbiased=False)) - 1) < 1e-3
    again = bench_trainer.make_batch(cfg, 16, 32, seed=3)
    assert all((again[k] == b[k]).all() for k in b)


def test_report_ratio_and_table():
    mode = {"quant": {"qat": True, "format": "nvfp4", "targets": "routed_experts", "scheme": "w4a4"},
            "step_s_median": 1.2, "step_s_min": 1.1, "cpu_s_median": 1.0, "tokens_per_s": 1000.0,
            "logprobs_s": 0.5, "memory_kind": "cuda_allocated", "peak_mem_gib": 30.0, "static_mem_gib": 8.0,
            "steps": 5, "build_s": 2.0}
    off = {**mode, "quant": {**mode["quant"], "qat": False}, "step_s_median": 1.0, "step_s_min": 1.0,
           "peak_mem_gib": 25.0}
    res = {"modes": {"off": off, "on": mode}}
    bench_trainer.add_ratio(res)
    assert res["ratio"]["step_time"] == pytest.approx(1.2) and res["ratio"]["meets_target"]
    assert res["ratio"]["peak_mem"] == pytest.approx(1.2)
    text = bench_trainer.table(res)
    assert "1.200x" in text and "PASS" in text and "peak mem GiB" in text
