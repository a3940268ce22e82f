"""Rollout decode throughput of the embedded engine: BF16 vs FP4 weights, plus Hugging Face generate().

    python tools/bench_rollout.py [--layers 4] [--batches 1,16,64,256] [--prompt-len 64] [--new-tokens 64]
                                  [--reps 3] [--schemes bf16,w4a16,w4a4] [--no-hf] [--json F] [--tiny]

One process. A Qwen3-30B-A3B-shaped model cut to --layers layers (hidden 2048, 128 experts top-8, expert
FFN 768, 32 query / 4 KV heads of dim 128, vocab 151936; random weights, real shapes; --tiny: a CPU-sized
model for the smoke test) is built once as the trainer would (bf16 on GPU), and every engine receives its
weights through the normal weight sync (sync_from_model: codec + digests):
    bf16    rollout.weights=bf16 (Megatron's modules, one GEMM call per expert)
    w4a16   rollout.weights=nvfp4, scheme w4a16: on CUDA the W4A16 / grouped-MoE Triton kernels
    w4a4    rollout.weights=nvfp4, scheme w4a4: per-expert fake-quant of the inputs, then the same kernels
    hf      transformers Qwen3MoeForCausalLM.generate() on the same bf16 weights (outside reference)
Decode tokens/s excludes prefill: a generate() of N new tokens minus a generate() of 1 new token (the
prefill and first token) for the same prompts, i.e. (N - 1) * B tokens over the time difference; medians of
--reps timed pairs after one warm-up pair. Greedy, all prompts of one length, no stop token, log-probs on
(the engine returns them for RL). No CUDA graphs anywhere (the engine and HF run eagerly).
Checks in the same run: at the smallest batch >= 2, every FP4 kernel engine against the same scheme with
the kernels off (dequantize-then-matmul reference): greedy-token agreement and max |log-prob difference|;
the bf16 engine's first greedy tokens against HF's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

QWEN3_30B_SHAPE = dict(hidden_size=2048, num_attention_heads=32, num_query_groups=4, kv_channels=128,
                       ffn_hidden_size=6144, num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768,
                       vocab_size=151936, qk_layernorm=True, rotary_base=1000000, norm_epsilon=1e-6,
                       untie_embeddings_and_output_weights=True, moe_aux_loss_coeff=0.0)
TINY_SHAPE = dict(hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16, ffn_hidden_size=128,
                  num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32, vocab_size=128, qk_layernorm=True,
                  rotary_base=10000, norm_epsilon=1e-6, untie_embeddings_and_output_weights=True,
                  moe_aux_loss_coeff=0.0)
SCHEMES = {"bf16": ("bf16", "w4a16"), "w4a16": ("nvfp4", "w4a16"), "w4a4": ("nvfp4", "w4a4"),
           "mxfp4-w4a16": ("mxfp4", "w4a16")}


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="CPU smoke size (2 layers, hidden 64, 8 experts)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--batches", default=None)
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--new-tokens", type=int, default=None)
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--schemes", default="bf16,w4a16,w4a4")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--no-check", action="store_true", help="skip the kernel-vs-reference check")
    p.add_argument("--kernels", default=None, choices=["auto", "on", "off"],
                   help="FP4 linears on the Triton kernels (default: auto; --tiny: on, through the interpreter)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    d = dict(layers=2, batches="1,4", prompt_len=8, new_tokens=4, reps=1) if a.tiny else \
        dict(layers=4, batches="1,16,64,256", prompt_len=64, new_tokens=64, reps=3)
    d["kernels"] = "on" if a.tiny else "auto"
    for k, v in d.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.batches = [int(b) for b in str(a.batches).split(",") if b]
    a.schemes = [s.strip() for s in a.schemes.split(",") if s.strip()]
    bad = [s for s in a.schemes if s not in SCHEMES]
    if bad:
        raise SystemExit(f"unknown scheme(s) {bad}; use {sorted(SCHEMES)}")
    if a.new_tokens < 2:
        raise SystemExit("--new-tokens must be >= 2 (decode time = N tokens minus the 1-token prefill run)")
    return a


def make_cfg(a, weights: str, scheme: str, bf16: bool):
    from megatron_qrl.config import QRLConfig

    shape = dict(TINY_SHAPE if a.tiny else QWEN3_30B_SHAPE)
    model = dict(shape, num_layers=a.layers, max_sequence_length=a.prompt_len + a.new_tokens,
                 init_method_std=0.02 if not a.tiny else 0.1)
    return QRLConfig.model_validate({
        "model": model, "quant": {"format": "nvfp4", "targets": "routed_experts", "scheme": "w4a4"},
        "trainer": {"bf16": bf16, "seed": a.seed}, "aqn": {"enabled": False}, "trace": {"enabled": False},
        "rollout": {"weights": weights, "scheme": scheme, "max_batch_size": max(a.batches),
                    "max_new_tokens": a.new_tokens}})


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_engine(cfg, kernels=None):
    """An EmbeddedEngine whose model skips random init (the weight sync overwrites every parameter)."""
    import dataclasses

    from megatron_qrl.models import build_model
    from megatron_qrl.models.provider import transformer_config
    from megatron_qrl.rollout.embedded import EmbeddedEngine

    tc = dataclasses.replace(transformer_config(cfg), perform_initialization=False)
    return EmbeddedEngine(cfg, build_model(cfg, tc)[0], kernels=kernels)


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
    missing = set(state) - set(tensors)
    extra = set(tensors) - set(state)
    if missing or extra:
        raise RuntimeError(f"HF weight mapping incomplete: missing {sorted(missing)[:4]}, extra {sorted(extra)[:4]}")
    for name, t in tensors.items():
        if tuple(state[name].shape) != tuple(t.shape):
            raise RuntimeError(f"HF tensor {name}: shape {tuple(t.shape)} != {tuple(state[name].shape)}")
    model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}, strict=True)
    model.eval()
    return model


def time_engine(engine, prompts, n_new, device):
    from megatron_qrl.rollout.protocol import SamplingParams

    sp = SamplingParams(temperature=0.0, max_new_tokens=n_new, seed=0)
    _sync(device)
    t0 = time.perf_counter()
    out = engine.generate(prompts, sp)
    _sync(device)
    return time.perf_counter() - t0, out


def time_hf(model, prompts, n_new, device):
    import torch

    ids = torch.tensor(prompts, device=device)
    _sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                             min_new_tokens=n_new, do_sample=False, use_cache=True, pad_token_id=0,
                             eos_token_id=None)
    _sync(device)
    return time.perf_counter() - t0, out[:, ids.shape[1]:].tolist()


def decode_rate(timer, prompts, a, reps):
    """(decode tokens/s median, per-rep rates, tokens of the last long run)."""
    b = len(prompts)
    timer(prompts, 1)                       # warm-up pair (kernel compilation, allocator)
    timer(prompts, a.new_tokens)
    rates, out = [], None
    for _ in range(reps):
        t_long, out = timer(prompts, a.new_tokens)
        t_short, _ = timer(prompts, 1)
        dt = t_long - t_short
        rates.append(b * (a.new_tokens - 1) / dt if dt > 0 else float("nan"))   # nan: noise swamped the decode
    ok = [r for r in rates if r == r]
    return (statistics.median(ok) if ok else float("nan")), rates, out


def run(a) -> dict:
    import torch

    from megatron_qrl.models import build_model
    from megatron_qrl.platform import init_distributed

    cuda = torch.cuda.is_available() and not a.tiny
    if a.tiny and torch.cuda.is_available():
        raise SystemExit("--tiny runs on the CPU: hide the GPU (CUDA_VISIBLE_DEVICES=)")
    base = make_cfg(a, "bf16", "w4a16", cuda)
    init_distributed(base)
    torch.manual_seed(a.seed)
    source = build_model(base)[0]
    device = next(source.parameters()).device
    dtype = next(source.parameters()).dtype
    res = {"device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "torch": torch.__version__, "dtype": str(dtype), "layers": a.layers, "batches": a.batches,
           "prompt_len": a.prompt_len, "new_tokens": a.new_tokens, "reps": a.reps, "tiny": a.tiny,
           "cuda_graphs": False, "rates": {}, "rates_all": {}, "checks": {}}
    try:
        import triton
        res["triton"] = triton.__version__
    except Exception:
        res["triton"] = None
    engines = {}
    for s in a.schemes:
        weights, scheme = SCHEMES[s]
        engines[s] = build_engine(make_cfg(a, weights, scheme, cuda), kernels=a.kernels)
        engines[s].sync_from_model(source, version=0)
        print(f"[bench] engine {s}: kernels={engines[s].kernels is not None}", file=sys.stderr, flush=True)
    res["kernels"] = {s: e.kernels is not None for s, e in engines.items()}
    hf = None
    if not a.no_hf:
        try:
            import transformers
            res["transformers"] = transformers.__version__
            hf = hf_model(base, source, device, dtype)
        except ImportError as e:
            res["transformers"] = f"unavailable: {e}"
    g = torch.Generator().manual_seed(a.seed + 1)
    vocab = base.model.vocab_size

    def prompts_for(b):
        return torch.randint(0, vocab, (b, a.prompt_len), generator=g).tolist()

    # correctness: kernel engines vs the same scheme with the kernels off, bf16 engine vs HF
    if not a.no_check:
        b = next((x for x in sorted(a.batches) if x >= 2), a.batches[0])
        ps = prompts_for(b)
        for s, eng in engines.items():
            if eng.kernels is None:
                continue
            weights, scheme = SCHEMES[s]
            ref = build_engine(make_cfg(a, weights, scheme, cuda), kernels="off")
            ref.sync_from_model(source, version=0)
            _, out_k = time_engine(eng, ps, a.new_tokens, device)
            _, out_r = time_engine(ref, ps, a.new_tokens, device)
            same = sum(x.tokens == y.tokens for x, y in zip(out_k, out_r))
            first = [next((i for i, (u, v) in enumerate(zip(x.tokens, y.tokens)) if u != v), len(x.tokens))
                     for x, y in zip(out_k, out_r)]
            # log-probs compare only on the common greedy prefix (after a divergence the inputs differ)
            diffs = [float((x.logprobs[:n] - y.logprobs[:n]).abs().max()) if n else 0.0
                     for x, y, n in zip(out_k, out_r, first)]
            res["checks"][f"{s} kernels vs reference"] = {
                "batch": b, "identical_sequences": f"{same}/{len(ps)}",
                "mean_matching_prefix": statistics.mean(first), "max_abs_logprob_diff_on_prefix": max(diffs)}
            del ref
        if hf is not None and "bf16" in engines:
            _, out_e = time_engine(engines["bf16"], ps, a.new_tokens, device)
            _, out_h = time_hf(hf, ps, a.new_tokens, device)
            first = [next((i for i, (u, v) in enumerate(zip(x.tokens, y)) if u != v), len(y))
                     for x, y in zip(out_e, out_h)]
            res["checks"]["bf16 engine vs hf greedy"] = {
                "batch": b, "first_token_equal": f"{sum(f > 0 for f in first)}/{len(ps)}",
                "mean_matching_prefix": statistics.mean(first)}
        print(f"[bench] checks {res['checks']}", file=sys.stderr, flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    del source
    for b in a.batches:
        ps = prompts_for(b)
        for s, eng in engines.items():
            def timer(p, n, eng=eng):
                return time_engine(eng, p, n, device)
            med, all_rates, _ = decode_rate(timer, ps, a, a.reps)
            res["rates"].setdefault(s, {})[b] = med
            res["rates_all"].setdefault(s, {})[b] = all_rates
            print(f"[bench] B={b} {s}: {med:.1f} tok/s {[round(r, 1) for r in all_rates]}", file=sys.stderr, flush=True)
        if hf is not None:
            def timer(p, n):
                return time_hf(hf, p, n, device)
            med, all_rates, _ = decode_rate(timer, ps, a, a.reps)
            res["rates"].setdefault("hf", {})[b] = med
            res["rates_all"].setdefault("hf", {})[b] = all_rates
            print(f"[bench] B={b} hf: {med:.1f} tok/s", file=sys.stderr, flush=True)
        if a.json:
            write_json(res, a.json)        # partial results survive a time limit
    return res


def write_json(res: dict, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1, default=str)
    os.replace(tmp, path)


def table(res: dict) -> str:
    cols = list(res["rates"])
    lines = [f"device {res['device']}" + (f" ({res['gpu']})" if res["gpu"] else "") +
             f", torch {res['torch']}, triton {res.get('triton')}, transformers {res.get('transformers', '-')}, "
             f"{res['dtype']}; {res['layers']} layers, prompt {res['prompt_len']}, {res['new_tokens']} new tokens, "
             f"greedy, median of {res['reps']}; CUDA graphs: {'yes' if res['cuda_graphs'] else 'no'}; "
             f"FP4 kernels: {res['kernels']}", "",
             "| batch | " + " | ".join(f"{c} tok/s" for c in cols) + " | "
             + " | ".join(f"{c}/bf16" for c in cols if c not in ("bf16",)) + " |",
             "|---" * (1 + len(cols) + len([c for c in cols if c != "bf16"])) + "|"]
    for b in res["batches"]:
        row = [str(b)] + [f"{res['rates'][c][b]:.1f}" for c in cols]
        base = res["rates"].get("bf16", {}).get(b)
        row += [f"{res['rates'][c][b] / base:.2f}x" if base else "-" for c in cols if c != "bf16"]
        lines.append("| " + " | ".join(row) + " |")
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
    if a.json:
        write_json(res, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
