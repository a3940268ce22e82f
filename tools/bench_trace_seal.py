"""What sealing one RL step's TRACE captures costs where they live (issue 27: the loop's trace/build_s).

Synthetic captures shaped like the loop's (configs/single_h200.yaml: S samples x N rows, the deepest L layers,
routed fc1 / fc2 of a Qwen3-30B-A3B layer, E=128 top-8), laid out as the graph decode path leaves them: per
field one device tensor, per sample a view. Times the recorder's batched add + build (checksum included) and the
same through one add per sample, each twice (the first pays kernel compilation).

    python tools/bench_trace_seal.py [--samples 256] [--rows 256] [--layers 6] [--device cuda]
"""
from __future__ import annotations

import argparse
import time

import torch


def captures(a, device):
    from megatron_qrl.rollout.protocol import ActivationCapture

    g = torch.Generator(device=device).manual_seed(0)
    S, N, k = a.samples, a.rows, 8
    routed = torch.rand(S, N, a.layers, 128, device=device, generator=g).topk(k).indices   # k distinct experts
    routed = routed.to(torch.int16).cpu()
    traces = [{} for _ in range(S)]
    for layer in range(a.layers):
        for role, width in (("fc1", 2048), ("fc2", 768)):
            bits = torch.randint(0, 256, (S, N, k, width // 8), dtype=torch.uint8, device=device, generator=g)
            scales = torch.randint(0, 120, (S, N, k, width // 16), dtype=torch.uint8, device=device,
                                   generator=g).view(torch.float8_e4m3fn)
            gs = torch.rand(S, N, k, device=device, generator=g) + 0.5
            for s in range(S):
                traces[s].setdefault(layer, {})[role] = ActivationCapture("nvfp4", bits[s], scales[s], gs[s])
    return traces, list(routed)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> int:
    from megatron_qrl.trace import TraceCacheBuilder

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    traces, routed = captures(a, device)
    print(f"[seal] {a.samples} samples x {a.rows} rows x {a.layers} layers on {device}", flush=True)
    for mode in ("batched", "batched", "per-sample"):
        sync(device)
        t0 = time.perf_counter()
        b = TraceCacheBuilder(0, 0)
        if mode == "batched":
            b.add_samples(range(a.samples), traces, routed)
        else:
            for s in range(a.samples):
                b.add_sample(s, traces[s], routed_experts=routed[s])
        t1 = time.perf_counter()
        cache = b.build()
        sync(device)
        t2 = time.perf_counter()
        print(f"[seal] {mode}: add {t1 - t0:.3f} s, build + checksum {t2 - t1:.3f} s, {cache.nbytes / 2**20:.0f} MiB, "
              f"{len(cache.entries)} entries on {cache.device}, checksum {cache.checksum:08x}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
