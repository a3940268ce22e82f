"""End-to-end check of the SGLang adapter on a GPU node with sglang==0.5.15.post1 installed.

Not run in this project's CI (SGLang has no CPU build); see docs/sglang.md for when and how to run it.

    # disaggregated: the script launches one server on GPU 1 and is the trainer end (NCCL) on GPU 0
    python tools/sglang_smoke.py --model-path /ckpt/qwen3-30b-a3b-nvfp4 --scheme w4a16 --base-gpu-id 1
    # against servers you started yourself (launch_server with the flags docs/sglang.md lists)
    python tools/sglang_smoke.py --model-path /ckpt/... --url http://127.0.0.1:30000 --scheme w4a4
    # colocated: in-process sglang.Engine on GPU 0 (also checks release/resume_memory_occupation)
    python tools/sglang_smoke.py --model-path /ckpt/... --colocated --scheme w4a16

Steps (each prints PASS/FAIL; the exit code is the number of failures):
 1. generate greedily with log-probs (+ routed experts for MoE checkpoints): shapes, finite log-probs <= 0,
    expert ids in range, finish reasons;
 2. weight sync, version 1: the checkpoint's first --num-linears NVFP4 linears re-quantized by OUR codec from
    their negated values, sent through the adapter (digests checked, ModelOpt names, buckets): outputs must
    change, and every server must report weight_version 1;
 3. weight sync, version 2: the checkpoint's own bytes for the same tensors: the release's weight checksum
    (/weights_checker, disaggregated) must equal the one right after loading, and greedy tokens must equal
    step 1's exactly (log-probs within --logprob-tol). A failure here means the release does not re-install
    FP4 weights correctly through this path (it runs no process_weights_after_loading after an update);
 4. colocated only: release + resume memory, then step 3's outputs again.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_qrl.config import apply_overrides, from_dict  # noqa: E402
from megatron_qrl.rollout import FP4Tensor, SamplingParams, pack_weight, payload_digest  # noqa: E402
from megatron_qrl.rollout.sglang import RoutingLayout, build_sglang_engine  # noqa: E402

FAILURES = []


def check(ok: bool, what: str, detail: str = "") -> bool:
    print(f"[{'PASS' if ok else 'FAIL'}] {what}" + (f" -- {detail}" if detail and not ok else ""))
    if not ok:
        FAILURES.append(what)
    return ok


def routing_of(model_path: Path):
    hf = json.loads((model_path / "config.json").read_text())
    hf = hf.get("text_config", hf)
    if not hf.get("num_experts") and not hf.get("n_routed_experts"):
        return None
    return RoutingLayout(hf["num_hidden_layers"], hf["num_experts_per_tok"],
                         hf.get("num_experts") or hf["n_routed_experts"], tuple(range(hf["num_hidden_layers"])))


def checkpoint_fp4_linears(model_path: Path, limit: int) -> dict[str, FP4Tensor]:
    """The first `limit` NVFP4 linears of a ModelOpt export, as FP4Tensors of the checkpoint's bytes."""
    from safetensors import safe_open

    out: dict[str, FP4Tensor] = {}
    for shard in sorted(model_path.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            keys = set(f.keys())
            for key in sorted(k for k in keys if k.endswith(".weight_scale_2")):
                base = key[: -len(".weight_scale_2")]
                if {base + ".weight", base + ".weight_scale"} <= keys:
                    out[base + ".weight"] = FP4Tensor("nvfp4", f.get_tensor(base + ".weight"),
                                                      f.get_tensor(base + ".weight_scale"),
                                                      f.get_tensor(key).float().reshape(()))
                if len(out) >= limit:
                    return out
    return out


def run_greedy(engine, prompts, max_new_tokens):
    return engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens))


def check_samples(samples, routing, label):
    for i, s in enumerate(samples):
        lp = s.logprobs
        check(lp is not None and lp.shape == (len(s.tokens),) and bool(torch.isfinite(lp).all()) and
              bool((lp <= 1e-4).all()), f"{label}: sample {i} log-probs finite, <= 0, one per token")
        if routing is not None:
            r = s.routed_experts
            check(r is not None and r.shape == (s.num_forwarded, len(routing.moe_layers), routing.topk),
                  f"{label}: sample {i} routed experts [P+T-1, L, k]", f"got {None if r is None else tuple(r.shape)}")


def sync(engine, weights, version):
    engine.update_weights(weights, version, {n: payload_digest(p) for n, p in weights.items()})
    audit = engine.last_audit
    print(f"       sync v{version}: {audit}")
    check(audit.get("weight_version_ok", True) is not False, f"v{version}: servers report weight_version {version}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", required=True, type=Path, help="NVFP4 ModelOpt export (hf_quant_config.json)")
    ap.add_argument("--scheme", default="w4a16", choices=["w4a4", "w4a16"])
    ap.add_argument("--colocated", action="store_true", help="in-process sglang.Engine instead of a server")
    ap.add_argument("--url", action="append", help="existing server URL(s); default: launch one")
    ap.add_argument("--port", type=int, default=30000, help="port of the launched server")
    ap.add_argument("--base-gpu-id", type=int, default=1, help="first GPU of the launched server")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--group-port", type=int, default=29600, help="weight-update rendezvous port")
    ap.add_argument("--num-linears", type=int, default=8, help="FP4 linears to sync")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--logprob-tol", type=float, default=1e-3)
    ap.add_argument("--output-dir", default="runs/sglang_smoke")
    a = ap.parse_args()

    routing = routing_of(a.model_path)
    urls = a.url or [f"http://127.0.0.1:{a.port}"]
    overrides = ["rollout.engine=sglang", "trace.enabled=false", f"rollout.scheme={a.scheme}",
                 f"rollout.sglang_model_path={a.model_path}", f"rollout.sglang_tp_size={a.tp}",
                 f"rollout.sglang_update_group_port={a.group_port}", f"run.output_dir={a.output_dir}",
                 "rollout.weight_sync_bucket_mb=64", f"r3.enabled={routing is not None}",
                 "rollout.placement=" + ("colocated" if a.colocated else "disaggregated"),
                 "rollout.sglang_server_urls=[" + ",".join(urls) + "]"]
    cfg = from_dict(apply_overrides({}, overrides))
    engine = build_sglang_engine(cfg, launch=not a.colocated and not a.url, base_gpu_id=a.base_gpu_id)
    engine.routing = routing  # the served checkpoint's layout, not the tiny default model config
    print("engine:", {k: v for k, v in engine.health().items() if k in ("sglang_version", "quantization", "scheme")})
    prompts = [[785, 6722, 315, 9625, 374], [16, 10, 16, 28], [40, 107, 264]]  # ids < 1000 fit any vocab
    try:
        checksums = getattr(engine.backend, "checksums", None)  # disaggregated: the release's weight checksum
        loaded = checksums() if checksums else None
        base = run_greedy(engine, prompts, a.max_new_tokens)
        check_samples(base, routing, "step 1 generate")
        original = checkpoint_fp4_linears(a.model_path, a.num_linears)
        if not check(bool(original), "checkpoint has NVFP4 linears (weight, weight_scale, weight_scale_2)"):
            return len(FAILURES)
        flipped = {n: pack_weight(-p.dequantize(torch.float32), "nvfp4") for n, p in original.items()}
        sync(engine, flipped, 1)
        changed = run_greedy(engine, prompts, a.max_new_tokens)
        check(any(c.tokens != b.tokens or not torch.allclose(c.logprobs, b.logprobs, atol=a.logprob_tol)
                  for c, b in zip(changed, base)), "step 2: outputs change after syncing negated weights")
        sync(engine, original, 2)
        if loaded is not None:
            check(checksums() == loaded, "step 3: /weights_checker checksum equals the freshly loaded checkpoint's",
                  f"{checksums()} vs {loaded}")
        restored = run_greedy(engine, prompts, a.max_new_tokens)
        for i, (r, b) in enumerate(zip(restored, base)):
            check(r.tokens == b.tokens and torch.allclose(r.logprobs, b.logprobs, atol=a.logprob_tol),
                  f"step 3: sample {i} equals the checkpoint's outputs after re-syncing its bytes",
                  f"tokens {r.tokens} vs {b.tokens}")
        if a.colocated:
            engine.release_memory()
            engine.resume_memory()
            again = run_greedy(engine, prompts, a.max_new_tokens)
            check(all(x.tokens == b.tokens for x, b in zip(again, base)), "step 4: release/resume keeps the weights")
    finally:
        engine.shutdown()
    print(f"{len(FAILURES)} failure(s)" + (": " + "; ".join(FAILURES) if FAILURES else ""))
    return len(FAILURES)


if __name__ == "__main__":
    sys.exit(main())
