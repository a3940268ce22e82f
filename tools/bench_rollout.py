"""Rollout decode throughput of the embedded engine: FP4 vs BF16 graph decode, the eager engine, HF generate.

    python tools/bench_rollout.py [--layers 4,48] [--batches 1,16,64,256] [--prompt-len 64] [--new-tokens 64]
        [--reps 3] [--engines fp4,bf16,hf] [--overheads 64] [--check 16] [--json F] [--tiny]
        [--targets routed_experts|all_linears]

One process. A Qwen3-30B-A3B-shaped model cut to --layers layers (hidden 2048, 128 experts top-8, expert FFN
768, 32 query / 4 KV heads of dim 128, vocab 151936; --tiny: a CPU-sized model for the smoke test). Random
weights: every linear normal(0, 0.02) from (seed, name) (tools/seeded_weights.py), the rest the model's own
seeded init, installed through the normal weight sync (codec + digests), the same in every engine; engines are
built one at a time, and an FP4 engine holds its linears only in FP4, so 48 layers fit on one 80 GB GPU. Engines (--engines):
    fp4        rollout.weights=nvfp4, scheme w4a16, rollout.decode=graphs (CUDA graphs of the static step,
               grouped W4A16 expert kernels)
    bf16       rollout.weights=bf16, decode=graphs (torch._grouped_mm experts)
    fp4-eager  the eager engine (Megatron forward per step) on the same FP4 kernels: the "before"
    fp4-kv4    fp4 with rollout.kv_cache=fp4: a packed NVFP4 KV cache (kernels/kv_layout.py), written by the
               quantize-write kernel and read by the packed decode-attention kernel in the graphs
    fp4-kv8    the same with a packed FP8 KV cache (use a long --prompt-len, e.g. 4096, to see the KV reads)
    fp4-lora   QeRL mode (lora.enabled, rank 16 on every linear, NVFP4 base) on the graph path
               (rollout/decode_lora.py); fp4-lora-eager: the same model on the eager engine
    hf         transformers Qwen3MoeForCausalLM.generate() (sdpa, eager) on the bf16 weights (<= 8 layers)
Decode tokens/s excludes prefill: a generate() of N new tokens minus a generate() of 1 new token for the same
prompts, i.e. (N - 1) * B tokens over the time difference; medians of --reps timed pairs after a warm-up
pair (which also captures the graphs). Greedy, no stop token, log-probs on. The HBM floor of a step is the
weight bytes it must read (attention, router, the experts top-k touches in expectation under uniform routing,
LM head) plus the KV cache read at the mean context, over --hbm-tbs TB/s.
--overheads B: at batch B, W4A4 with TRACE capture of every layer + R3 against W4A4 without, and sampling
(temperature 1) against greedy (fp4), each as generate() rates and as captured decode steps (CUDA events).
--check B: at batch B, each graph engine against the eager engine of the same scheme (identical sequences,
matching greedy prefix, max |log-prob difference| on the prefix; W4A4 with TRACE: capture bytes agreeing on the
prefix rows). --targets all_linears: the FP4 engines quantize the
attention linears (qkv, proj) too, as configs/evidence/gpu_base.yaml does (default: routed experts only).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from seeded_weights import sync_seeded  # noqa: E402

QWEN3_30B_SHAPE = dict(hidden_size=2048, num_attention_heads=32, num_query_groups=4, kv_channels=128,
                       ffn_hidden_size=6144, num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768,
                       vocab_size=151936, qk_layernorm=True, rotary_base=1000000, norm_epsilon=1e-6,
                       untie_embeddings_and_output_weights=True, moe_aux_loss_coeff=0.0)
TINY_SHAPE = dict(hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16, ffn_hidden_size=128,
                  num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32, vocab_size=128, qk_layernorm=True,
                  rotary_base=10000, norm_epsilon=1e-6, untie_embeddings_and_output_weights=True,
                  moe_aux_loss_coeff=0.0)
# engine name -> (rollout.weights, rollout.scheme, rollout.decode, TRACE)
ENGINES = {"fp4": ("nvfp4", "w4a16", "graphs", False), "bf16": ("bf16", "w4a16", "graphs", False),
           "fp4-eager": ("nvfp4", "w4a16", "eager", False), "bf16-eager": ("bf16", "w4a16", "eager", False),
           "w4a4": ("nvfp4", "w4a4", "graphs", False), "w4a4-trace": ("nvfp4", "w4a4", "graphs", True),
           "w4a4-trace-eager": ("nvfp4", "w4a4", "eager", True), "fp4-kv4": ("nvfp4", "w4a16", "graphs", False),
           "fp4-kv8": ("nvfp4", "w4a16", "graphs", False), "fp4-lora": ("nvfp4", "w4a16", "graphs", False),
           "fp4-lora-eager": ("nvfp4", "w4a16", "eager", False)}
LORA_ENGINES = {"fp4-lora", "fp4-lora-eager"}       # QeRL mode: rank-16 adapters on every linear, NVFP4 base
KV_CACHE = {"fp4-kv4": "fp4", "fp4-kv8": "fp8"}     # rollout.kv_cache of an engine (default bf16)
HF_MAX_LAYERS = 8


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="CPU smoke size (2 layers, hidden 64, 8 experts)")
    p.add_argument("--layers", default=None, help="comma list of layer counts")
    p.add_argument("--batches", default=None)
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--new-tokens", type=int, default=None)
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--engines", default="fp4,bf16,hf")
    p.add_argument("--eager-batches", default="1,16", help="batches for the eager engines (slow at large B)")
    p.add_argument("--overheads", type=int, default=0, help="batch for the TRACE and sampling overheads (0: off)")
    p.add_argument("--check", type=int, default=0, help="batch for the graph-vs-eager checks (0: off)")
    p.add_argument("--profile", default="", help="batches whose captured fp4/bf16 step is profiled per kernel")
    p.add_argument("--hbm-tbs", type=float, default=4.0, help="bandwidth of the HBM floor (TB/s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--moe-kernel", choices=["default", "gluon", "triton"], default="default",
                   help="the grouped expert kernel for NVFP4 blocks of 16/32 rows (moe_grouped_gemm.GLUON_DEFAULT)")
    p.add_argument("--moe-tokens-per-expert", type=float, default=0.0,
                   help="experiment: the grouped-expert tile heuristic sees this many assignments per expert "
                        "instead of the batch's average (0: off), i.e. forces a larger tile class")
    p.add_argument("--moe-block32-from", type=float, default=0.0,
                   help="experiment: 32-row expert blocks with narrow K steps (up to 48 per expert) "
                        "above this many assignments per expert (BLOCK16_MAX_PER_EXPERT; 0: the defaults)")
    p.add_argument("--moe-sync-dots", choices=["off", "gate_up", "both"], default=None,
                   help="experiment: the projections whose grouped expert kernel waits for the MMAs in flight "
                        "(moe_grouped_gemm.SYNC_DOTS; default: the module's, gate_up)")
    p.add_argument("--moe-persistent", type=int, default=None,
                   help="experiment: persistent programs per SM of the 16-row gate/up expert kernel "
                        "(moe_grouped_gemm.PERSISTENT_GATE_UP_BLOCK16; 0: one program per tile, the default)")
    p.add_argument("--moe-tile-major", default=None, metavar="ROWSxK",
                   help="experiment: the engine's expert stacks tile-major with this tile, e.g. 64x128 "
                        "(moe_grouped_gemm.EXPERT_STACK_TILE; each loop trip's weight tile whole contiguous runs; "
                        "no GEMV over them; default: row-major)")
    p.add_argument("--targets", default="routed_experts", choices=["routed_experts", "all_linears"],
                   help="quant.targets of the engines (all_linears: FP4 attention linears too)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    d = dict(layers="2", batches="1,4", prompt_len=8, new_tokens=4, reps=1) if a.tiny else \
        dict(layers="4", batches="1,16,64,256", prompt_len=64, new_tokens=64, reps=3)
    for k, v in d.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.layers = [int(x) for x in str(a.layers).split(",") if x]
    a.batches = [int(b) for b in str(a.batches).split(",") if b]
    a.eager_batches = [int(b) for b in str(a.eager_batches).split(",") if b]
    a.profile = [int(b) for b in str(a.profile).split(",") if b]
    a.engines = [s.strip() for s in a.engines.split(",") if s.strip()]
    bad = [s for s in a.engines if s not in ENGINES and s != "hf"]
    if bad:
        raise SystemExit(f"unknown engine(s) {bad}; use hf or one of {sorted(ENGINES)}")
    if a.new_tokens < 2:
        raise SystemExit("--new-tokens must be >= 2 (decode time = N tokens minus the 1-token prefill run)")
    return a


def make_cfg(a, layers: int, engine: str, max_batch: int):
    from megatron_qrl.config import QRLConfig

    weights, scheme, decode, trace = ENGINES[engine]
    shape = dict(TINY_SHAPE if a.tiny else QWEN3_30B_SHAPE)
    model = dict(shape, num_layers=layers, max_sequence_length=a.prompt_len + a.new_tokens,
                 init_method_std=0.1 if a.tiny else 0.02)
    if a.tiny:
        decode = "static" if decode == "graphs" else decode
    return QRLConfig.model_validate({
        "model": model, "quant": {"format": "nvfp4", "targets": a.targets, "scheme": "w4a4"},
        "trainer": {"bf16": not a.tiny, "seed": a.seed}, "aqn": {"enabled": False},
        "trace": {"enabled": trace, "num_cached_layers": layers},
        "rollout": {"weights": weights, "scheme": scheme, "decode": decode, "max_batch_size": max_batch,
                    "max_new_tokens": a.new_tokens, "kv_cache": KV_CACHE.get(engine, "bf16")},
        "lora": {"enabled": engine in LORA_ENGINES, "rank": 16, "alpha": 32, "base_format": "nvfp4"}})


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build_engine(a, layers: int, engine: str, max_batch: int):
    """An EmbeddedEngine with its own random weights (seeded), installed through its own weight sync."""
    from megatron_qrl.platform.distributed import seed_everything
    from megatron_qrl.rollout.embedded import EmbeddedEngine

    seed_everything(a.seed)               # every engine initialises the same weights
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()   # the peak of this build (the engines before it are freed)
    eng = EmbeddedEngine(make_cfg(a, layers, engine, max_batch), kernels="on" if a.tiny else None)
    if engine in LORA_ENGINES:
        nonzero_adapters(eng.model, a.seed)
    t0 = time.perf_counter()
    sync_seeded(eng, a.seed)              # the FP4 kernels' weights have no dense copy to sync from
    _sync()
    mem = ""
    if eng.device.type == "cuda":
        mem = (f", GPU memory {torch.cuda.memory_allocated() / 2**30:.1f} GiB "
               f"(peak {torch.cuda.max_memory_allocated() / 2**30:.1f})")
    print(f"[bench] {layers} layers {engine}: built, weight sync {time.perf_counter() - t0:.1f} s, "
          f"decode={eng.decode_mode}, kernels={eng.kernels is not None}, packed-only weights "
          f"{len(eng.store.packed_only)}{mem}", file=sys.stderr, flush=True)
    return eng


def nonzero_adapters(model, seed: int) -> None:
    """B = 0 at init hides the adapters: the same seeded non-zero B in every LoRA engine (checks see them)."""
    import torch

    from megatron_qrl.models.lora import lora_linears

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for lin in lora_linears(model):
            if lin.lora_rank:
                lin.lora_B.copy_(torch.randn(lin.lora_B.shape, generator=g) * 0.02)


def free(*objs):
    import torch

    for o in objs:
        del o
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def time_engine(engine, prompts, n_new, temperature=0.0):
    from megatron_qrl.rollout.protocol import SamplingParams

    sp = SamplingParams(temperature=temperature, max_new_tokens=n_new, seed=0)
    _sync()
    t0 = time.perf_counter()
    out = engine.generate(prompts, sp)
    # the loop seals the engine's TRACE records every step, which drops them; a timed call does the same
    # (inside the timing), else the records of every call pile up and each call's captures land in fresh
    # host memory (what made TRACE cost +71% per call here before 2026-12-02 05:30 UTC)
    if getattr(engine, "trace_recorder", None) is not None:
        engine.trace_recorder.clear()
    _sync()
    return time.perf_counter() - t0, out


def hf_model(cfg, source, device, dtype):
    """Qwen3MoeForCausalLM with the source model's weights (the project's Megatron->HF tensor rules)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from megatron_qrl.convert import qwen3_moe

    m = cfg.model
    hcfg = qwen3_moe.hf_config_from_model(m, "bfloat16" if dtype == torch.bfloat16 else "float32")
    hcfg.pop("torch_dtype", None)
    config = Qwen3MoeConfig(**{k: v for k, v in hcfg.items() if k not in ("architectures", "model_type")})
    config._attn_implementation = "sdpa"
    params = dict(source.named_parameters())
    tensors = {}
    for rule in qwen3_moe.tensor_rules(m):
        for name, t in zip(rule.hf, qwen3_moe.split(rule, params[rule.mcore].detach(), m)):
            tensors[name] = t
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3MoeForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    state = model.state_dict()
    fused = {}
    for name in state:
        if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            pre = name.rsplit(".", 1)[0] + "."
            if name.endswith("gate_up_proj"):   # [E, 2F, H], gate rows first (as Megatron's fc1)
                fused[name] = torch.stack([torch.cat([tensors.pop(f"{pre}{e}.gate_proj.weight"),
                                                      tensors.pop(f"{pre}{e}.up_proj.weight")])
                                           for e in range(m.num_experts)])
            else:
                fused[name] = torch.stack([tensors.pop(f"{pre}{e}.down_proj.weight") for e in range(m.num_experts)])
    tensors.update(fused)
    missing, extra = set(state) - set(tensors), set(tensors) - set(state)
    if missing or extra:
        raise RuntimeError(f"HF weight mapping incomplete: missing {sorted(missing)[:4]}, extra {sorted(extra)[:4]}")
    model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}, strict=True)
    model.eval()
    return model


def time_hf(model, prompts, n_new):
    import torch

    ids = torch.tensor(prompts, device=next(model.parameters()).device)
    _sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                             min_new_tokens=n_new, do_sample=False, use_cache=True, pad_token_id=0,
                             eos_token_id=None)
    _sync()
    return time.perf_counter() - t0, out[:, ids.shape[1]:].tolist()


def routing_stats(engine, prompts, a) -> dict:
    """How the decode steps of one generate call routed (R3 ids): per step and MoE layer, the distinct experts
    the batch touched and the heaviest expert's rows, averaged; `touched_vs_uniform` compares the touched count
    with what uniform routing touches (the HBM floor's assumption; the 48-layer random-weight model routes
    uniformly, docs/PERF.md 2026-12-02 third session)."""
    import torch

    from megatron_qrl.rollout.protocol import SamplingParams

    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=a.new_tokens, seed=0))
    if getattr(engine, "trace_recorder", None) is not None:
        engine.trace_recorder.clear()
    if out[0].routed_experts is None:
        return {}
    p = a.prompt_len
    steps = min(len(o.tokens) for o in out) - 1
    if steps < 1:
        return {}
    ids = torch.stack([o.routed_experts[p:p + steps].to(torch.int64) for o in out])      # [B, steps, L, k]
    b, _, layers, k = ids.shape
    e = engine.cfg.model.num_experts
    counts = torch.zeros(steps, layers, e, dtype=torch.int64)
    counts.scatter_add_(2, ids.permute(1, 2, 0, 3).reshape(steps, layers, b * k), torch.ones(1, dtype=torch.int64)
                        .expand(steps, layers, b * k))
    touched = (counts > 0).sum(-1).double()            # [steps, L]
    uniform = e * (1 - (1 - k / e) ** b)
    per_layer = touched.mean(0)
    return {"experts": e, "touched_mean": round(float(touched.mean()), 1), "uniform_touched": round(uniform, 1),
            "touched_vs_uniform": round(float(touched.mean()) / uniform, 3),
            "max_rows_mean": round(float(counts.max(-1).values.double().mean()), 1),
            "touched_per_layer": [round(float(x), 1) for x in per_layer],
            "max_rows_per_layer": [round(float(x), 1) for x in counts.max(-1).values.double().mean(0)]}


def time_seal(engine, prompts, n_new) -> dict:
    """What the loop pays after a generate call with TRACE: sealing its captures into the cache (build, sort,
    checksum), where they are (the engine's device). Two calls: the first seal also compiles the checksum
    kernel, the second is the steady cost."""
    from megatron_qrl.rollout.protocol import SamplingParams

    seconds = []
    for _ in range(2):
        engine.trace_recorder.clear()
        out = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=n_new, seed=0))  # kept
        _sync()
        t0 = time.perf_counter()
        cache = engine.trace_recorder.seal(range(len(out)), step=0)
        _sync()
        seconds.append(round(time.perf_counter() - t0, 4))
    return {"seal_s": seconds[-1], "first_seal_s": seconds[0], "cache_mb": round(cache.nbytes / 2**20, 1),
            "cache_device": str(cache.device), "entries": len(cache.entries)}


def decode_rate(timer, prompts, a):
    """(decode tokens/s median, per-rep rates)."""
    b = len(prompts)
    timer(prompts, 1)                       # warm-up pair (kernel compilation, graph capture, allocator)
    timer(prompts, a.new_tokens)
    rates = []
    for _ in range(a.reps):
        t_long, _ = timer(prompts, a.new_tokens)
        t_short, _ = timer(prompts, 1)
        dt = t_long - t_short
        rates.append(b * (a.new_tokens - 1) / dt if dt > 0 else float("nan"))   # nan: noise swamped the decode
    ok = [r for r in rates if r == r]
    return (statistics.median(ok) if ok else float("nan")), rates


def _active_rows(engine, batch: int, a):
    """Make rows 0..batch-1 of a graph engine's decode state active (from position prompt_len, each in its own
    KV slot, no length limit): (loop, bucket, the saved state to restore, greedy params), or None without a
    CUDA-graph loop."""
    import torch

    from megatron_qrl.rollout.protocol import SamplingParams

    loop = engine._static_loop
    if loop is None or not torch.cuda.is_available():
        return None
    st = loop.state
    bucket = next(b for b in loop.buckets if b >= batch)
    saved = st.snapshot()
    st.active[:batch] = True
    st.positions[:batch] = a.prompt_len
    st.slots[:batch] = torch.arange(batch, device=st.slots.device)
    st.n_gen[:batch] = 1
    st.max_new.fill_(10 ** 6)
    return loop, bucket, saved, SamplingParams(temperature=0.0, max_new_tokens=a.new_tokens)


def graph_step_ms(engine, batch: int, a, steps: int = 32, temperature: float = 0.0) -> float:
    """Median-free mean time of one replay of the decode-step graph of `batch` rows, measured with CUDA events
    over `steps` back-to-back replays (rows active from position prompt_len); the rows' state is restored.
    temperature > 0: the sampling step's graph (captured on its first use) instead of the greedy one."""
    import dataclasses

    import torch

    rows = _active_rows(engine, batch, a)
    if rows is None:
        return float("nan")
    loop, bucket, saved, params = rows
    if temperature > 0:
        params = dataclasses.replace(params, temperature=temperature)
    st = loop.state
    loop.graphs.run(bucket, params)                       # captured during the timed generates; warm
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    steps = min(steps, a.new_tokens - 1)
    start.record()
    for _ in range(steps):
        loop.graphs.run(bucket, params)
    end.record()
    torch.cuda.synchronize()
    st.restore(saved)
    st.active[:batch] = False
    return start.elapsed_time(end) / steps


# kernel name pattern -> the part of the step it belongs to (first match wins)
STEP_PARTS = [("experts (grouped FP4 / BF16 GEMMs)", r"moe_gemm|moe_gemv|grouped|_x_to_f16"),
              ("FP4 activation quant + capture", r"fake_quant|quant_capture|fp4_quant"),
              ("decode attention", r"cache_decode|decode_attn|combine"),
              ("routing (top-k + align)", r"route|align|topk|sort"),
              ("norms / QK-norm + RoPE + KV write", r"rmsnorm|qk_norm|rope|embed"),
              ("sampling + log-prob", r"sampl|uniform|logprob|argmax|_greedy|_pick"),
              ("cuBLAS GEMMs (attention linears, router, LM head)", r"gemm|gemv|nvjet|cutlass|xmma|sm90|ampere"),
              ("elementwise / copies / indexing", r".")]


def profile_step(engine, batch: int, a, steps: int = 8) -> dict:
    """Per-kernel device time of one captured decode step at `batch` rows (torch.profiler over graph replays;
    if the replays show no kernels, over eager runs of the same step): {part: us/step}, top kernels, total."""
    import re

    import torch
    from torch.profiler import ProfilerActivity, profile

    rows = _active_rows(engine, batch, a)
    if rows is None:
        return {}
    loop, bucket, saved, params = rows
    st = loop.state
    active = st.snapshot()        # the rows as graph_step_ms times them (own KV slots, their own tokens)
    steps = min(steps, a.new_tokens - 1)
    result = {}
    for mode in ("graph", "eager"):
        run = (lambda: loop.graphs.run(bucket, params)) if mode == "graph" else (lambda: loop._step(bucket, params))
        run()
        torch.cuda.synchronize()
        # (before 2026-12-02 08:10 UTC this restored the state of before _active_rows and only re-set `active`:
        # every row then wrote the scratch slot with the same stale token, so all rows routed to the same few
        # experts and the 48-layer profile showed a step half as long as the timed one)
        st.restore(active)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                run()
            torch.cuda.synchronize()
        kernels = {}
        for ev in prof.key_averages():
            t = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
            if t > 0 and ev.key not in ("cudaGraphLaunch",) and not ev.key.startswith("cuda"):
                kernels[ev.key] = (t / steps, ev.count / steps)
        if kernels:
            parts = {}
            for name, (us, _) in kernels.items():
                part = next(p for p, pat in STEP_PARTS if re.search(pat, name, re.I))
                parts[part] = parts.get(part, 0.0) + us
            top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:30]
            result = {"source": mode, "batch": batch, "kernel_us_per_step": sum(us for us, _ in kernels.values()),
                      "launches_per_step": sum(c for _, c in kernels.values()),
                      "parts_us": dict(sorted(parts.items(), key=lambda kv: -kv[1])),
                      "top": [(n[:90], round(us, 1), round(c, 1)) for n, (us, c) in top],
                      "gaps": launch_gaps(prof, steps)}
            break
    st.restore(saved)
    st.active[:batch] = False
    return result


def launch_gaps(prof, steps: int, top: int = 12) -> dict:
    """Idle device time between consecutive kernels of the profiled replays, charged to the kernel that
    starts after the gap (and to the one before it): where a step's time goes when its kernels are not busy."""
    kernels = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                      if str(getattr(e, "device_type", "")).endswith("CUDA") and e.time_range.end > e.time_range.start
                      and not e.name.startswith("cuda")), key=lambda k: k[0])
    if len(kernels) < 2:
        return {}
    before: dict = {}
    after: dict = {}
    total = 0.0
    for (_, end0, name0), (start1, _, name1) in zip(kernels, kernels[1:]):
        gap = max(0.0, start1 - end0)
        total += gap
        for table, name in ((before, name1), (after, name0)):
            us, n = table.get(name[:90], (0.0, 0))
            table[name[:90]] = (us + gap, n + 1)
    rank = lambda table: [(n, round(us / steps, 1), round(c / steps, 1), round(us / max(c, 1), 2))  # noqa: E731
                          for n, (us, c) in sorted(table.items(), key=lambda kv: -kv[1][0])[:top]]
    return {"span_us_per_step": (kernels[-1][1] - kernels[0][0]) / steps, "gap_us_per_step": total / steps,
            "mean_gap_us": total / (len(kernels) - 1),
            "before_kernel": rank(before), "after_kernel": rank(after)}


def hbm_floor_ms(cfg, batch: int, context: float, fp4: bool, tbs: float) -> float:
    """Bytes one decode step must read from HBM over `tbs` TB/s (see the module docstring)."""
    m = cfg.model
    h, f, e, k, v = m.hidden_size, m.moe_ffn_hidden_size, m.num_experts, m.moe_router_topk, m.vocab_size
    d = m.kv_channels or h // m.num_attention_heads
    attn = 2 * h * (m.num_attention_heads + 2 * m.num_query_groups) * d + 2 * m.num_attention_heads * d * h
    router = 4 * e * h
    expert = 3 * h * f * (0.5 + 1 / 16) if fp4 else 3 * h * f * 2
    touched = e * (1 - (1 - k / e) ** batch)
    kv = batch * context * 2 * m.num_query_groups * d * 2
    per_layer = attn + router + touched * expert + kv
    return (m.num_layers * per_layer + 2 * v * h) / (tbs * 1e12) * 1e3


def prompts_for(a, vocab, b, g):
    import torch

    return torch.randint(0, vocab, (b, a.prompt_len), generator=g).tolist()


def check_pair(a, layers, engine, eager_engine, batch, vocab, g) -> dict:
    """One graph engine against the eager engine of the same scheme and weights."""
    ps = prompts_for(a, vocab, batch, g)
    fast = build_engine(a, layers, engine, batch)
    _, out_f = time_engine(fast, ps, a.new_tokens)
    free(fast)
    ref = build_engine(a, layers, eager_engine, batch)
    _, out_r = time_engine(ref, ps, a.new_tokens)
    free(ref)
    first = [next((i for i, (u, v) in enumerate(zip(x.tokens, y.tokens)) if u != v), len(x.tokens))
             for x, y in zip(out_f, out_r)]
    diffs = [float((x.logprobs[:n] - y.logprobs[:n]).abs().max()) if n else 0.0
             for x, y, n in zip(out_f, out_r, first)]
    res = {"batch": batch, "identical_sequences": f"{sum(x.tokens == y.tokens for x, y in zip(out_f, out_r))}/{batch}",
           "mean_matching_prefix": statistics.mean(first), "max_abs_logprob_diff_on_prefix": max(diffs),
           "routed_equal_on_prefix": all(bool((x.routed_experts[:len(x.prompt_ids) + n - 1] ==
                                               y.routed_experts[:len(x.prompt_ids) + n - 1]).all())
                                         for x, y, n in zip(out_f, out_r, first))}
    if out_f[0].trace:
        agree, total = 0, 0
        for x, y, n in zip(out_f, out_r, first):
            rows = len(x.prompt_ids) + n - 1
            for layer, roles in x.trace.items():
                for role, cap in roles.items():
                    other = y.trace[layer][role]
                    agree += int((cap.bits[:rows] == other.bits[:rows]).sum())
                    total += cap.bits[:rows].numel()
        res["trace_bits_bytes_agreeing_on_prefix"] = agree / max(total, 1)
    return res


def force_moe_tile_class(per_expert: float) -> None:
    """The --moe-tokens-per-expert experiment: every heuristic_moe_config call sees that load."""
    from megatron_qrl.kernels import moe_grouped_gemm as moe

    original = moe.heuristic_moe_config

    def forced(n_assign, num_experts, *args, **kw):
        return original(max(1, int(per_expert * num_experts)), num_experts, *args, **kw)

    moe.heuristic_moe_config = forced


def apply_moe_experiments(a) -> None:
    """The --moe-* experiment flags: the grouped expert kernels' module switches (moe_grouped_gemm), set before any
    engine prepares its weights or captures its graphs."""
    from megatron_qrl.kernels import moe_grouped_gemm as mg

    if a.moe_tokens_per_expert:
        force_moe_tile_class(a.moe_tokens_per_expert)
    if a.moe_kernel != "default":
        mg.GLUON_DEFAULT = a.moe_kernel == "gluon"
    if a.moe_block32_from:
        mg.BLOCK16_MAX_PER_EXPERT = a.moe_block32_from
        mg.BLOCK32_NARROW_K_MAX_PER_EXPERT = 48.0
    if a.moe_sync_dots is not None:
        mg.SYNC_DOTS.update(gate_up=a.moe_sync_dots != "off", down=a.moe_sync_dots == "both")
    if a.moe_persistent is not None:
        mg.PERSISTENT_GATE_UP_BLOCK16 = a.moe_persistent
    if a.moe_tile_major:
        mg.EXPERT_STACK_TILE = tuple(int(v) for v in a.moe_tile_major.split("x"))


def run(a) -> dict:
    import torch

    from megatron_qrl.platform import init_distributed

    if a.tiny and torch.cuda.is_available():
        raise SystemExit("--tiny runs on the CPU: hide the GPU (CUDA_VISIBLE_DEVICES=)")
    base = make_cfg(a, a.layers[0], "bf16", max(a.batches))
    init_distributed(base)
    apply_moe_experiments(a)
    res = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "torch": torch.__version__,
           "moe_tokens_per_expert": a.moe_tokens_per_expert, "moe_kernel": a.moe_kernel,
           "moe_block32_from": a.moe_block32_from, "moe_sync_dots": a.moe_sync_dots,
           "moe_persistent": a.moe_persistent, "moe_tile_major": a.moe_tile_major,
           "layers": a.layers, "batches": a.batches, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
           "reps": a.reps, "tiny": a.tiny, "targets": a.targets, "hbm_tbs": a.hbm_tbs, "rates": {}, "rates_all": {},
           "floor_ms": {}, "checks": {}, "overheads": {}, "decode": {}}
    try:
        import triton
        res["triton"] = triton.__version__
    except Exception:
        res["triton"] = None
    g = torch.Generator().manual_seed(a.seed + 1)
    vocab = base.model.vocab_size
    for layers in a.layers:
        key = str(layers)
        cfg = make_cfg(a, layers, "fp4", max(a.batches))
        ctx = a.prompt_len + a.new_tokens / 2
        res["floor_ms"][key] = {b: {"fp4": hbm_floor_ms(cfg, b, ctx, True, a.hbm_tbs),
                                    "bf16": hbm_floor_ms(cfg, b, ctx, False, a.hbm_tbs)} for b in a.batches}
        for name in [e for e in a.engines if e != "hf"]:
            try:
                eng = build_engine(a, layers, name, max(a.batches))
            except Exception as e:   # noqa: BLE001 - e.g. out of memory at 48 layers: keep the other results
                res.setdefault("failed", {})[f"{layers}:{name}"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"[bench] {layers} layers {name}: FAILED {res['failed'][f'{layers}:{name}']}", file=sys.stderr,
                      flush=True)
                eng = None
                free()
                continue
            res["decode"][name] = eng.decode_mode
            for b in a.batches:
                if eng.decode_mode == "eager" and b not in a.eager_batches:
                    continue
                ps = prompts_for(a, vocab, b, g)
                med, rates = decode_rate(lambda p, n, eng=eng: time_engine(eng, p, n), ps, a)
                res["rates"].setdefault(key, {}).setdefault(name, {})[b] = med
                res["rates_all"].setdefault(key, {}).setdefault(name, {})[b] = rates
                if eng.decode_mode == "graphs":
                    res.setdefault("graph_step_ms", {}).setdefault(key, {}).setdefault(name, {})[b] = \
                        graph_step_ms(eng, b, a)
                if name in ("fp4", "bf16") and eng.decode_mode != "eager":
                    res.setdefault("routing", {}).setdefault(key, {}).setdefault(name, {})[b] = \
                        routing_stats(eng, ps, a)
                if b in a.profile and eng.decode_mode == "graphs":
                    try:
                        prof = profile_step(eng, b, a)
                    except Exception as e:   # noqa: BLE001 - a profiler failure must not lose the timings
                        prof = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                    res.setdefault("profile", {}).setdefault(key, {}).setdefault(name, {})[b] = prof
                    print(f"[bench] profile {layers} layers B={b} {name}: {json.dumps(prof)}", file=sys.stderr,
                          flush=True)
                print(f"[bench] {layers} layers B={b} {name}: {med:.1f} tok/s {[round(r, 1) for r in rates]}"
                      f" graph step {res.get('graph_step_ms', {}).get(key, {}).get(name, {}).get(b, float('nan')):.3f} ms",
                      file=sys.stderr, flush=True)
                write_json(res, a.json)
            res.setdefault("health", {})[f"{layers}:{name}"] = {k: v for k, v in eng.health().items()
                                                                if k in ("decode", "graphs_captured", "graph_failure",
                                                                         "graph_capture_s", "kv_cache",
                                                                         "kv_cache_packed", "kv_cache_bytes")}
            if name == "fp4" and a.overheads and layers == a.layers[0]:
                ps = prompts_for(a, vocab, a.overheads, g)
                greedy, _ = decode_rate(lambda p, n: time_engine(eng, p, n), ps, a)
                sampled, _ = decode_rate(lambda p, n: time_engine(eng, p, n, temperature=1.0), ps, a)
                # the captured steps too: the generate() rates carry the host's jitter, the graphs do not
                step_g = graph_step_ms(eng, a.overheads, a)
                step_s = graph_step_ms(eng, a.overheads, a, temperature=1.0)
                res["overheads"]["sampling_vs_greedy"] = {"batch": a.overheads, "greedy": greedy, "sampled": sampled,
                                                          "slowdown": greedy / sampled - 1,
                                                          "step_greedy_ms": step_g, "step_sampled_ms": step_s,
                                                          "step_slowdown": step_s / step_g - 1}
            free(eng)
            eng = None
        if "hf" in a.engines and layers <= HF_MAX_LAYERS:
            src = build_engine(a, layers, "bf16-eager", max(a.batches))
            import transformers

            res["transformers"] = transformers.__version__
            hf = hf_model(src.cfg, src.model, src.device, next(src.model.parameters()).dtype)
            free(src)
            src = None
            for b in a.batches:
                ps = prompts_for(a, vocab, b, g)
                med, rates = decode_rate(lambda p, n: time_hf(hf, p, n), ps, a)
                res["rates"].setdefault(key, {}).setdefault("hf", {})[b] = med
                res["rates_all"].setdefault(key, {}).setdefault("hf", {})[b] = rates
                print(f"[bench] {layers} layers B={b} hf: {med:.1f} tok/s", file=sys.stderr, flush=True)
            free(hf)
            hf = None
            write_json(res, a.json)
        if a.overheads and layers == a.layers[0]:
            ps = prompts_for(a, vocab, a.overheads, g)
            rate, reps, step, phases, seal = {}, {}, {}, {}, {}
            for name in ("w4a4", "w4a4-trace"):
                eng = build_engine(a, layers, name, a.overheads)
                rate[name], reps[name] = decode_rate(lambda p, n, eng=eng: time_engine(eng, p, n), ps, a)
                step[name] = graph_step_ms(eng, a.overheads, a)
                loop = eng._static_loop
                phases[name] = ({k: round(v, 4) for k, v in loop.stats.items() if k.endswith("_s")}
                                if loop is not None else None)
                if name == "w4a4-trace":
                    seal[name] = time_seal(eng, ps, a.new_tokens)
                free(eng)
                eng = None
            # the generate-level slowdown splits into the captured step's (device) and the rest (host assembly)
            res["overheads"]["trace_r3_capture"] = {"batch": a.overheads, **rate,
                                                    "slowdown": rate["w4a4"] / rate["w4a4-trace"] - 1,
                                                    "rates_per_rep": reps,   # the medians' spread
                                                    "step_ms": step,
                                                    "step_slowdown": step["w4a4-trace"] / step["w4a4"] - 1,
                                                    "phases_s": phases, "seal": seal}
            print(f"[bench] overheads {res['overheads']}", file=sys.stderr, flush=True)
            write_json(res, a.json)
        if a.check and layers == a.layers[0]:
            pairs = [("fp4", "fp4-eager"), ("bf16", "bf16-eager"), ("w4a4-trace", "w4a4-trace-eager")]
            if "fp4-lora" in a.engines:
                pairs.append(("fp4-lora", "fp4-lora-eager"))
            for fast, eager in pairs:
                res["checks"][f"{fast} vs {eager}"] = check_pair(a, layers, fast, eager, a.check, vocab, g)
                print(f"[bench] check {fast}: {res['checks'][f'{fast} vs {eager}']}", file=sys.stderr, flush=True)
                write_json(res, a.json)
    return res


def write_json(res: dict, path) -> None:
    if not path:
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1, default=str)
    os.replace(tmp, path)


def table(res: dict) -> str:
    lines = [f"{res['gpu'] or 'cpu'}, torch {res['torch']}, triton {res.get('triton')}, transformers "
             f"{res.get('transformers', '-')}; prompt {res['prompt_len']}, {res['new_tokens']} new tokens, greedy, "
             f"median of {res['reps']}; decode paths {res['decode']}"]
    for layers, rates in res["rates"].items():
        cols = list(rates)
        ratio = [("fp4", "bf16"), ("fp4", "hf"), ("fp4", "fp4-eager"), ("fp4-kv4", "fp4"), ("fp4-kv8", "fp4")]
        ratio = [(x, y) for x, y in ratio if x in cols and y in cols]
        lines += ["", f"{layers} layers:", "| batch | " + " | ".join(f"{c} tok/s" for c in cols) + " | "
                  + " | ".join(f"{x}/{y}" for x, y in ratio) + " | fp4 step ms | fp4 graph ms | bf16 graph ms"
                  " | HBM floor ms | graph/floor |", "|---" * (6 + len(cols) + len(ratio)) + "|"]
        for b in res["batches"]:
            nan = float("nan")
            row = [str(b)] + [f"{rates[c].get(b, nan):.1f}" for c in cols]
            row += [f"{rates[x].get(b, nan) / rates[y].get(b, nan):.2f}x" for x, y in ratio]
            floor = res["floor_ms"][layers][b]["fp4"]
            step = b / rates["fp4"][b] * 1e3 if b in rates.get("fp4", {}) else nan
            graph = res.get("graph_step_ms", {}).get(layers, {})
            g4, g16 = graph.get("fp4", {}).get(b, nan), graph.get("bf16", {}).get(b, nan)
            row += [f"{step:.2f}", f"{g4:.3f}", f"{g16:.3f}", f"{floor:.2f}", f"{g4 / floor:.2f}x"]
            lines.append("| " + " | ".join(row) + " |")
    for layers, engines in res.get("profile", {}).items():
        for name, by_batch in engines.items():
            for b, prof in by_batch.items():
                if not prof or "error" in prof:
                    continue
                step = res.get("graph_step_ms", {}).get(layers, {}).get(name, {}).get(b, float("nan"))
                lines += ["", f"step profile, {layers} layers, {name}, B={b} ({prof['source']} replays): kernels "
                          f"{prof['kernel_us_per_step']:.0f} us of a {step * 1e3:.0f} us step, "
                          f"{prof['launches_per_step']:.0f} launches",
                          "| part | us/step | share of kernel time |", "|---|---|---|"]
                lines += [f"| {p} | {us:.1f} | {us / prof['kernel_us_per_step']:.0%} |" for p, us in prof["parts_us"].items()]
                lines += ["top kernels (us/step, launches/step): " + "; ".join(f"{n[:60]} {us} x{c}" for n, us, c in prof["top"][:15])]
                gaps = prof.get("gaps") or {}
                if gaps:
                    lines += [f"idle between kernels: {gaps['gap_us_per_step']:.0f} us/step of a "
                              f"{gaps['span_us_per_step']:.0f} us span (mean gap {gaps['mean_gap_us']:.2f} us); "
                              "before (us/step, gaps/step, mean us): " + "; ".join(
                                  f"{n[:50]} {us} x{c} ({m})" for n, us, c, m in gaps["before_kernel"][:8])]
    for layers, engines in res.get("routing", {}).items():
        for name, by_batch in engines.items():
            lines += [f"routing, {layers} layers, {name}, B={b}: {st.get('touched_mean')} of {st.get('experts')} experts "
                      f"touched per layer and step (uniform routing: {st.get('uniform_touched')}), heaviest expert "
                      f"{st.get('max_rows_mean')} rows" for b, st in by_batch.items() if st]
    if res.get("health"):
        lines += ["", "graphs: " + "; ".join(f"{k}: {v}" for k, v in res["health"].items())]
    if res.get("failed"):
        lines += ["", "failed: " + "; ".join(f"{k}: {v}" for k, v in res["failed"].items())]
    if res["overheads"]:
        lines += ["", "overheads: " + "; ".join(f"{k}: {v}" for k, v in res["overheads"].items())]
    if res["checks"]:
        lines += ["", "checks: " + "; ".join(f"{k}: {v}" for k, v in res["checks"].items())]
    return "\n".join(lines)


def main(argv=None) -> int:
    a = _parse(argv)
    if a.tiny:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ.setdefault("TRITON_INTERPRET", "1")    # before anything imports triton
    res = run(a)
    print(table(res), flush=True)
    write_json(res, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
