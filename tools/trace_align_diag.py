"""Where does the trainer/engine TRACE disagreement come from? Short `qrl train` runs that differ in one
part of the engine's decode path (or the trainer's experts), side by side, with their TRACE and log-prob gap.

Each variant is one `qrl train` process (SFT warm start + a few RL steps of configs/single_h200.yaml, cut
small); a variant may patch one piece of the static decode step before the job starts:
- `unfused`:  the fused norm / QK-norm+RoPE+KV-write kernels off (torch ops instead);
- `noroute`:  the fused routing kernel off (Megatron's top-k routing, then alignment);
- `refattn`:  the cache-attention kernel off (the eager engine's attention; host-synchronising, so only
              with rollout.decode=static).
The table compares `trace/code_mismatch_after`, `trace/guided_fallback`, `trace/code_mismatch_before` and
`mismatch/logp_abs_diff` per variant (means over the RL steps).

GPU (device tool, carry .whl; the wheel install of docs/PERF.md first):
  python3 tools/trace_align_diag.py --out $OUT/trace_align [--variants eager,graphs,...] [--parallel 4]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["run.total_steps=3", "run.sft_steps=3", "rollout.prompts_per_step=16", "rollout.max_new_tokens=128",
          "rollout.max_batch_size=128", "trainer.micro_batch_size=16", "run.eval_every=0", "run.resume=false",
          "run.save_checkpoints=false"]
# name -> (overrides, patch)
VARIANTS = {
    "eager": (["rollout.decode=eager"], None),
    "graphs": (["rollout.decode=graphs"], None),
    "static": (["rollout.decode=static"], None),
    "graphs-unfused": (["rollout.decode=graphs"], "unfused"),
    "graphs-noroute": (["rollout.decode=graphs"], "noroute"),
    "static-refattn": (["rollout.decode=static"], "refattn"),
    "graphs-seqexperts": (["rollout.decode=graphs", "trainer.moe_experts=sequential"], None),
    "eager-seqexperts": (["rollout.decode=eager", "trainer.moe_experts=sequential"], None),
    # TRACE on every layer: no unguided layer upstream of a cached one, so no divergence reaches its inputs
    "graphs-alltrace": (["rollout.decode=graphs", "trace.num_cached_layers=12"], None),
}
KEYS = ["trace/code_mismatch_after", "trace/guided_fallback", "trace/code_mismatch_before", "mismatch/logp_abs_diff",
        "trace/missing_row_fraction", "rollout/tokens_per_s", "time/step_s"]


def apply_patch(name: str | None) -> None:
    """Turn one piece of the static decode step off (in this process, before the job builds its engine)."""
    if name is None:
        return
    from megatron_qrl.rollout import static_decode
    from megatron_qrl.rollout.decode_experts import FP4KernelExperts

    if name == "unfused":
        static_decode.DecodeModel._fusable = lambda self: (False, False)
    elif name == "noroute":
        def no_route(self):
            raise AttributeError("route")      # hasattr(experts, "route") is False: Megatron routing
        FP4KernelExperts.route = property(no_route)
    elif name == "refattn":
        init = static_decode.DecodeModel.__init__

        def ref_init(self, *a, **kw):
            kw["kernel_attention"] = False
            init(self, *a, **kw)
        static_decode.DecodeModel.__init__ = ref_init
    else:
        raise SystemExit(f"unknown patch {name!r}: use unfused, noroute or refattn")


def child(patch: str | None, argv: list[str]) -> int:
    apply_patch(patch)
    from megatron_qrl.cli import main

    return main(argv)


def summarize(path: Path) -> dict:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    rl = [r for r in rows if "trace/code_mismatch_after" in r or "mismatch/logp_abs_diff" in r]
    out = {"steps": len(rl)}
    for k in KEYS:
        vals = [r[k] for r in rl if isinstance(r.get(k), (int, float))]
        out[k] = sum(vals) / len(vals) if vals else None
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/trace_align")
    p.add_argument("--config", default="configs/single_h200.yaml")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--timeout", type=int, default=300)
    p.add_argument("overrides", nargs="*", help="more qrl overrides for every variant (after the common ones)")
    if sys.argv[1:2] == ["--child"]:              # one variant's job: [--patch NAME] then qrl's arguments
        rest = sys.argv[2:]
        patch = rest[1] if rest[:1] == ["--patch"] else None
        return child(patch, rest[2:] if patch else rest)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    names = [n for n in a.variants.split(",") if n]
    for n in names:
        if n not in VARIANTS:
            raise SystemExit(f"unknown variant {n!r}: use any of {', '.join(VARIANTS)}")
    env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="disabled", QRL_NO_PROGRESS="1")
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, a.parallel))))
    env["PYTHONPATH"] = os.pathsep.join(x for x in (env.get("PYTHONPATH"), str(ROOT)) if x)
    pending, running, results = list(names), {}, {}
    while pending or running:
        while pending and len(running) < a.parallel:
            n = pending.pop(0)
            overrides, patch = VARIANTS[n]
            run_dir = out / n
            cmd = [sys.executable, __file__, "--child"] + (["--patch", patch] if patch else []) + [
                "train", "--config", a.config, f"run.output_dir={run_dir}", *COMMON, *a.overrides, *overrides]
            log = open(out / f"{n}.log", "w")
            print(f"{time.strftime('%H:%M:%S')} start {n}: {' '.join(cmd[2:])}", flush=True)
            running[n] = (subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), time.time(), log)
        time.sleep(2)
        for n, (proc, t0, log) in list(running.items()):
            rc = proc.poll()
            if rc is None and time.time() - t0 > a.timeout:
                proc.kill()
                rc = "timeout"
            if rc is None:
                continue
            log.close()
            del running[n]
            results[n] = dict(rc=rc, wall_s=round(time.time() - t0, 1), **summarize(out / n / "metrics.jsonl"))
            print(f"{time.strftime('%H:%M:%S')} done {n}: {json.dumps(results[n])}", flush=True)
    (out / "summary.json").write_text(json.dumps(results, indent=1))
    short = {"trace/code_mismatch_after": "after", "trace/guided_fallback": "fallback",
             "trace/code_mismatch_before": "before", "mismatch/logp_abs_diff": "logp gap",
             "trace/missing_row_fraction": "missing rows", "rollout/tokens_per_s": "tok/s", "time/step_s": "step s"}
    print("| variant | rc | RL steps | " + " | ".join(short[k] for k in KEYS) + " |")
    print("|---" * (3 + len(KEYS)) + "|")
    for n in names:
        r = results[n]
        cells = [f"{r[k]:.3g}" if isinstance(r.get(k), float) else str(r.get(k)) for k in KEYS]
        print(f"| {n} | {r['rc']} | {r['steps']} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
