"""Engine side of QeRL mode: adapters as a separate low-rank path vs merged into the weight at each sync (CPU).

    python tools/bench_lora_merge.py [--n 1024] [--k 1024] [--rank 16] [--tokens 1,16,256] [--reps 20]

One linear [N, K] with a packed NVFP4 base and rank-r adapters after a typical small update. Measured:
  - per sync: adapters only (nothing to do) vs merge = dequantize + W + s*B@A (+ re-quantize to NVFP4);
  - per forward (M tokens): separate = x@W^T + s*(x@A^T)@B^T vs merged bf16/fp32 weight x@W'^T;
  - error against the trainer's forward (dequant(W) x + s B A x): separate is exact by construction; merged
    and re-quantized to FP4 loses the update to FP4 rounding (the re-quantized weight differs from the
    trainer's base + adapter by a full FP4 step wherever a code flips, and the adapter delta itself, far
    below one FP4 step, mostly vanishes).
Prints a table (docs/lora.md records one run).
"""
from __future__ import annotations

import argparse
import time

import torch

from megatron_qrl.quant import nvfp4_dequantize, nvfp4_quantize


def _time(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--tokens", default="1,16,256")
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args(argv)
    torch.manual_seed(0)
    w = torch.randn(a.n, a.k) * 0.02
    packed, scales, gs = nvfp4_quantize(w)[:3]
    base = nvfp4_dequantize(packed, scales, gs, torch.float32)
    A = (torch.rand(a.rank, a.k) * 2 - 1) / a.k ** 0.5
    B = torch.randn(a.n, a.rank) * 1e-3            # a few RL steps' worth of adapter update
    s = 2.0

    def merge():
        return nvfp4_dequantize(packed, scales, gs, torch.float32) + s * B @ A

    def merge_requant():
        m = merge()
        return nvfp4_quantize(m)[:3]

    merged = merge()
    pr, sr, gr = merge_requant()
    requant = nvfp4_dequantize(pr, sr, gr, torch.float32)
    delta = s * B @ A
    print(f"linear {a.n}x{a.k}, rank {a.rank}, CPU threads {torch.get_num_threads()}")
    print(f"per sync: adapters only 0 ms (install {2 * a.rank * (a.n + a.k) * 2 / 1e6:.3f} MB of bf16 adapters); "
          f"merge {_time(merge, a.reps):.2f} ms; merge + re-quantize {_time(merge_requant, a.reps):.2f} ms")
    codes_flipped = float((pr != packed).float().mean())
    kept = float(((requant - base) * delta).sum() / (delta * delta).sum())
    print(f"merge + re-quantize: {100 * codes_flipped:.2f}% of packed bytes change; error vs the trainer's "
          f"base+adapter max {float((requant - merged).abs().max()):.2e} (adapter delta max "
          f"{float(delta.abs().max()):.2e}); projection of the FP4 change on the adapter delta: {kept:.2f}")
    print("| tokens | separate path ms | merged weight ms | separate / merged |\n|---|---|---|---|")
    for m in map(int, a.tokens.split(",")):
        x = torch.randn(m, a.k)
        sep = _time(lambda: x @ base.t() + s * (x @ A.t()) @ B.t(), a.reps)
        mer = _time(lambda: x @ merged.t(), a.reps)
        print(f"| {m} | {sep:.3f} | {mer:.3f} | {sep / mer:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
