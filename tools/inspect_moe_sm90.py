"""Compile the grouped MoE W4A16 kernels for sm_90a without a GPU: the Gluon kernel (kernels/moe_gluon.py) and the
Triton `_moe_gemm_kernel` at its heuristic config, and compare what ptxas made of them.

Prints per kernel and projection: registers, spills, shared memory, the TTGIR layout traffic, the SASS
instruction mix of the hot loop (tools/inspect_attention_sm90.py's pipes), and that loop's instructions per
16-byte code vector (one weight row, one 32-element packing group: the unit both kernels stream). Why: device
time is short; a variant that spills or issues more per weight byte is known before a GPU call.

Needs Triton 3.6 in the running Python (tools/compile_gluon_sm90.py says how):
    PYTHONPATH=$PWD /tmp/t36/bin/python tools/inspect_moe_sm90.py [--block-m 16,32] [--rows 32,64] [--dump DIR]
"""
from __future__ import annotations

import argparse
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compile_gluon_sm90 import cuobjdump, regs_of, wgmma_verdict  # noqa: E402
from inspect_attention_sm90 import hottest_loop, mix, ttgir_traffic  # noqa: E402

E, H, F, TOP_K = 128, 2048, 768, 8


def _weights(gated: bool):
    from megatron_qrl.kernels.layouts import PreparedFP4Weight
    n, k = (2 * F, H) if gated else (H, F)
    return PreparedFP4Weight(torch.zeros((E, n, k // 2), dtype=torch.uint8), torch.zeros((E, n, k // 16),
                             dtype=torch.uint8), torch.ones(E), "nvfp4", n, k, E)


def _compile(fn, kwargs: dict, options: dict, gluon: bool):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type

    constexprs = {(i,): kwargs[name] for i, name in enumerate(fn.arg_names) if fn.params[i].is_constexpr}
    signature = {name: "constexpr" if (i,) in constexprs else mangle_type(kwargs[name])
                 for i, name in enumerate(fn.arg_names)}
    # what the JIT specializes at launch: tensors 16-byte aligned, integers divisible by 16 unless excluded
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if (i,) not in constexprs and (isinstance(kwargs[name], torch.Tensor) or (
                 isinstance(kwargs[name], int) and not isinstance(kwargs[name], bool)
                 and kwargs[name] % 16 == 0 and i not in fn.do_not_specialize))}
    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource
        source = GluonASTSource(fn, signature, constexprs, attrs)
    else:
        source = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def compile_gluon(gated: bool, block_m: int, rows: int, stages: int, x_pre: bool, warps: int = 1):
    import megatron_qrl.kernels.moe_gluon as g
    w = _weights(gated)
    nb = 64
    x = torch.zeros((nb * block_m, w.k), dtype=torch.float16 if x_pre or not gated else torch.bfloat16)
    f = w.n // 2 if gated else w.n
    y = torch.zeros((nb * block_m, f), dtype=torch.float16 if gated and x_pre else torch.bfloat16)
    ids = torch.zeros(nb * block_m, dtype=torch.int32)
    kw = g.kernel_args(x, w, y, ids, ids[:nb], None if gated else torch.zeros(1024), 1024, TOP_K, block_m, gated,
                       rows, stages, warps)
    return _compile(g._moe_gluon_kernel, kw, dict(num_warps=warps), True)


def compile_triton(gated: bool, block_m: int, x_pre: bool, tiles: str = "", sync_dots: bool = False,
                   packed_scales: bool = True, unroll: int = 1, tile: str = ""):
    """_moe_gemm_kernel with the arguments _launch gives it at heuristic_moe_config (block_m forced; tiles
    "BNxBKwWsS", e.g. 64x128w4s3, replaces the heuristic's weight tile, warps and stages; tile "ROWSxK", e.g.
    64x128: over layouts.tile_major_experts stacks of that tile, the heuristic's config for them)."""
    from dataclasses import replace

    import megatron_qrl.kernels.moe_grouped_gemm as m
    from megatron_qrl.kernels.w4a16_gemm import FP16_ACC_FACTOR, weight_descriptor
    w = _weights(gated)
    n = w.n // 2 if gated else w.n
    stack_tile = tuple(int(v) for v in tile.split("x")) if tile else None
    cfg = replace(m.heuristic_moe_config(E * block_m, E, n, w.k, gated, "nvfp4", gemv=False, tile=stack_tile),
                  block_m=block_m)
    if tiles:
        bn, bk, warps, stages = (int(v) for v in re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)", tiles).groups())
        cfg = replace(cfg, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
    cfg = replace(cfg, sync_dots=sync_dots, packed_scales=packed_scales, unroll=unroll)
    if stack_tile:
        from megatron_qrl.kernels.layouts import tile_major_experts
        w = tile_major_experts(w, *stack_tile)
    nb = 64
    x = torch.zeros((nb * block_m, w.k), dtype=torch.float16 if x_pre or not gated else torch.bfloat16)
    y = torch.zeros((nb * block_m, n), dtype=torch.float16 if gated and x_pre else torch.bfloat16)
    ids = torch.zeros(nb * block_m, dtype=torch.int32)
    if cfg.tma and stack_tile:      # as _launch: whole row tiles per box
        tn = stack_tile[0]
        q = weight_descriptor(w.qweight.view(E, w.n // tn, -1, cfg.block_k // 2),
                              [1, cfg.block_n // tn, tn, cfg.block_k // 2])
    else:
        q = weight_descriptor(w.qweight, [1, cfg.block_n, cfg.block_k // 2]) if cfg.tma else w.qweight
    names = m._moe_gemm_kernel.arg_names
    vals = [x, q, w.scales, w.global_scale, y, ids, ids[:nb], w.global_scale if gated else torch.zeros(1024),
            n, w.k, 1024, w.qweight.stride(0), w.qweight.stride(1), w.scales.stride(0), w.scales.stride(1),
            x.stride(0), y.stride(0), FP16_ACC_FACTOR, TOP_K, gated, False, True, block_m, cfg.block_n,
            cfg.block_k, False, cfg.asm, x.dtype == torch.float16, y.dtype == torch.float16, cfg.tma, cfg.sync_dots,
            cfg.packed_scales, cfg.unroll, stack_tile[0] if stack_tile else 0]
    kw = dict(zip(names, vals))
    return cfg, _compile(m._moe_gemm_kernel, kw, dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages), False)


def k_loop(sass: str) -> list:
    """The instructions of the K loop (the Triton kernel's mbarrier retry loops excluded: see hottest_loop)."""
    return hottest_loop(sass, without_exit=True)


def report(name: str, kernel, code_vectors_per_trip: int, warps: int, dump: str) -> dict:
    """Print the kernel's resources and hot-loop mix; code_vectors_per_trip: 16-byte code vectors (row x group)
    one trip of the loop consumes over the whole program (warps: its warps, each issuing the loop)."""
    sass = cuobjdump(kernel, "--dump-sass")
    loop = k_loop(sass)
    spills = len(re.findall(r"\b(?:STL|LDL)\b", sass))
    m = mix(loop)
    per_vec = m["total"] * warps / code_vectors_per_trip
    print(f"== {name}: regs {regs_of(kernel)}, spill insts {spills}, shared {kernel.metadata.shared} B; hot loop "
          f"{m['total']} SASS x {warps} warps per {code_vectors_per_trip} code vectors = {per_vec:.2f} warp "
          f"instructions per 16-byte code vector ({per_vec / 16:.3f} per weight byte); wgmma: {wgmma_verdict(kernel)}")
    for ln in ttgir_traffic(kernel.asm["ttgir"]):
        print("   ", ln)
    print("    loop mix:", m)
    if dump:
        os.makedirs(dump, exist_ok=True)
        stem = os.path.join(dump, re.sub(r"[^A-Za-z0-9_.-]+", "_", name))
        for ext, text in (("ttgir", kernel.asm["ttgir"]), ("ptx", kernel.asm["ptx"]), ("sass", sass)):
            with open(f"{stem}.{ext}", "w") as f:
                f.write(text)
    return dict(per_vec=per_vec, spills=spills)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block-m", default="16,32")
    ap.add_argument("--rows", default="", help="Gluon weight rows per warp (default: moe_gluon's per projection)")
    ap.add_argument("--warps", default="1", help="Gluon warps per program (sharing one x tile), e.g. 1,2,4")
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--proj", default="gated,down")
    ap.add_argument("--bf16-x", action="store_true", help="gate/up on bf16 x (converted in the kernel)")
    ap.add_argument("--no-triton", action="store_true")
    ap.add_argument("--triton-tiles", default="", help="Triton configs to compile instead of the heuristic's, "
                    "comma-separated BNxBKwWsS (e.g. 64x128w4s3,128x128w8s3)")
    ap.add_argument("--sync-dots", default="heuristic", choices=["heuristic", "on", "off"],
                    help="the Triton kernel with its dots waiting for the MMAs in flight (MoEConfig.sync_dots: no "
                    "wgmma serialization by ptxas), or not; heuristic: as moe_grouped_gemm.SYNC_DOTS says")
    ap.add_argument("--byte-scales", action="store_true", help="the Triton kernel decoding its NVFP4 scales byte by "
                    "byte (MoEConfig.packed_scales=False, before 2026-12-07)")
    ap.add_argument("--unroll", type=int, default=1, help="the Triton kernel's K steps per loop trip "
                    "(MoEConfig.unroll)")
    ap.add_argument("--tile", default="", help="the Triton kernel over tile-major expert stacks of this tile, "
                    "ROWSxK (e.g. 64x128; MoEConfig.tile_major: each trip's weight tile whole contiguous runs)")
    ap.add_argument("--no-gluon", action="store_true")
    ap.add_argument("--dump", default="")
    a = ap.parse_args(argv)
    import megatron_qrl.kernels.moe_gluon as g
    import megatron_qrl.kernels.moe_grouped_gemm as m
    x_pre = not a.bf16_x
    for proj in a.proj.split(","):
        gated = proj == "gated"
        for bm in (int(v) for v in a.block_m.split(",")):
            for tiles in ([] if a.no_triton else a.triton_tiles.split(",") if a.triton_tiles else [""]):
                sync = m.SYNC_DOTS['gate_up' if gated else 'down'] if a.sync_dots == 'heuristic' else a.sync_dots == 'on'
                cfg, k = compile_triton(gated, bm, x_pre, tiles, sync, not a.byte_scales, a.unroll, a.tile)
                # one trip: block_n rows (x 2 gated) x block_k / 32 groups, unroll K steps
                name = (f"triton {proj} bm{bm} bn{cfg.block_n} bk{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"
                        f"{' tma' if cfg.tma else ''}{' sync-dots' if cfg.sync_dots else ''}"
                        f"{'' if cfg.packed_scales else ' byte-scales'}"
                        f"{f' unroll{cfg.unroll}' if cfg.unroll > 1 else ''}"
                        f"{f' tile-major {a.tile}' if cfg.tile_major else ''}")
                report(name, k, cfg.block_n * (2 if gated else 1) * cfg.block_k // 32 * cfg.unroll, cfg.num_warps,
                       a.dump)
            if a.no_gluon:
                continue
            rows_list = [int(v) for v in a.rows.split(",")] if a.rows else [g.default_rows(gated, bm)]
            for rows in rows_list:
                for warps in (int(v) for v in a.warps.split(",")):
                    k = compile_gluon(gated, bm, rows * warps, a.stages, x_pre, warps)
                    report(f"gluon {proj} bm{bm} rows{rows}x{warps}w s{a.stages}", k,
                           rows * warps * (2 if gated else 1) * 4, warps, a.dump)
    return 0


if __name__ == "__main__":
    sys.exit(main())
