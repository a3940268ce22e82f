"""What one kernel boundary costs inside a CUDA graph on this GPU (issue 27: the 48-layer decode step's kernels
are busy only ~44% of it, 664 launches per step).

Chains of N dependent tiny kernels captured in one graph, timed over replays (CUDA events); per kernel:
  triton          a Triton kernel (x += 1 on a [64, 2048] bf16 tensor, 64 programs)
  triton-pdl      the same launched with programmatic dependent launch (griddepcontrol.wait first)
  triton-pdl-early  ... and griddepcontrol.launch_dependents right after the wait
  torch-add       torch's own elementwise kernel
  mm              cuBLAS bf16 [64, 2048] x [2048, 2048]
  smem-alt        the tiny kernel alternating with a Triton GEMM that uses ~100 KB of shared memory (a change of
                  the SM's shared-memory carveout between neighbours), against the GEMM alone
Usage: python tools/probe_graph_launch.py [--n 600] [--out results/graph_launch.json]
"""
from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from graph_timing import replay_us


@triton.jit
def _bump(x_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        if EARLY:
            tl.extra.cuda.gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=m) + 1.0, mask=m)


@triton.jit
def _gemm(a_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pm, pn = tl.program_id(0), tl.program_id(1)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    for k in range(0, K, BK):
        a = tl.load(a_ptr + rm[:, None] * K + (k + rk)[None, :], mask=rm[:, None] < M, other=0.0)
        b = tl.load(b_ptr + (k + rk)[:, None] * N + rn[None, :])
        acc += tl.dot(a, b)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16), mask=rm[:, None] < M)


def per_kernel_us(body, n_kernels: int) -> float:
    """The replay time of body()'s graph per kernel it launches."""
    return replay_us(body)[0] / n_kernels


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=600)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    dev = torch.device("cuda")
    x = torch.zeros(64, 2048, dtype=torch.bfloat16, device=dev)
    w = torch.randn(2048, 2048, dtype=torch.bfloat16, device=dev)
    y = torch.empty(64, 2048, dtype=torch.bfloat16, device=dev)
    n, block = x.numel(), 2048
    grid = (triton.cdiv(n, block),)

    def bump(pdl=False, early=False):
        kw = {"launch_pdl": True} if pdl else {}
        _bump[grid](x, n, BLOCK=block, PDL=pdl, EARLY=early, **kw)

    def gemm():
        _gemm[(1, 2048 // 64)](x, w, y, 64, 2048, 2048, BM=64, BN=64, BK=128, num_stages=4)

    res = {"n": a.n, "device": torch.cuda.get_device_name()}
    cases = {
        "triton": (lambda: [bump() for _ in range(a.n)], a.n),
        "triton-pdl": (lambda: [bump(True) for _ in range(a.n)], a.n),
        "triton-pdl-early": (lambda: [bump(True, True) for _ in range(a.n)], a.n),
        "torch-add": (lambda: [x.add_(1.0) for _ in range(a.n)], a.n),
        "mm": (lambda: [torch.mm(x, w, out=y) for _ in range(a.n // 4)], a.n // 4),
        "gemm-alone": (lambda: [gemm() for _ in range(a.n // 4)], a.n // 4),
        "smem-alt": (lambda: [(gemm(), bump()) for _ in range(a.n // 4)], a.n // 2),
    }
    for name, (body, count) in cases.items():
        try:
            res[name + "_us_per_kernel"] = round(per_kernel_us(body, count), 3)
        except Exception as e:  # noqa: BLE001 - one failing case (e.g. no PDL in this Triton) must not hide the rest
            res[name + "_error"] = f"{type(e).__name__}: {e}"[:300]
        print(f"[probe] {name}: {res.get(name + '_us_per_kernel', res.get(name + '_error'))}", flush=True)
    x.zero_()
    bump(True, True)
    torch.cuda.synchronize()
    res["pdl_result_ok"] = bool((x == 1).all())
    print(json.dumps(res))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
