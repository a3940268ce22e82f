"""tools/bench_rollout.py --tiny: the rollout throughput benchmark end to end on the CPU (kernel path through
the Triton interpreter), and its table parses."""
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
                           "--batches", "1,3", "--reps", "1", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[:5] == ["batch", "bf16 tok/s", "w4a16 tok/s", "w4a4 tok/s", "hf tok/s"]
    assert header[5:] == ["w4a16/bf16", "w4a4/bf16", "hf/bf16"]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]
    assert [r[0] for r in rows] == ["1", "3"]
    for r in rows:
        assert all(re.fullmatch(r"[0-9.]+|nan", c) for c in r[1:5]), r
        assert all(re.fullmatch(r"([0-9.]+|nan)x", c) for c in r[5:]), r
    res = json.loads(out.read_text())
    assert res["kernels"] == {"bf16": False, "w4a16": True, "w4a4": True}
    checks = res["checks"]
    # the interpreter's kernel path against the dequantize-then-matmul engine, and our bf16 engine against HF
    assert checks["w4a16 kernels vs reference"]["max_abs_logprob_diff_on_prefix"] < 2e-2
    assert checks["bf16 engine vs hf greedy"]["first_token_equal"] == "3/3"
