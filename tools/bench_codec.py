#!/usr/bin/env python3
"""Benchmark of the Triton FP4 codec kernels against a device-to-device copy and the torch reference.

Run on a CUDA GPU (tools/gpu_codec.sh runs it on the H200):
    python3 tools/bench_codec.py --out OUTDIR [--rows 8192 --cols 8192] [--no-sweep]

For an M x K bf16 tensor it times (median of triton.testing.do_bench, which flushes the L2 between runs):
  copy          dst.copy_(x): the input read + the same bytes written (the bandwidth ceiling we compare to)
  quant         NVFP4 quantize kernel, global scale precomputed: bytes = input + packed codes + E4M3 scales
  quant+capture the same + TRACE bits written
  quant (checked) the kernel with its per-tile range check (a global scale passed in by the caller)
  quant (wrapper) nvfp4_quantize_triton(x): torch amax for the global scale, the finiteness check and the kernel
  torch         megatron_qrl.quant.nvfp4_quantize(x, gs[, capture]): the reference path
  fake nearest / fake guided: the fused QAT kernels (input + output [+ scales + bits]) and their torch path
  mxfp4 quant(+capture)
Bandwidth = counted bytes / time; `vs copy` = bandwidth / copy bandwidth; `speedup` = torch time / kernel time.
Before timing, a sweep over blocks-per-program and warps picks the fastest launch (--no-sweep: defaults),
and every timed kernel's output is checked byte for byte against the torch path on fresh random inputs.
Writes bench_codec.json and bench_codec.md into --out.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from megatron_qrl.kernels import fp4_fake_quant as FF  # noqa: E402
from megatron_qrl.kernels import fp4_quant as FQ  # noqa: E402
from megatron_qrl.quant import GuidedRounding, mxfp4_quantize, nvfp4_quantize, quant_dequant  # noqa: E402
from megatron_qrl.quant.nvfp4 import nvfp4_global_scale  # noqa: E402

DEV = "cuda"   # --device cpu (with TRITON_INTERPRET=1, small shapes) only smoke-tests this script


def bench(fn, rep_ms):
    fn()
    if DEV != "cuda":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1000
    torch.cuda.synchronize()
    return do_bench(fn, warmup=max(10, rep_ms // 5), rep=rep_ms, return_mode="median")  # milliseconds


def fresh(shape, dtype, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(shape, device=DEV, generator=g)
    x = x * torch.exp(torch.randn(shape[0], 1, device=DEV, generator=g))   # rows of different scales
    return x.to(dtype)


def same_bytes(a, b):
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def quant_launch(x, gs, capture, cfg, check=False, fmt=0):
    return FQ._launch_quant(x, gs if fmt == 0 else None, fmt, capture, cfg["BB"], cfg["num_warps"],
                            cfg.get("div", 1), cfg.get("round", 2), check)


def verify_quant(shape, dtype, cfg, seeds, capture=True, check=False, fmt=0):
    """The kernel with this launch config gives the torch path's bytes on fresh random inputs."""
    for seed in seeds:
        x = fresh(shape, dtype, seed)
        if fmt == 0:
            gs = nvfp4_global_scale(x)
            p, s, b, _ = quant_launch(x, gs, capture, cfg, check)
            rp, rs, _, rb = nvfp4_quantize(x, gs, capture=True)
            ok = same_bytes(p, rp) and same_bytes(s, rs.view(torch.uint8)) and (not capture or same_bytes(b, rb))
        else:
            p, s, b, _ = quant_launch(x, None, capture, cfg, fmt=1)
            rp, rs, rb = mxfp4_quantize(x, capture=True)
            ok = same_bytes(p, rp) and same_bytes(s, rs) and (not capture or same_bytes(b, rb))
        if not ok:
            return False
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--cols", type=int, default=8192)
    ap.add_argument("--rep-ms", type=int, default=200, help="do_bench repetition time per measurement")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only smoke-tests the script (interpreter)")
    ap.add_argument("--verify-shape", default="1024x4096", help="fresh inputs for the sweep's byte checks")
    a = ap.parse_args()
    global DEV
    DEV = a.device
    assert DEV != "cuda" or torch.cuda.is_available(), "bench_codec.py needs a CUDA GPU"
    vshape = tuple(int(v) for v in a.verify_shape.split("x"))
    os.makedirs(a.out, exist_ok=True)
    t_start = time.time()
    shape, dtype = (a.rows, a.cols), torch.bfloat16
    n = a.rows * a.cols
    in_b, packed_b, sc_b, bits_b = n * 2, n // 2, n // 16, n // 8
    env = {"gpu": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter smoke test)", "torch": torch.__version__, "triton": triton.__version__,
           "cuda": torch.version.cuda, "shape": list(shape), "dtype": "bfloat16",
           "date": datetime.date.today().isoformat(), "rows_first": FQ.ROWS_FIRST}
    print(json.dumps(env), flush=True)

    x = fresh(shape, dtype, 0)
    gs = nvfp4_global_scale(x)
    rows = []

    def row(name, ms, nbytes, torch_ms=None, exact=None, note=""):
        r = {"name": name, "ms": ms, "bytes": nbytes, "GBps": nbytes / ms / 1e6, "exact": exact, "note": note}
        if torch_ms is not None:
            r["speedup_vs_torch"] = torch_ms / ms
        rows.append(r)
        print(f"{name:34s} {ms * 1000:9.1f} us {r['GBps']:8.0f} GB/s  {note}", flush=True)
        return r

    # ---- ceiling: device-to-device copy of the input bytes
    dst = torch.empty_like(x)
    copy_ms = bench(lambda: dst.copy_(x), a.rep_ms)
    copy = row("copy (read+write 2x input)", copy_ms, 2 * in_b)

    # ---- sweep of launch configs for the NVFP4 quantize kernel (each one verified first)
    sweep = []
    best = dict(FQ.DEFAULT_CONFIG["nvfp4"])
    if not a.no_sweep:
        cands = [dict(BB=bb, num_warps=nw) for bb in (64, 128, 256, 512) for nw in (1, 2, 4, 8)
                 if 32 * nw <= bb <= 128 * nw]
        base = dict(FQ.DEFAULT_CONFIG["nvfp4"])
        cands += [dict(base, round=1), dict(base, round=0), dict(base, div=0)]
        best_ms = None
        for cfg in cands:
            try:
                ok = verify_quant(vshape, dtype, cfg, seeds=(11,), capture=True)
                ms = bench(lambda: quant_launch(x, gs, False, cfg), max(50, a.rep_ms // 4))
            except Exception as e:  # a launch that does not compile or fit is reported and skipped
                print(f"sweep {cfg}: {type(e).__name__}: {e}", flush=True)
                continue
            sweep.append({**cfg, "ms": ms, "GBps": (in_b + packed_b + sc_b) / ms / 1e6, "exact": ok})
            print(f"sweep {cfg}: {ms * 1000:.1f} us exact={ok}", flush=True)
            if ok and (best_ms is None or ms < best_ms):
                best, best_ms = dict(cfg), ms
    print(f"launch config: {best}", flush=True)

    # ---- NVFP4 quantize
    torch_q = bench(lambda: nvfp4_quantize(x, gs), a.rep_ms)
    torch_qc = bench(lambda: nvfp4_quantize(x, gs, capture=True), a.rep_ms)
    ex = verify_quant(shape, dtype, best, seeds=(1, 2), capture=False)
    row("triton nvfp4 quant", bench(lambda: quant_launch(x, gs, False, best), a.rep_ms),
        in_b + packed_b + sc_b, torch_q, ex, "global scale given")
    ex = verify_quant(shape, dtype, best, seeds=(3, 4), capture=True)
    row("triton nvfp4 quant+capture", bench(lambda: quant_launch(x, gs, True, best), a.rep_ms),
        in_b + packed_b + sc_b + bits_b, torch_qc, ex)
    ex = verify_quant(shape, dtype, best, seeds=(5,), capture=True, check=True)
    row("triton nvfp4 quant (range-checked)", bench(lambda: quant_launch(x, gs, False, best, check=True), a.rep_ms),
        in_b + packed_b + sc_b, torch_q, ex, "caller's global scale")
    # end to end from x alone: amax kernel (one more read of x) + quantize with the global scale computed in it
    kw = dict(block_blocks=best["BB"], num_warps=best["num_warps"], round_impl=best.get("round", 2),
              div=best.get("div", 1))
    torch_e2e = bench(lambda: nvfp4_quantize(x), a.rep_ms)
    got = FQ.nvfp4_quantize_triton(x, check_finite=False, **kw)
    ref = nvfp4_quantize(x, got[2])   # the torch path with the kernel's (exact) global scale
    ex = same_bytes(got[0], ref[0]) and same_bytes(got[1].view(torch.uint8), ref[1].view(torch.uint8))
    row("triton nvfp4 quant end-to-end", bench(lambda: FQ.nvfp4_quantize_triton(x, check_finite=False, **kw), a.rep_ms),
        2 * in_b + packed_b + sc_b, torch_e2e, ex, "amax kernel + quant; bytes incl. the 2nd read")
    row("triton nvfp4 quant end-to-end, checked", bench(lambda: FQ.nvfp4_quantize_triton(x, **kw), a.rep_ms),
        2 * in_b + packed_b + sc_b, torch_e2e, None, "+ NaN/Inf check: one host sync")
    row("torch nvfp4 quant", torch_q, in_b + packed_b + sc_b, torch_q, True, "reference")
    row("torch nvfp4 quant+capture", torch_qc, in_b + packed_b + sc_b + bits_b, torch_qc, True, "reference")

    # ---- fused fake quant (QAT)
    xr = fresh(shape, dtype, 7)
    p, s, gsr, b = nvfp4_quantize(xr, capture=True)
    guide = GuidedRounding(bits=b, scales=s, global_scale=gsr)
    xt = (xr.float() * (1 + 0.02 * torch.randn(shape, device=DEV))).to(dtype)
    fb = FF.DEFAULT_CONFIG["nvfp4"]
    st1, st2 = {}, {}
    ex_g = (same_bytes(FF.nvfp4_fake_quant_triton(xt, guide, stats=st1),
                       quant_dequant(xt, "nvfp4", guide=guide, stats=st2)) and st1 == st2)
    # the global scale as the CPU reference computes it: torch on CUDA divides amax by 2688 as a
    # multiplication by its reciprocal, which can be 1 ulp off; the kernels compute the true quotient
    gsx = nvfp4_global_scale(xt.cpu()).to(DEV)
    ex_n = same_bytes(FF.nvfp4_fake_quant_triton(xt), quant_dequant(xt, "nvfp4", global_scale=gsx))
    torch_fn = bench(lambda: quant_dequant(xt, "nvfp4", global_scale=gsx), a.rep_ms)
    torch_fg = bench(lambda: quant_dequant(xt, "nvfp4", guide=guide), a.rep_ms)
    su8 = s.view(torch.uint8)
    gsx = gsx.reshape(())
    row("triton nvfp4 fake-quant nearest",
        bench(lambda: FF._launch(xt, 0, FF.MODE_NEAREST, gsx, None, None, 0.25, None, fb["BB"], fb["num_warps"],
                                 1, 2, True, None), a.rep_ms), 2 * in_b, torch_fn, ex_n, "global scale given")
    fb_sweep = []
    if not a.no_sweep:   # launch configs of the guided kernel (the QAT hot path), each verified
        for bb, nw in ((64, 1), (64, 2), (128, 2), (128, 4), (256, 4), (256, 8)):
            try:
                okf = same_bytes(FF.nvfp4_fake_quant_triton(xt, guide, block_blocks=bb, num_warps=nw),
                                 quant_dequant(xt, "nvfp4", guide=guide))
                ms = bench(lambda: FF._launch(xt, 0, FF.MODE_GUIDED, gsr, su8, b, 0.25, None, bb, nw, 1, 2, True,
                                              None), max(50, a.rep_ms // 4))
            except Exception as e:
                print(f"fake sweep {bb}/{nw}: {type(e).__name__}: {e}", flush=True)
                continue
            fb_sweep.append({"BB": bb, "num_warps": nw, "ms": ms, "exact": okf})
            print(f"fake sweep BB={bb} warps={nw}: {ms * 1000:.1f} us exact={okf}", flush=True)
        good = [f for f in fb_sweep if f["exact"]]
        if good:
            f = min(good, key=lambda f: f["ms"])
            fb = {"BB": f["BB"], "num_warps": f["num_warps"]}
    print(f"fake-quant launch config: {fb}", flush=True)
    row("triton nvfp4 fake-quant guided",
        bench(lambda: FF._launch(xt, 0, FF.MODE_GUIDED, gsr, su8, b, 0.25, None, fb["BB"], fb["num_warps"],
                                 1, 2, True, None), a.rep_ms), 2 * in_b + sc_b + bits_b, torch_fg, ex_g)
    cnt = torch.zeros((), dtype=torch.int32, device=DEV)
    row("triton nvfp4 fake-quant guided+count",
        bench(lambda: FF._launch(xt, 0, FF.MODE_GUIDED, gsr, su8, b, 0.25, cnt, fb["BB"], fb["num_warps"],
                                 1, 2, True, None), a.rep_ms), 2 * in_b + sc_b + bits_b, torch_fg, ex_g)
    row("torch nvfp4 fake-quant nearest", torch_fn, 2 * in_b, torch_fn, True, "reference")
    row("torch nvfp4 fake-quant guided", torch_fg, 2 * in_b + sc_b + bits_b, torch_fg, True, "reference")

    # ---- MXFP4
    mcfg = FQ.DEFAULT_CONFIG["mxfp4"]
    torch_m = bench(lambda: mxfp4_quantize(x, capture=True), a.rep_ms)
    ex = verify_quant(shape, dtype, mcfg, seeds=(8,), capture=True, fmt=1)
    row("triton mxfp4 quant+capture", bench(lambda: quant_launch(x, None, True, mcfg, fmt=1), a.rep_ms),
        in_b + packed_b + n // 32 + bits_b, torch_m, ex)
    row("torch mxfp4 quant+capture", torch_m, in_b + packed_b + n // 32 + bits_b, torch_m, True, "reference")

    for r in rows:
        r["vs_copy"] = r["GBps"] / copy["GBps"]
    result = {"env": env, "copy_GBps": copy["GBps"], "launch": best, "sweep": sweep, "rows": rows,
              "fake_launch": fb, "fake_sweep": fb_sweep,
              "seconds": time.time() - t_start,
              "all_exact": all(r["exact"] is not False for r in rows) and all(s["exact"] for s in sweep)
              and all(f["exact"] for f in fb_sweep)}
    with open(os.path.join(a.out, "bench_codec.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}; "
             f"{a.rows}x{a.cols} bf16; launch {best}; {env['date']}", "",
             "| kernel | time (us) | GB/s | vs copy | speedup vs torch | bytes equal torch | note |",
             "|---|---:|---:|---:|---:|---|---|"]
    for r in rows:
        sp = f"{r['speedup_vs_torch']:.1f}x" if "speedup_vs_torch" in r else ""
        ex = {True: "yes", False: "NO", None: ""}[r["exact"]]
        lines.append(f"| {r['name']} | {r['ms'] * 1000:.1f} | {r['GBps']:.0f} | {r['vs_copy'] * 100:.0f}% | {sp} | "
                     f"{ex} | {r['note']} |")
    if sweep:
        lines += ["", "Sweep (NVFP4 quantize, no capture):", "", "| config | time (us) | GB/s | exact |",
                  "|---|---:|---:|---|"]
        for s_ in sweep:
            cfg = {k: v for k, v in s_.items() if k not in ("ms", "GBps", "exact")}
            lines.append(f"| {cfg} | {s_['ms'] * 1000:.1f} | {s_['GBps']:.0f} | {s_['exact']} |")
    if fb_sweep:
        lines += ["", "Sweep (NVFP4 guided fake-quant):", "", "| config | time (us) | exact |", "|---|---:|---|"]
        for f in fb_sweep:
            lines.append(f"| BB={f['BB']} warps={f['num_warps']} | {f['ms'] * 1000:.1f} | {f['exact']} |")
    md = "\n".join(lines)
    with open(os.path.join(a.out, "bench_codec.md"), "w") as f:
        f.write(md + "\n")
    print("\n" + md, flush=True)
    print(f"all_exact={result['all_exact']} ({result['seconds']:.0f} s)", flush=True)
    return 0 if result["all_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
