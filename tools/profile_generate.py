#!/usr/bin/env python3
"""Where one generate() call of the embedded engine spends its host and device time (torch.profiler, CPU and
CUDA activities): the bench_rollout model and engines, one warm-up call, then a profiled call; prints the top
operators by self CPU time and by device time, and the loop's phase times.

    python tools/profile_generate.py --engine w4a4-trace --batch 64 [--layers 4] [--new-tokens 64]
"""
from __future__ import annotations

import argparse
import sys

sys.path.insert(0, __import__("os").path.dirname(__file__))


def main(argv=None) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    import bench_rollout as br
    from megatron_qrl.platform import init_distributed

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", default="w4a4-trace", choices=sorted(br.ENGINES))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--timed", type=int, default=5, help="unprofiled calls timed first (long and 1-token)")
    a = p.parse_args(argv)
    tiny = [] if torch.cuda.is_available() else ["--tiny"]          # CPU: the bench's smoke model, static step
    args = br._parse(["--layers", str(a.layers), "--batches", str(a.batch), "--new-tokens", str(a.new_tokens)] + tiny)
    init_distributed(br.make_cfg(args, a.layers, "bf16", a.batch))
    eng = br.build_engine(args, a.layers, a.engine, a.batch)
    prompts = br.prompts_for(args, (br.TINY_SHAPE if tiny else br.QWEN3_30B_SHAPE)["vocab_size"], a.batch, torch.Generator().manual_seed(1))
    br.time_engine(eng, prompts, a.new_tokens)                      # warm-up: compiles, captures
    loop = eng._static_loop
    for n_new in (a.new_tokens, 1):             # unprofiled calls: wall time and the loop's phases per call
        before = dict(loop.stats)
        times = [br.time_engine(eng, prompts, n_new)[0] for _ in range(a.timed)]
        phases = {k: round((loop.stats[k] - before[k]) / a.timed * 1e3, 2) for k in loop.stats if k.endswith("_s")}
        print(f"unprofiled, {n_new} new tokens: {' '.join(f'{t * 1e3:.1f}' for t in times)} ms per call; "
              f"phases ms per call {phases}", flush=True)
    for k in loop.stats:
        loop.stats[k] = type(loop.stats[k])(0)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        dt, _ = br.time_engine(eng, prompts, a.new_tokens)
    print(f"generate: {dt * 1e3:.1f} ms; phases {({k: round(v, 4) for k, v in loop.stats.items()})}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows))
    if torch.cuda.is_available():
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=a.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
