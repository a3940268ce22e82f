"""Measurements tools/bench_trainer.py adds to a mode: FLOPs/MFU, log-probs with TRACE vs without, sync cost.

FLOP count (stated so MFU numbers can be checked): per token, forward = 2 x (the matmul parameters a token
passes through: per layer QKV, attention output, router, top-k experts x (fc1 + fc2); the LM head) plus the
causal attention matmuls 2 x 2 x heads x head_dim x T/2 (QK^T and AV over T/2 keys on average) per layer;
a training step = 3 x forward (backward = 2 x forward), a log-prob pass = 1 x forward. Embedding lookups,
norms, softmax, activations and FP4 fake quantization are not counted. Peak: bf16 dense tensor-core
TFLOP/s of the GPU (989 for an H100/H200 SXM), or --peak-tflops.
"""
from __future__ import annotations

import statistics
import time

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}


def flops_per_token(cfg, seq_len: int) -> dict:
    m = cfg.model
    h, hd = m.hidden_size, m.head_dim
    qkv = h * (m.num_attention_heads + 2 * m.num_query_groups) * hd
    proj = m.num_attention_heads * hd * h
    if m.num_experts:
        mlp = m.moe_router_topk * 3 * h * m.moe_ffn_hidden_size + h * m.num_experts
        mlp += 3 * h * m.moe_shared_expert_ffn_hidden_size
    else:
        mlp = 3 * h * m.ffn_hidden_size
    matmul_params = m.num_layers * (qkv + proj + mlp) + h * m.vocab_size
    attention = m.num_layers * 2 * 2 * m.num_attention_heads * hd * (seq_len / 2)
    fwd = 2 * matmul_params + attention
    return {"active_matmul_params": matmul_params, "forward": fwd, "train": 3 * fwd}


def peak_tflops(device_name: str | None, override: float | None) -> float | None:
    if override:
        return override
    for key, v in PEAK_BF16_TFLOPS.items():
        if device_name and key in device_name:
            return v
    return None


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def random_r3_ids(cfg, B: int, T: int, seed: int):
    """Distinct top-k expert ids per token and layer (R3 replay ids, [B, T, L, k])."""
    import torch

    g = torch.Generator().manual_seed(seed + 17)
    m = cfg.model
    scores = torch.rand(B, T, m.num_layers, m.num_experts, generator=g)
    return scores.topk(m.moe_router_topk, dim=-1).indices


def trace_logprobs(trainer, cfg, batch: dict, repeats: int = 2) -> dict:
    """Log-prob pass with TRACE guides (a cache of the trainer's own forward on the cached layers, guides
    indexed on the device once per pass, mismatches measured) vs the same pass without, side by side."""
    import torch

    from megatron_qrl.trace import BatchGuides, TraceMetrics, TraceReplay
    from megatron_qrl.trace.self_capture import capture_cache

    dev = trainer.device
    layers = cfg.cached_layers() or list(range(cfg.model.num_layers // 2, cfg.model.num_layers))
    t0 = time.perf_counter()
    cache = capture_cache(trainer, batch, layers)
    _sync(dev)
    capture_s = time.perf_counter() - t0
    T = batch["tokens"].shape[1]
    n = cfg.model.num_experts
    plain, traced, metrics = [], [], None
    for _ in range(repeats):
        _sync(dev)
        t0 = time.perf_counter()
        trainer.logprobs(batch)
        _sync(dev)
        plain.append(time.perf_counter() - t0)
        metrics = TraceMetrics()
        t0 = time.perf_counter()
        guides = BatchGuides(cache, T, batch["r3_expert_ids"], metrics=metrics, local_experts=(0, n), num_experts=n,
                             device=dev)
        trainer.trace = TraceReplay.serving(guides)
        trainer.logprobs(batch)
        trainer.trace = None
        _sync(dev)
        traced.append(time.perf_counter() - t0)
    from megatron_qrl.models import guided_fallback_stats

    fb = guided_fallback_stats(trainer.model)
    m = {k.removeprefix("trace/"): v for k, v in metrics.as_dict().items()}
    out = {"cached_layers": layers, "cache_mb": cache.nbytes / 2 ** 20, "capture_s": capture_s,
           "logprobs_s": min(plain), "logprobs_trace_s": min(traced), "all_plain_s": plain, "all_trace_s": traced,
           "ratio": min(traced) / min(plain),
           "code_mismatch_before": m.get("code_mismatch_before"), "code_mismatch_after": m.get("code_mismatch_after"),
           "missing_row_fraction": m.get("missing_row_fraction"),
           "guided_fallback": fb["guided_fallback"] / max(1, fb["guided_elements"])}
    del torch
    return out


def sync_cost(trainer, cfg, repeats: int = 3) -> dict:
    """Weight-sync payload for the engine (pack + digest, on the trainer's device) after an optimizer step,
    the engine's digest re-check of the same payload, and the previous path (pack_weight per tensor +
    SHA-256 over host bytes), side by side."""
    from megatron_qrl.models import weights_changed
    from megatron_qrl.pipeline.sync import local_payload, quantized_weight_names, unwrap
    from megatron_qrl.quant import pack_weight, payload_digests
    from megatron_qrl.quant.wire import payload_nbytes
    from megatron_qrl.rollout.weights import digest_problems

    dev = trainer.device
    new, verify = [], []
    weights = hashes = None
    for _ in range(repeats):
        weights_changed()              # as after an optimizer step: the QAT weight cache is stale
        _sync(dev)
        t0 = time.perf_counter()
        weights, hashes = local_payload(trainer, cfg)
        _sync(dev)
        new.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        problems = digest_problems(weights, hashes)
        _sync(dev)
        verify.append(time.perf_counter() - t0)
        if any(problems.values()):
            raise RuntimeError(f"sync payload fails its own digests: {[p for p in problems.values() if p][:2]}")
    nbytes = sum(payload_nbytes(w) for w in weights.values())
    chunks = unwrap(trainer.model)
    quantized = quantized_weight_names(chunks, cfg)
    fmt = cfg.rollout.weights
    _sync(dev)
    t0 = time.perf_counter()
    old = {n: (pack_weight(p.detach(), fmt) if n in quantized and fmt in ("nvfp4", "mxfp4") else p.detach())
           for c in chunks for n, p in c.named_parameters()}
    _sync(dev)
    old_pack = time.perf_counter() - t0
    t0 = time.perf_counter()
    payload_digests(list(old.values()), "sha256")
    old_digest = time.perf_counter() - t0
    return {"payload_mb": nbytes / 1e6, "tensors": len(weights), "pack_digest_s": statistics.median(new),
            "all_pack_digest_s": new, "verify_s": statistics.median(verify), "old_pack_s": old_pack,
            "old_sha256_s": old_digest, "old_total_s": old_pack + old_digest,
            "speedup": (old_pack + old_digest) / statistics.median(new), "target_s": 0.15,
            "meets_target": statistics.median(new) <= 0.15}
