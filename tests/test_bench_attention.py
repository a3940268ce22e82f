"""tools/bench_attention.py --cpu-smoke: the decode-attention benchmark end to end on the CPU (tiny shapes, the
Triton interpreter, wall-clock timing): every kernel and tunable set is checked against the reference before
it is timed, and the table and JSON come out."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_attention_cpu_smoke(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_attention.py"), "--cpu-smoke",
                           "--configs", "all", "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ERROR" not in proc.stdout, proc.stdout[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[:5] == ["heads q/kv", "B", "context", "SDPA bf16", "bf16 kernel"] and "NVFP4 best" in header
    assert len(lines) == 3 and "FAILED" not in lines[2]
    res = json.loads((tmp_path / "bench_attention.json").read_text())
    (row,) = res["rows"]
    for bench in ("sdpa", "bf16", "fp8", "nvfp4"):
        results = row["results"][bench]
        assert all(r["err"] < 2e-2 and r["us"] > 0 for r in results), (bench, results)
    assert len(row["results"]["nvfp4"]) > 10 and row["nvfp4"]["best"]["speedup"] > 0
