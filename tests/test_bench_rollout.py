"""tools/bench_rollout.py --tiny: the rollout benchmark end to end on the CPU (the static decode step without
graphs, kernels through the Triton interpreter), its checks against the eager engine, and its table."""
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_rollout_tiny_table(tmp_path):
    out = tmp_path / "res.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_rollout.py"), "--tiny",
                           "--engines", "fp4,bf16,hf", "--batches", "1,3", "--check", "3", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == ["batch", "fp4 tok/s", "bf16 tok/s", "hf tok/s", "fp4/bf16", "fp4/hf", "fp4 step ms",
                      "fp4 graph ms", "bf16 graph ms", "HBM floor ms", "graph/floor"]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]
    assert [r[0] for r in rows] == ["1", "3"]
    for r in rows:
        assert all(re.fullmatch(r"[0-9.]+|nan", c) for c in r[1:4]), r
        assert all(re.fullmatch(r"([0-9.]+|nan)x", c) for c in r[4:6]), r
    res = json.loads(out.read_text())
    assert res["decode"] == {"fp4": "static", "bf16": "static"}
    checks = res["checks"]
    # the static step against the eager engine of the same scheme and weights
    assert checks["fp4 vs fp4-eager"]["identical_sequences"] == "3/3"
    assert checks["fp4 vs fp4-eager"]["max_abs_logprob_diff_on_prefix"] < 1e-4
    assert checks["bf16 vs bf16-eager"]["max_abs_logprob_diff_on_prefix"] < 1e-5
    assert checks["w4a4-trace vs w4a4-trace-eager"]["routed_equal_on_prefix"]
    assert checks["w4a4-trace vs w4a4-trace-eager"]["trace_bits_bytes_agreeing_on_prefix"] > 0.9
