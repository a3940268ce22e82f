#!/usr/bin/env python3
"""Decode attention over the engine's KV cache on one GPU (H200): bf16 vs packed FP8 / NVFP4, in one run.

For every (heads, batch, context) it builds one random bf16 cache, quantizes it with the engine's codec into the
packed layouts (kernels/kv_layout.py), checks each kernel and tunable set on that fresh data against a float32
reference (SDPA over the bf16 / dequantized values; rel. error < 2e-2, else the config is not timed), then times:
  sdpa    torch SDPA (enable_gqa) over a bf16 cache [B, H_kv, S, D]   <- the baseline
  bf16    kernels/cache_attention.py over the engine's bf16 cache [slots, S, H_kv, D]
  fp8     kernels/kv_decode_attention.py over a packed FP8 cache (E4M3 + a row scale)
  nvfp4   kernels/kv_decode_attention.py over a packed NVFP4 cache (codes + E4M3 block scales + a row scale)
Each timed sample is a CUDA graph over several copies of the cache (enough to exceed the L2 several times over
when one copy is small; tools/bench_kernels.py graph_time_us), median per call. GB/s counts the KV bytes a call
must read (codes, scales, row scales of lens positions) over its time. `--configs all` times every tunable set
of `sweep` (block_s / num_warps / num_stages / splits per SM / inline-PTX decode) and reports the best and the
default. Targets (issue 27): NVFP4 >= 2x and FP8 >= 1.5x SDPA at context >= 4k.

  python tools/bench_attention.py --out results/attn [--configs all] [--shapes 16x4096,1x8192] [--heads 32/4]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_kernels as bk  # noqa: E402  (graph_time_us, copy_bandwidth_gbs, safe, rel_err)

SHAPES = [(1, 8192), (16, 4096), (64, 2048), (32, 8192), (128, 4096)]     # (batch, context)
HEADS = [(32, 4), (32, 8)]                                               # (query heads, KV heads)
HEAD_DIM = 128
TARGETS = {"nvfp4": 2.0, "fp8": 1.5}          # speedup over SDPA at context >= TARGET_CONTEXT
TARGET_CONTEXT = 4096
FORMATS = {"fp8": "fp8", "nvfp4": "fp4"}      # bench name -> KV cache format
MAX_COPIES = 64


def sweep(fmt: str, mode: str) -> list[dict]:
    """Tunable sets of packed_decode_attention; the first is the default (no arguments)."""
    default = [{}]
    if mode == "focus":     # 2026-12-06: the Gluon kernel's tunables (both formats); the Triton kernel for comparison
        # (gluon merges in the kernel up to 4 splits unless fm0 / fm1 say; mb changes the split count)
        tri = [dict(kernel="triton"), dict(kernel="triton", block_s=128, num_warps=4, programs_per_sm=3)]
        gl = [dict(kernel="gluon", fused_merge=False), dict(kernel="gluon", fused_merge=True),
              dict(kernel="gluon", min_blocks=4), dict(kernel="gluon", min_blocks=8)]
        if fmt != "nvfp4":
            return default + gl + tri
        return default + [dict(kernel="gluon", prefetch=2, fused_merge=False)] + gl + tri[1:]
    if mode != "all":
        return default
    tiles = [(32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 4, 2), (128, 8, 2), (128, 8, 3)]
    out = default + [dict(block_s=b, num_warps=w, num_stages=s, programs_per_sm=p)
                     for b, w, s in tiles for p in (2, 4, 8)]
    out += [dict(min_blocks=1), dict(min_blocks=4), dict(num_stages=1)]
    if fmt == "nvfp4":      # the code decoders (kv_decode_attention.DECODERS) on the two best tiles of 2026-12-02
        decoders = ("pair", "word", "word_early") if bk.DEV == "cuda" else ("bits",)    # inline PTX: GPU only
        out += [dict(decode=d, **t) for d in decoders
                for t in (dict(), dict(block_s=64, num_warps=4, num_stages=2, programs_per_sm=4))]
    return out


MODULE_KNOBS = {"merge_round": "MERGE_ROUND", "ring_masks": "RING_MASKS", "ring_stages": "RING_STAGES",
                "vector_stores": "VECTOR_STORES", "q_vector_loads": "Q_VECTOR_LOADS",
                "small_grid_min_tiles": "SMALL_GRID_MIN_TILES", "small_grid_round_down": "SMALL_GRID_ROUND_DOWN"}
# (config key -> kv_decode_gluon name)


def with_module_knobs(cfg: dict, fn):
    """fn() with kv_decode_gluon's module-level knobs set from cfg (MODULE_KNOBS: constexprs of the kernel that
    packed_decode_attention does not take; the timed graphs capture the launch, so they hold for the replays)."""
    from megatron_qrl.kernels import kv_decode_gluon as kg
    old = {name: getattr(kg, name) for key, name in MODULE_KNOBS.items() if key in cfg}
    try:
        for key, name in MODULE_KNOBS.items():
            if key in cfg:
                setattr(kg, name, type(old[name])(cfg[key]))
        return fn()
    finally:
        for name, value in old.items():
            setattr(kg, name, value)


def config_name(cfg: dict) -> str:
    if not cfg:
        return "default"
    short = {"block_s": "bs", "num_warps": "w", "num_stages": "s", "programs_per_sm": "pps", "min_blocks": "mb",
             "decode": "", "kernel": "", "prefetch": "pf", "fused_merge": "fm", "merge_round": "mr",
             "ring_masks": "rm", "ring_stages": "rs",
             "vector_stores": "vs", "q_vector_loads": "qv", "small_grid_min_tiles": "sgt",
             "small_grid_round_down": "sgd"}
    return "/".join(f"{short.get(k, k)}{v if isinstance(v, str) else int(v)}" for k, v in cfg.items())


def build_case(bsz: int, s: int, hq: int, hkv: int, d: int, gen: torch.Generator):
    """q, the bf16 caches (SDPA layout and the engine's) and the packed ones, from one random cache."""
    from megatron_qrl.kernels.kv_layout import PackedKV, encode_rows
    from megatron_qrl.quant.kv_rows import dequantize_kv_rows, quantize_kv_rows

    dev = bk.DEV
    q = torch.randn(bsz, hq, d, generator=gen).to(dev, torch.bfloat16)
    case = dict(q=q, slots=torch.arange(bsz, device=dev), lens=torch.full((bsz,), s, device=dev, dtype=torch.long))
    for name in ("k", "v"):
        x = (torch.randn(bsz, hkv, s, d, generator=gen) * (0.2 + torch.rand(bsz, hkv, s, 1, generator=gen))).to(
            dev, torch.bfloat16)
        case[f"{name}_sdpa"] = x                                    # [B, H_kv, S, D]
        case[f"{name}_engine"] = x.transpose(1, 2).contiguous()     # [slots, S, H_kv, D]
        for bench, fmt in FORMATS.items():
            rows = quantize_kv_rows(x, fmt)
            codes, scales = encode_rows(rows, fmt)
            case[f"{name}_{bench}"] = PackedKV(fmt, codes.contiguous(), scales, rows.row_scale.contiguous())
            case[f"{name}_{bench}_values"] = dequantize_kv_rows(rows)   # float32, for the reference
    return case


def sdpa(q, k, v, scale):
    return torch.nn.functional.scaled_dot_product_attention(q[:, :, None, :], k, v, scale=scale,
                                                            enable_gqa=True)[:, :, 0, :]


def kv_bytes(case, bench: str) -> int:
    """Bytes one call must read from the K and V caches (all positions are within lens here)."""
    if bench in ("sdpa", "bf16"):
        return 2 * case["k_sdpa"].numel() * 2
    k = case[f"k_{bench}"]
    return 2 * sum(t.numel() * t.element_size() for t in k.tensors())


def copies_for(nbytes: int, l2_bytes: float) -> int:
    """Cache copies per timed graph: one if a copy is well beyond the L2, else enough to exceed it 3x."""
    return max(1, min(MAX_COPIES, int(-(-3 * l2_bytes // max(nbytes, 1)))))


def bench_case(args, bsz, s, hq, hkv, l2_bytes, gen, log) -> dict:
    from megatron_qrl.kernels.cache_attention import cache_decode_attention
    from megatron_qrl.kernels.kv_decode_attention import packed_decode_attention

    d = HEAD_DIM if bk.DEV == "cuda" else args.smoke_head_dim
    case = build_case(bsz, s, hq, hkv, d, gen)
    q, slots, lens = case["q"], case["slots"], case["lens"]
    scale = d ** -0.5
    ref_bf16 = sdpa(q.float(), case["k_sdpa"].float(), case["v_sdpa"].float(), scale)
    row = dict(heads=f"{hq}/{hkv}", B=bsz, S=s, head_dim=d, results={})

    def timed(bench, make_call, err, cfg):
        nbytes = kv_bytes(case, bench)
        n = copies_for(nbytes, l2_bytes)
        res = dict(config=config_name(cfg), err=err, us=None)
        if err < 2e-2 and args.profile:     # one call of the first copy for ncu (--profile-from-start off)
            call = make_call(0)
            call()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            call()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            log(f"profiled {row['heads']} B={bsz} S={s} {bench} {res['config']}")
        elif err < 2e-2:
            calls = [make_call(i) for i in range(n)]
            if not row["results"].get(bench):     # the first config of a kernel: one untimed pass first (the
                bk.safe(log, "warm-up", lambda: bk.graph_time_us(calls, 10))   # first timing ran up to 12% slow)
            res["us"] = bk.safe(log, f"time {bench} {res['config']}", lambda: bk.graph_time_us(calls, args.rep_ms))
            if res["us"]:
                res["gbs"] = nbytes / (res["us"] * 1e-6) / 1e9
        row["results"].setdefault(bench, []).append(res)
        return res

    # baseline and the bf16-cache kernel (copies of the bf16 caches)
    sd = [(case["k_sdpa"], case["v_sdpa"])]
    n_bf16 = copies_for(kv_bytes(case, "sdpa"), l2_bytes)
    sd += [(case["k_sdpa"].clone(), case["v_sdpa"].clone()) for _ in range(n_bf16 - 1)]
    e = bk.safe(log, "sdpa", lambda: bk.rel_err(sdpa(q, *sd[0], scale), ref_bf16), float("inf"))
    timed("sdpa", lambda i: (lambda kv=sd[i]: sdpa(q, kv[0], kv[1], scale)), e, {})
    sd = None
    en = [(case["k_engine"], case["v_engine"])]
    en += [(case["k_engine"].clone(), case["v_engine"].clone()) for _ in range(n_bf16 - 1)]
    e = bk.safe(log, "bf16 kernel", lambda: bk.rel_err(cache_decode_attention(q, *en[0], slots, lens, scale),
                                                       ref_bf16), float("inf"))
    timed("bf16", lambda i: (lambda kv=en[i]: cache_decode_attention(q, kv[0], kv[1], slots, lens, scale)), e, {})
    en = None
    for bench in FORMATS:
        if bench not in args.formats:
            continue
        ref = sdpa(q.float(), case[f"k_{bench}_values"], case[f"v_{bench}_values"], scale)
        n = copies_for(kv_bytes(case, bench), l2_bytes)
        kvs = [(case[f"k_{bench}"], case[f"v_{bench}"])] + [(case[f"k_{bench}"].clone(), case[f"v_{bench}"].clone())
                                                           for _ in range(n - 1)]
        mode = args.configs if time.time() < args.deadline else "default"      # past --time-budget: defaults
        listed = args.fp8_configs if bench == "fp8" else args.configs_json
        for cfg in (listed if listed is not None else sweep(bench, mode)):
            def call(kv, cfg=cfg):
                return with_module_knobs(cfg, lambda: packed_decode_attention(
                    q, kv[0], kv[1], slots, lens, scale, **{k: v for k, v in cfg.items() if k not in MODULE_KNOBS}))
            e = bk.safe(log, f"{bench} {config_name(cfg)}", lambda: bk.rel_err(call(kvs[0]), ref), float("inf"))
            timed(bench, lambda i, call=call: (lambda: call(kvs[i])), e, cfg)
        kvs = None
    case = None
    base = row["results"]["sdpa"][0].get("us")
    for bench, results in row["results"].items():
        ok = [r for r in results if r.get("us")]
        row[bench] = dict(default=results[0], best=min(ok, key=lambda r: r["us"]) if ok else None)
        for k in ("default", "best"):
            r = row[bench][k]
            if r and r.get("us") and base:
                r["speedup"] = base / r["us"]
    log(f"{row['heads']} B={bsz} S={s}: " + "  ".join(
        f"{b} {row[b]['best']['us']:.1f}us" if row[b]["best"] else f"{b} FAILED" for b in row["results"]), row)
    if bk.DEV == "cuda":
        torch.cuda.empty_cache()
    return row


def markdown(env, rows) -> str:
    def cell(r, speed=True):
        if not r or not r.get("us"):
            return "FAILED"
        sp = f" ({r['speedup']:.2f}x)" if speed and r.get("speedup") else ""
        return f"{r['us']:.1f}{sp}"

    lines = [f"Machine: {env['gpu']} ({env['sms']} SMs, L2 {env['l2_mb']:.0f} MB); torch {env['torch']}, triton "
             f"{env['triton']}, CUDA {env['cuda']}; {env['date']}; `{' '.join(env['argv'])}`. Copy bandwidth "
             f"(read+write): {env['copy_gbs']:.0f} GB/s. Times in us (speedup vs SDPA); GB/s = KV bytes read / time.",
             "", "| heads q/kv | B | context | SDPA bf16 | bf16 kernel | FP8 default | FP8 best | FP8 GB/s | "
             "NVFP4 default | NVFP4 best | NVFP4 GB/s | SDPA GB/s | rel. err fp8 / nvfp4 | best configs fp8 / nvfp4 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        def get(bench, which):
            return (r.get(bench) or {}).get(which)

        def gbs(bench):
            b = get(bench, "best")
            return f"{b['gbs']:.0f}" if b and b.get("gbs") else "-"

        def err(bench):
            b = get(bench, "default")
            return f"{b['err']:.1e}" if b else "-"
        lines.append(f"| {r['heads']} | {r['B']} | {r['S']} | {cell(get('sdpa', 'best'), False)} | "
                     f"{cell(get('bf16', 'best'))} | {cell(get('fp8', 'default'))} | {cell(get('fp8', 'best'))} | "
                     f"{gbs('fp8')} | {cell(get('nvfp4', 'default'))} | {cell(get('nvfp4', 'best'))} | {gbs('nvfp4')} | "
                     f"{gbs('sdpa')} | {err('fp8')} / {err('nvfp4')} | "
                     f"{(get('fp8', 'best') or {}).get('config', '-')} / {(get('nvfp4', 'best') or {}).get('config', '-')} |")
    met = []
    for bench, target in TARGETS.items():
        long = [r for r in rows if r["S"] >= TARGET_CONTEXT and get_best(r, bench)]
        if long:
            worst = min(get_best(r, bench)["speedup"] for r in long)
            met.append(f"{bench}: worst speedup at context >= {TARGET_CONTEXT} {worst:.2f}x (target {target}x) "
                       f"{'MET' if worst >= target else 'NOT MET'}")
    return "\n".join(lines + ([""] + met if met else []))


def get_best(row, bench):
    b = (row.get(bench) or {}).get("best")
    return b if b and b.get("speedup") else None


def parse_configs(text: str) -> list[dict]:
    """'default:prefetch=3,min_blocks=2' -> [{}, {'prefetch': 3, 'min_blocks': 2}] (integers where they parse)."""
    out = []
    for item in text.split(":"):
        cfg = {}
        for kv in ([] if item in ("", "default") else item.split(",")):
            key, _, val = kv.partition("=")
            cfg[key] = int(val) if val.lstrip("-").isdigit() else val
        out.append(cfg)
    return out


def parse_pairs(text: str, sep: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in item.split(sep)) for item in text.split(",") if item]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shapes", type=lambda t: parse_pairs(t, "x"), default=SHAPES, help="BxS,... (batch x context)")
    ap.add_argument("--heads", type=lambda t: parse_pairs(t, "/"), default=HEADS, help="HQ/HKV,...")
    ap.add_argument("--formats", type=lambda t: t.split(","), default=list(FORMATS))
    ap.add_argument("--configs", choices=["default", "focus", "all"], default="default")
    ap.add_argument("--rep-ms", type=int, default=60)
    ap.add_argument("--time-budget", type=float, default=0, help="seconds; past it, the remaining cases time only "
                    "the default config (0: no limit)")
    ap.add_argument("--nvfp4-configs", type=parse_configs, default=None, dest="configs_json",
                    help="NVFP4 tunable sets instead of --configs' sweep, ':'-separated, e.g. "
                    "default:prefetch=3:prefetch=3,min_blocks=2 (no shell quoting needed; merge_round=N, "
                    "ring_masks=0|1, ring_stages=N, vector_stores=0|1 set kv_decode_gluon's MERGE_ROUND, RING_MASKS, "
                    "RING_STAGES, VECTOR_STORES)")
    ap.add_argument("--fp8-configs", type=parse_configs, default=None, help="the same for FP8")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="no timing: one call of each config between "
                    "cudaProfilerStart/Stop, for `ncu --profile-from-start off` (tools/gpu_kv_attention.sh NCU=1)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU interpreter (tests this script)")
    ap.add_argument("--smoke-head-dim", type=int, default=32, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"          # before the kernels are imported
        bk.DEV = "cpu"
        args.shapes, args.heads = [(2, 40)], [(8, 2)]
        args.configs = "default" if args.configs == "default" else "all"
    elif args.profile and not torch.cuda.is_available():
        sys.exit("--profile needs a CUDA GPU (it is for ncu)")
    elif not torch.cuda.is_available():
        sys.exit("bench_attention.py needs a CUDA GPU (or --cpu-smoke)")
    args.out.mkdir(parents=True, exist_ok=True)
    if bk.DEV == "cuda":
        props = torch.cuda.get_device_properties(0)
        gpu, sms, l2 = props.name, props.multi_processor_count, float(getattr(props, "L2_cache_size", 0) or 60e6)
    else:
        gpu, sms, l2 = "cpu (interpreter smoke test)", 0, 0.0
    env = bk.machine_env(gpu, sms, l2 / 1e6, sys.argv[1:] if argv is None else argv)
    log = bk.jsonl_logger(args.out / "bench_attention.jsonl")

    t0 = time.time()
    args.deadline = t0 + args.time_budget if args.time_budget > 0 else float("inf")
    env["copy_gbs"] = bk.copy_bandwidth_gbs()
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    for hq, hkv in args.heads:
        for bsz, s in args.shapes:
            r = bk.safe(log, f"case {hq}/{hkv} B={bsz} S={s}", lambda: bench_case(args, bsz, s, hq, hkv, l2, gen, log))
            if r:
                rows.append(r)
                write_report(args.out, env, rows, t0)       # after every case: a killed run keeps its table
    print(write_report(args.out, env, rows, t0), flush=True)
    return 0


def write_report(out: Path, env: dict, rows: list, t0: float) -> str:
    env["seconds"] = time.time() - t0
    md = markdown(env, rows)
    (out / "bench_attention.md").write_text(md + "\n")
    (out / "bench_attention.json").write_text(json.dumps(dict(env=env, targets=TARGETS, rows=rows), indent=1,
                                                         default=str))
    return md


if __name__ == "__main__":
    sys.exit(main())
