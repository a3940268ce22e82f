"""Compile the packed-KV decode-attention kernel for sm_90a without a GPU and show what the compiler made of it.

Prints, per format: registers, spills, shared memory, the TTGIR layout traffic (convert_layout / local_alloc /
local_load and the element types they move) and the SASS instruction mix of the hottest loop (the largest
backward branch), grouped by pipe: global / shared loads and stores, tensor-core ops, integer / float ALU,
MUFU. Why: device time is short; a variant whose decoded K / V tiles still round-trip through shared memory,
or whose loop issues twice the instructions, is known before a GPU call.

Needs Triton 3.6 (the GPU image's) in the running Python, as tools/compile_gluon_sm90.py says:
    PYTHONPATH=$PWD /tmp/t36/bin/python tools/inspect_attention_sm90.py [--fmt fp4,fp8] [--group 8] [--dump DIR]
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compile_gluon_sm90 import cuobjdump, regs_of  # noqa: E402

MAXNREG = int(os.environ.get("MAXNREG", "0"))   # cap the registers (ptxas), as a launch would with maxnreg
RING_MASKS = os.environ.get("RING_MASKS", "1") == "1"   # kv_decode_gluon.RING_MASKS for the Gluon kernel
RING_STAGES = int(os.environ.get("RING_STAGES", "0"))     # kv_decode_gluon.RING_STAGES (0: its default)
VECTOR_STORES = os.environ.get("VECTOR_STORES", "1") == "1"   # kv_decode_gluon.VECTOR_STORES
Q_VECTOR_LOADS = os.environ.get("Q_VECTOR_LOADS", "1") == "1"   # kv_decode_gluon.Q_VECTOR_LOADS
PIPES = [("ldg", r"^LDG"), ("ldgsts", r"^LDGSTS"), ("lds", r"^LDS(?!M)"), ("ldsm", r"^LDSM"), ("sts", r"^STS"),
         ("stg", r"^STG"), ("mma", r"^(HMMA|HGMMA|QGMMA|IMMA)"), ("mufu", r"^MUFU"),
         ("fp32", r"^(FADD|FMUL|FFMA|FMNMX|FSEL|FSETP|FCHK)"), ("fp16", r"^(HADD2|HMUL2|HFMA2|HMNMX2|HSET)"),
         ("cvt", r"^(F2F|F2I|I2F|F2FP|I2FP)"), ("int", r"^(LOP3|SHF|IADD3|IMAD|PRMT|ISETP|SEL|LEA|IABS|SGXT|BFE|BMSK)"),
         ("shfl", r"^SHFL"), ("bar", r"^(BAR|DEPBAR|WARPSYNC|ARRIVES|SYNCS)"), ("mov", r"^(MOV|S2R|CS2R|S2UR|UMOV)")]


def compile_kernel(fmt: str, group: int, block_s: int, num_warps: int, num_stages: int, decode: str = "word",
                   d: int = 128, kernel: str = "_packed_decode_kernel", splits: int = 2):
    """triton.compile of the kernel for one (format, GQA group) with the launch's constexprs, target sm_90a."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type

    import megatron_qrl.kernels.kv_decode_attention as m
    import megatron_qrl.kernels.kv_decode_gluon as g
    from megatron_qrl.kernels.kv_layout import PackedKV
    hkv, slots, length = 2, 2, 256
    q = torch.zeros((slots, hkv * group, d), dtype=torch.bfloat16)
    keys, values = (PackedKV.zeros(fmt, slots, hkv, length, d, "cpu") for _ in range(2))
    idx = torch.zeros(slots, dtype=torch.long)
    acc = torch.zeros((slots, hkv * group, splits, d), dtype=torch.float32)
    ml = torch.zeros((slots, hkv * group, splits, 2), dtype=torch.float32)
    if kernel == "gluon":
        g.RING_MASKS = RING_MASKS
        g.RING_STAGES = RING_STAGES or g.RING_STAGES
        g.VECTOR_STORES = VECTOR_STORES
        g.Q_VECTOR_LOADS = Q_VECTOR_LOADS
        fn = g._gluon_decode_kernel
        kwargs = g.kernel_args(q, keys, values, idx, idx, acc, ml, 0.1, block_s,
                               prefetch={"noprefetch": 0, "prefetch2": 2, "prefetch3": 3}.get(decode, 1),
                               out=torch.zeros_like(q), counters=torch.zeros(slots * hkv, dtype=torch.int32))
    else:
        fn = getattr(m, kernel)
        kwargs = m.kernel_args(q, keys, values, idx, idx, acc, ml, 0.1, block_s, decode=decode, fp8_native=True)
        kwargs["F32"] = False                  # the GPU's value (INTERPRET is off there)
    constexprs = {(i,): kwargs[name] for i, name in enumerate(fn.arg_names) if fn.params[i].is_constexpr}
    signature = {name: "constexpr" if (i,) in constexprs else mangle_type(kwargs[name])
                 for i, name in enumerate(fn.arg_names)}
    # what the JIT specializes at launch: tensors 16-byte aligned, integers divisible by 16 unless excluded
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if (i,) not in constexprs and (isinstance(kwargs[name], torch.Tensor) or (
                 isinstance(kwargs[name], int) and kwargs[name] % 16 == 0 and i not in fn.do_not_specialize))}
    source = ASTSource(fn, signature, constexprs, attrs)
    if kernel == "gluon":
        from triton.experimental.gluon._runtime import GluonASTSource
        source = GluonASTSource(fn, signature, constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages,
                                       **({"maxnreg": MAXNREG} if MAXNREG else {})))


def hottest_loop(sass: str, without_exit: bool = False) -> list[str]:
    """The instructions of the largest loop: the widest span from a backward branch's target to the branch.
    without_exit: only spans that hold no EXIT (a Triton kernel's mbarrier retry loops sit after its exit and
    branch back into the middle of the kernel; their span would count the epilogue)."""
    addrs, body = [], []
    for ln in sass.splitlines():
        ins = re.match(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", ln)
        if ins:
            addrs.append(int(ins.group(1), 16))
            body.append(ins.group(2))
    best = (0, -1)
    for i, ins in enumerate(body):
        br = re.search(r"\bBRA\s+(?:`\()?0x([0-9a-f]+)", ins)
        if br:
            target = int(br.group(1), 16)
            if target <= addrs[i] and target in addrs:
                j = addrs.index(target)
                if i - j > best[1] - best[0] and not (without_exit and any(re.search(r"\bEXIT\b", b)
                                                                         for b in body[j:i])):
                    best = (j, i)
    return body[best[0]:best[1] + 1]


def mix(instrs: list[str]) -> dict[str, int]:
    out = collections.Counter()
    for ins in instrs:
        op = re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0]
        for name, pat in PIPES:
            if re.match(pat, op):
                out[name] += 1
                break
        else:
            out["other"] += 1
    out["total"] = len(instrs)
    return dict(out)


def ttgir_traffic(ttgir: str) -> list[str]:
    """The layout conversions and shared-memory moves of the kernel, with their tensor types."""
    keep = []
    for ln in ttgir.splitlines():
        if re.search(r"ttg\.(convert_layout|local_alloc|local_load|async_copy_global_to_local)|tt\.dot|"
                     r"warp_group_dot", ln):
            types = re.findall(r"tensor<([0-9x]+x[a-z0-9]+)", ln) or re.findall(r"memdesc<([0-9x]+x[a-z0-9]+)", ln)
            op = re.search(r"(ttg\.\w+|tt\.dot|ttng\.\w+)", ln).group(1)
            keep.append(f"{op:36s} {' -> '.join(types)}")
    return keep


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fmt", default="fp4,fp8")
    ap.add_argument("--group", type=int, default=8, help="query heads per KV head")
    ap.add_argument("--block-s", type=int, default=128)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--kernel", default="_packed_decode_kernel")
    ap.add_argument("--decode", default="word", help="NVFP4 code decode (kv_decode_attention.DECODERS; "
                    "for --kernel gluon: 'noprefetch' turns its prefetch off)")
    ap.add_argument("--splits", type=int, default=2, help="splits per (row, KV head); the Gluon kernel merges "
                    "them in the kernel (its epilogue is compiled for this count)")
    ap.add_argument("--dump", default="", help="write ttgir, ptx and sass here")
    a = ap.parse_args(argv)
    for fmt in a.fmt.split(","):
        k = compile_kernel(fmt, a.group, a.block_s, a.warps, a.stages, a.decode, kernel=a.kernel, splits=a.splits)
        sass = cuobjdump(k, "--dump-sass")
        loop = hottest_loop(sass)
        spills = len(re.findall(r"\b(?:STL|LDL)\b", sass))
        print(f"== {a.kernel} {fmt} decode {a.decode} group {a.group} block_s {a.block_s} warps {a.warps} stages {a.stages}: "
              f"regs {regs_of(k)}, spill insts {spills}, shared {k.metadata.shared} B")
        for ln in ttgir_traffic(k.asm["ttgir"]):
            print("   ", ln)
        print("    loop mix:", mix(loop))
        if a.dump:
            os.makedirs(a.dump, exist_ok=True)
            stem = os.path.join(a.dump, f"{a.kernel}_{fmt}_g{a.group}")
            for ext, text in (("ttgir", k.asm["ttgir"]), ("ptx", k.asm["ptx"]), ("sass", sass)):
                with open(f"{stem}.{ext}", "w") as f:
                    f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
