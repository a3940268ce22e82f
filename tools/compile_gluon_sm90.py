"""Compile the shared-A Gluon W4A16 kernel for sm_90a on a machine without a GPU, and report what ptxas
made of it: registers, spills (local loads/stores in the SASS), shared memory. Why: device time is short,
and a config that spills or does not fit is known before a GPU call.

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
    """GS{bn}x{bm}/s{stages}a{a_stages}/sk{split}/d{decoders} -> GluonGemmConfig."""
    from megatron_qrl.kernels.w4a16_gluon_gemm import GluonGemmConfig
    m = re.fullmatch(r"GS(\d+)x(\d+)/s(\d+)a(\d+)/sk(\d+)/d(\d+)", text)
    if not m:
        raise SystemExit(f"--cfg {text!r}: expected GS<bn>x<bm>/s<stages>a<a_stages>/sk<split>/d<decoders>")
    bn, bm, st, a, sk, d = m.groups()
    return GluonGemmConfig(block_n=int(bn), block_m=int(bm), stages=int(st), a_stages=int(a),
                           split_k=int(sk), decoders=int(d))


def compile_ss(cfg, m: int, n: int, k: int):
    """triton.compile of _w4a16_gluon_ss_kernel for this config and problem, target sm_90a."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type
    import megatron_qrl.kernels.w4a16_gluon_gemm as g

    words = torch.zeros((n, k // 8), dtype=torch.int32)        # CPU tensors: only shapes, strides, dtypes
    pairs = torch.zeros((n, k // 32), dtype=torch.int16)
    out = torch.zeros((m, n), dtype=torch.bfloat16)
    ws = torch.zeros((cfg.split_k, m, n), dtype=torch.float32) if cfg.split_k > 1 else out
    kwargs = g.ss_launch_args(cfg, torch.zeros((m, k), dtype=torch.bfloat16), words, pairs,
                              torch.ones(1, dtype=torch.float32), out, ws)
    options = {key: kwargs.pop(key) for key in ("num_warps", "maxnreg")}
    fn = g._w4a16_gluon_ss_kernel
    constexprs = {(fn.arg_names.index(name),): kwargs[name] for name in fn.arg_names
                  if fn.params[fn.arg_names.index(name)].is_constexpr}
    signature = {name: "constexpr" if (fn.arg_names.index(name),) in constexprs else mangle_type(kwargs[name])
                 for name in fn.arg_names}
    src = GluonASTSource(fn, signature, constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def cuobjdump(kernel, flag: str) -> str:
    """cuobjdump (the one that ships with Triton) on the compiled cubin: --dump-sass, --dump-resource-usage."""
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([tool, flag, f.name], check=True, capture_output=True, text=True).stdout


def regs_of(kernel) -> str:
    """The launch register count (REG:n of the resource usage; setmaxnreg moves it per warpgroup later)."""
    found = re.search(r"REG:(\d+)", cuobjdump(kernel, "--dump-resource-usage"))
    return found.group(1) if found else "?"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cfg", action="append", required=True, help="e.g. GS128x128/s6a5/sk1/d3 (repeatable)")
    ap.add_argument("--shape", default="128,14336,4096", help="M,N,K")
    ap.add_argument("--dump", default="", help="write ptx and sass per config here")
    a = ap.parse_args(argv)
    m, n, k = (int(v) for v in a.shape.split(","))
    for text in a.cfg:
        cfg = parse_cfg(text)
        kernel = compile_ss(cfg, m, n, k)
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
