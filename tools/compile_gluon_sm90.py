"""Compile the Gluon W4A16 kernels (shared-A, warp-specialized register-A) for sm_90a without a GPU.

Reports what ptxas made of a config: registers, spills (local loads/stores in the SASS), shared memory.
Why: device time is short, and a config that spills or does not fit is known before a GPU call.

Needs Triton 3.6 (the GPU image's; its ptxas and cuobjdump come with the wheel) in the running Python:
    python3 -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0 torch==2.13.0
    PYTHONPATH=$PWD /tmp/t36/bin/python tools/compile_gluon_sm90.py --cfg GS128x128/s6a5/sk1/d3 [--dump DIR]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import torch


def parse_cfg(text: str):
    """A bench name -> GluonGemmConfig: GS{bn}x{bm}/s{stages}a{a_stages}/sk{split}/d{decoders} (shared-A)
    or GW{bn}x{bm}/s{stages}/sk{split}/c{ctas_per_sm}[/p] (warp-specialized register-A)."""
    from megatron_qrl.kernels.w4a16_gluon_gemm import GluonGemmConfig
    gs = re.fullmatch(r"GS(\d+)x(\d+)/s(\d+)a(\d+)/sk(\d+)/d(\d+)", text)
    if gs:
        bn, bm, st, a, sk, d = (int(v) for v in gs.groups())
        return GluonGemmConfig(block_n=bn, block_m=bm, stages=st, a_stages=a, split_k=sk, decoders=d)
    gw = re.fullmatch(r"GW(\d+)x(\d+)/s(\d+)/sk(\d+)/c(\d+)(/p)?", text)
    if gw:
        bn, bm, st, sk, c = (int(v) for v in gw.groups()[:5])
        return GluonGemmConfig(block_n=bn, block_m=bm, stages=st, split_k=sk, ws=True, ctas_per_sm=c,
                               pipelined=bool(gw.group(6)))
    raise SystemExit(f"--cfg {text!r}: expected GS<bn>x<bm>/s<stages>a<a_stages>/sk<split>/d<decoders> or "
                     f"GW<bn>x<bm>/s<stages>/sk<split>/c<ctas>[/p]")


def compile_config(cfg, m: int, n: int, k: int):
    """triton.compile of the config's kernel for this problem, target sm_90a, from the launch's own
    argument list (CPU tensors stand in: only shapes, strides and dtypes matter)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type
    import megatron_qrl.kernels.w4a16_gluon_gemm as g

    words = torch.zeros((n, k // 8), dtype=torch.int32)
    pairs = torch.zeros((n, k // 32), dtype=torch.int16)
    out = torch.zeros((m, n), dtype=torch.bfloat16)
    ws = torch.zeros((cfg.split_k, m, n), dtype=torch.float32) if cfg.split_k > 1 else out
    if cfg.decoders:
        fn, launch_args, x = g._w4a16_gluon_ss_kernel, g.ss_launch_args, torch.zeros((m, k), dtype=torch.bfloat16)
    else:
        fn, launch_args, x = g._w4a16_gluon_ws_kernel, g.ws_launch_args, torch.zeros((m, k), dtype=torch.float16)
    kwargs = launch_args(cfg, x, words, pairs, torch.ones(1, dtype=torch.float32), out, ws)
    options = {key: kwargs.pop(key) for key in ("num_warps", "maxnreg")}
    constexprs = {(i,): kwargs[name] for i, name in enumerate(fn.arg_names) if fn.params[i].is_constexpr}
    signature = {name: "constexpr" if (i,) in constexprs else mangle_type(kwargs[name])
                 for i, name in enumerate(fn.arg_names)}
    return triton.compile(GluonASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                          options=options)


def cuobjdump(kernel, flag: str) -> str:
    """cuobjdump (the one that ships with Triton) on the compiled cubin: --dump-sass, --dump-resource-usage."""
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([tool, flag, f.name], check=True, capture_output=True, text=True).stdout


def wgmma_verdict(kernel) -> str:
    """What ptxas -v says about the kernel's wgmma pipeline: its "serialized due to ..." note (C7513 / C7515 ...),
    or "pipelined" when it has none. A serialized kernel waits for every wgmma before it issues the next."""
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "k.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        log = subprocess.run([tool, "-arch=sm_90a", "-v", ptx, "-o", os.path.join(d, "k.cubin")], check=True,
                             capture_output=True, text=True).stderr
    found = re.findall(r"\((C75\d\d)\) Potential Performance Loss: wgmma.mma_async instructions are serialized "
                       r"due to ([^.]*?) in the function", log)
    return "; ".join(f"serialized ({code}: {why})" for code, why in found) or "pipelined"


def regs_of(kernel) -> str:
    """The launch register count (REG:n of the resource usage; setmaxnreg moves it per warpgroup later)."""
    found = re.search(r"REG:(\d+)", cuobjdump(kernel, "--dump-resource-usage"))
    return found.group(1) if found else "?"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cfg", action="append", required=True,
                    help="e.g. GS128x128/s6a5/sk1/d3 or GW128x128/s6/sk1/c1/p (repeatable)")
    ap.add_argument("--shape", default="128,14336,4096", help="M,N,K")
    ap.add_argument("--dump", default="", help="write ptx and sass per config here")
    a = ap.parse_args(argv)
    m, n, k = (int(v) for v in a.shape.split(","))
    for text in a.cfg:
        cfg = parse_cfg(text)
        kernel = compile_config(cfg, m, n, k)
        sass = cuobjdump(kernel, "--dump-sass")
        spills = len(re.findall(r"\b(?:STL|LDL)\b", sass))
        print(f"{cfg.short()}: regs {regs_of(kernel)}, spill insts {spills}, shared {kernel.metadata.shared} B, "
              f"SASS lines {sass.count(chr(10))}")
        if a.dump:
            os.makedirs(a.dump, exist_ok=True)
            stem = os.path.join(a.dump, cfg.short().replace("/", "_"))
            with open(stem + ".ptx", "w") as f:
                f.write(kernel.asm["ptx"])
            with open(stem + ".sass", "w") as f:
                f.write(sass)
    return 0


if __name__ == "__main__":
    sys.exit(main())
