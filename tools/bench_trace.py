"""TRACE costs on the rollout side: capture overhead of engine.generate, and cache build/transfer vs rollout.

    python tools/bench_trace.py [--config configs/tiny_cpu.yaml] [--device auto|cpu|cuda] [overrides ...]

One process, one source model, one EmbeddedEngine per capture mode (same weights, same prompts, same
sampling seed, AQN off):
    off    trace.enabled=false              (no capture)
    half   trace.num_cached_layers default  (the deepest half of the layers, the run default)
    all    trace.num_cached_layers=L        (every layer)
Runs are interleaved (the mode order rotates every round, after one warm-up round) and timed with CUDA
synchronisation; the table shows medians (also the minimum, and the median of this process's CPU time,
which waiting for other processes on a shared host does not inflate). capture overhead = median(mode) /
median(off) - 1. All modes must produce identical tokens (capture does not change numerics); checked.
One more generate() per mode with synchronised timers splits the time into the model forward, the
capture post-processing (`scatter_steps`, once per call at its end), the rest of the engine step, the
rest of the end-of-call collection (one device->host copy per captured tensor, `_collect`) and the
per-sequence assembly.
Cache (from the 'half' / 'all' rollouts): TraceCacheBuilder.build (sort, dedup, checksum), to_bytes
(serialize), from_bytes(verify=True) (decode + checksum check, what a receiving rank does), and on CUDA the
host->device copy of the serialized cache from pinned memory: each as a fraction of the rollout time.
The model runs on cuda when torch sees a GPU (the project's build_model places it there); --device cpu
hides the GPU. --json writes the numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/tiny_cpu.yaml")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--prompts", type=int, default=32, help="sequences per generate() call")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(12, 28), metavar=("MIN", "MAX"))
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (after one warm-up round)")
    p.add_argument("--time-budget", type=float, default=0.0,
                   help="seconds for the timed rounds; fewer rounds (>= 3) when the warm-up says they won't fit")
    p.add_argument("--modes", default="off,half,all")
    p.add_argument("--json", default=None)
    p.add_argument("overrides", nargs="*")
    return p.parse_args(argv)


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def breakdown(engine, prompts, sp, device) -> dict:
    """One extra generate() with timers (CUDA-synchronised) around the engine's parts: the model forward
    (FP4 hooks and, when on, capture of the codes inside the linears), scatter_steps (all steps' captured
    rows -> [token, slot] tensors, once at the end of the call), the rest of the step (capture set-up,
    sampling), the rest of _collect (one device->host copy per tensor, per-sequence split) and _to_sample."""
    from collections import defaultdict

    import megatron_qrl.rollout.capture as cap

    acc: dict = defaultdict(float)

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            _sync(device)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _sync(device)
                acc[name] += time.perf_counter() - t0
        return wrapper

    original = cap.scatter_steps
    cap.scatter_steps = timed("scatter_records", original)
    engine.runner.forward = timed("forward", engine.runner.forward)      # instance attributes shadow methods
    engine._step = timed("step", engine._step)
    engine._to_sample = timed("to_sample", engine._to_sample)
    engine._collect = timed("collect", engine._collect)
    try:
        _sync(device)
        t0 = time.perf_counter()
        engine.generate(prompts, sp)
        _sync(device)
        total = time.perf_counter() - t0
    finally:
        cap.scatter_steps = original
        del engine.runner.forward, engine._step, engine._to_sample, engine._collect
    return {"total_s": total, "forward_s": acc["forward"], "scatter_records_s": acc["scatter_records"],
            "step_rest_s": acc["step"] - acc["forward"], "collect_s": acc["collect"] - acc["scatter_records"],
            "to_sample_s": acc["to_sample"], "scheduler_s": total - acc["step"] - acc["collect"] - acc["to_sample"]}


def run(a) -> dict:
    import torch

    from megatron_qrl.config import load_config
    from megatron_qrl.models import build_model
    from megatron_qrl.platform import init_distributed
    from megatron_qrl.rollout.embedded import EmbeddedEngine
    from megatron_qrl.rollout.protocol import SamplingParams
    from megatron_qrl.trace import TraceCacheBuilder, TraceCache, config_fingerprint

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = a.config if os.path.isabs(a.config) else os.path.join(root, a.config)
    cfg = load_config(path, ["aqn.enabled=false", "trace.enabled=true", "r3.enabled=true",
                             "rollout.weights=nvfp4", "rollout.scheme=w4a4", *a.overrides])
    if not torch.cuda.is_available():
        cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"bf16": False})})
    init_distributed(cfg)
    torch.manual_seed(cfg.trainer.seed)
    source = build_model(cfg)[0]
    device = next(source.parameters()).device
    L = cfg.model.num_layers

    def mode_cfg(mode):
        tr = cfg.trace
        if mode == "off":
            tr = tr.model_copy(update={"enabled": False})
        elif mode == "half":
            tr = tr.model_copy(update={"enabled": True, "num_cached_layers": None})
        elif mode == "all":
            tr = tr.model_copy(update={"enabled": True, "num_cached_layers": L})
        else:
            raise SystemExit(f"unknown mode '{mode}' (off, half, all)")
        return cfg.model_copy(update={"trace": tr})

    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    engines = {}
    for m in modes:
        engines[m] = EmbeddedEngine(mode_cfg(m), max_batch_size=a.prompts)   # KV cache: only the slots we use
        engines[m].sync_from_model(source, version=0)
        engines[m].set_aqn_noise(0.0, 0)
    del source
    g = torch.Generator().manual_seed(1)
    vocab = min(cfg.model.vocab_size, 64)
    lo, hi = a.prompt_len
    prompts = [torch.randint(1, vocab, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()
               for _ in range(a.prompts)]
    sp = SamplingParams(temperature=1.0, max_new_tokens=a.max_new_tokens, seed=7)   # no stop token

    times = {m: [] for m in modes}
    cpu_times = {m: [] for m in modes}   # this process's CPU time: robust to other processes on a shared host
    outs = {}

    def one(m):
        _sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        out = engines[m].generate(prompts, sp)
        _sync(device)
        times[m].append(time.perf_counter() - t0)
        cpu_times[m].append(time.process_time() - c0)
        outs[m] = out
        print(f"[bench] {m}: {times[m][-1]:.4f} s wall, {cpu_times[m][-1]:.4f} s CPU", file=sys.stderr, flush=True)

    for m in modes:                     # warm-up round (not timed)
        one(m)
    warm = {m: times[m].pop() for m in modes}
    for m in modes:
        cpu_times[m].pop()
    rounds = a.repeats
    if a.time_budget > 0:
        per_round = sum(warm.values())
        rounds = max(3, min(a.repeats, int(a.time_budget // max(per_round, 1e-9))))
    for r in range(rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        for m in order:
            one(m)
    ref = [o.tokens for o in outs[modes[0]]]
    identical = all([o.tokens for o in outs[m]] == ref for m in modes)
    steps = engines[modes[0]].stats["steps"] // max(1, engines[modes[0]].stats["generate_calls"])

    res = {"device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "torch": torch.__version__, "config": a.config, "overrides": a.overrides,
           "layers": L, "experts": cfg.model.num_experts, "topk": cfg.model.moe_router_topk,
           "hidden": cfg.model.hidden_size, "moe_ffn": cfg.model.moe_ffn_hidden_size,
           "dtype": str(next(engines[modes[0]].model.parameters()).dtype),
           "sequences": a.prompts, "max_new_tokens": a.max_new_tokens, "engine_steps": steps,
           "generated_tokens": sum(len(t) for t in ref), "rounds": rounds, "identical_tokens": identical,
           "rollout_s": {m: _median(times[m]) for m in modes}, "rollout_s_all": times,
           "rollout_min_s": {m: min(times[m]) for m in modes},
           "rollout_cpu_s": {m: _median(cpu_times[m]) for m in modes}, "rollout_cpu_s_all": cpu_times}
    for key, src in (("capture_overhead", "rollout_s"), ("capture_overhead_min", "rollout_min_s"),
                     ("capture_overhead_cpu", "rollout_cpu_s")):
        base = res[src].get("off")
        res[key] = {m: (res[src][m] / base - 1.0) for m in modes if base and m != "off"}

    print(f"[bench] medians {res['rollout_s']} overhead {res['capture_overhead']}", file=sys.stderr, flush=True)
    res["breakdown"] = {m: breakdown(engines[m], prompts, sp, device) for m in modes}
    res["cache"] = {}
    for m in modes:
        if m == "off":
            continue
        mc = mode_cfg(m)
        rollouts = outs[m]
        build_t, ser_t, ver_t, h2d_t = [], [], [], []
        cache = blob = None
        for _ in range(max(3, min(rounds, 5))):
            t0 = time.perf_counter()
            b = TraceCacheBuilder(0, 0, config_fingerprint(mc), layers=mc.cached_layers())
            for i, s in enumerate(rollouts):
                b.add_sample(i, s.trace, routed_experts=s.routed_experts)
            cache = b.build()
            t1 = time.perf_counter()
            blob = cache.to_bytes(pin_memory=device.type == "cuda")
            t2 = time.perf_counter()
            TraceCache.from_bytes(blob, verify=True)
            t3 = time.perf_counter()
            build_t.append(t1 - t0)
            ser_t.append(t2 - t1)
            ver_t.append(t3 - t2)
            if device.type == "cuda":
                _sync(device)
                t4 = time.perf_counter()
                blob.to(device, non_blocking=True)
                _sync(device)
                h2d_t.append(time.perf_counter() - t4)
        roll = res["rollout_s"][m]
        c = {"cached_layers": mc.cached_layers(), "bytes": cache.nbytes, "elements": cache.elements,
             "bits_per_element": cache.bits_per_element(), "build_s": _median(build_t),
             "serialize_s": _median(ser_t), "decode_verify_s": _median(ver_t),
             "h2d_s": _median(h2d_t) if h2d_t else None}
        for k in ("build_s", "serialize_s", "decode_verify_s", "h2d_s"):
            if c[k] is not None:
                c[k.replace("_s", "_vs_rollout")] = c[k] / roll
        res["cache"][m] = c
    return res


def table(res: dict) -> str:
    modes = list(res["rollout_s"])
    lines = [f"device {res['device']}" + (f" ({res['gpu']})" if res["gpu"] else "") + f", torch {res['torch']}, "
             f"{res['dtype']}; {res['config']} {' '.join(res['overrides'])}",
             f"model: {res['layers']} layers, hidden {res['hidden']}, {res['experts']} experts top-{res['topk']}, "
             f"expert ffn {res['moe_ffn']}; {res['sequences']} sequences x {res['max_new_tokens']} new tokens "
             f"({res['engine_steps']} engine steps/generate), {res['rounds']} timed rounds; identical tokens "
             f"across modes: {res['identical_tokens']}",
             "", "| mode | rollout s (median) | capture overhead (median; min; CPU time) | cache MiB | bits/elem "
             "| build s | serialize s | decode+verify s | H2D s | (build+ser+decode+H2D) / rollout |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for m in modes:
        ovs = [res[k].get(m) for k in ("capture_overhead", "capture_overhead_min", "capture_overhead_cpu")]
        ov = "-" if ovs[0] is None else "; ".join(f"{100 * o:+.1f}%" for o in ovs)
        c = res["cache"].get(m)
        if c is None:
            lines.append(f"| {m} | {res['rollout_s'][m]:.4f} | {ov} | - | - | - | - | - | - | - |")
            continue
        tot = c["build_s"] + c["serialize_s"] + c["decode_verify_s"] + (c["h2d_s"] or 0.0)
        h2d = "-" if c["h2d_s"] is None else f"{c['h2d_s']:.5f}"
        lines.append(f"| {m} (layers {c['cached_layers'][0]}..{c['cached_layers'][-1]}) | {res['rollout_s'][m]:.4f} "
                     f"| {ov} | {c['bytes'] / 2 ** 20:.3f} "
                     f"| {c['bits_per_element']:.3f} | {c['build_s']:.4f} | {c['serialize_s']:.4f} "
                     f"| {c['decode_verify_s']:.4f} | {h2d} | {100 * tot / res['rollout_s'][m]:.1f}% |")
    if res.get("breakdown"):
        parts = ["forward_s", "scatter_records_s", "step_rest_s", "collect_s", "to_sample_s", "scheduler_s"]
        lines += ["", "one generate() with synchronised timers per part (s):", "",
                  "| mode | total | " + " | ".join(p[:-2] for p in parts) + " |", "|---" * (len(parts) + 2) + "|"]
        for m, b in res["breakdown"].items():
            lines.append(f"| {m} | {b['total_s']:.4f} | " + " | ".join(f"{b[p]:.4f}" for p in parts) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    a = _parse(argv)
    if a.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no GPU")
    res = run(a)
    print(table(res), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
