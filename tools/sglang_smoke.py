"""End-to-end check of the SGLang adapter on a GPU node with sglang==0.5.15.post1 installed.

Not run in this project's CI (SGLang has no CPU build); see docs/sglang.md for when and how to run it.

    # disaggregated: the script launches one server on GPU 1 and is the trainer end (NCCL) on GPU 0
    python tools/sglang_smoke.py --model-path /ckpt/qwen3-30b-a3b-nvfp4 --scheme w4a16 --base-gpu-id 1
    # against servers you started yourself (launch_server with the flags docs/sglang.md lists)
    python tools/sglang_smoke.py --model-path /ckpt/... --url http://127.0.0.1:30000 --scheme w4a4
    # colocated: in-process sglang.Engine on GPU 0 (also checks release/resume_memory_occupation)
    python tools/sglang_smoke.py --model-path /ckpt/... --colocated --scheme w4a16

Steps (each prints PASS/FAIL; the exit code is the number of failures). The synced tensors are every NVFP4 tensor
of the checkpoint's first --num-layers decoder layers (whole layers: the FP4 reload re-processes a layer from the
tensors it receives, so an update must send all of them; docs/sglang.md):
 1. generate greedily with log-probs (+ routed experts for MoE checkpoints): shapes, finite log-probs <= 0,
    expert ids in range, finish reasons; record the release's weight checksum (/weights_checker, disaggregated);
 2. v1, the checkpoint's own bytes: checksum equal to the freshly loaded one, greedy outputs equal to step 1's;
 3. v2, the same tensors re-quantized by OUR codec from their negated values: checksum and outputs change,
    every server reports weight_version 2;
 4. v3, the checkpoint's own bytes again: checksum and outputs equal step 1's;
 5. v4, the identical bytes once more: checksum unchanged (a re-sync is idempotent);
 6. colocated only: release + resume memory, then step 1's outputs again (in-process there is no checksum: the
    greedy outputs are the check).
Steps 2-5 fail on a release / kernel path whose updates leave FP4 layers stale or garbled, e.g. if the FP4 reload
loaders (custom_loader.py) were not registered or not run.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_qrl.config import apply_overrides, from_dict  # noqa: E402
from megatron_qrl.quant import FP4Tensor, pack_weight, payload_digest  # noqa: E402
from megatron_qrl.rollout import SamplingParams  # noqa: E402
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


def layer_of(name: str):
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit() else None


def checkpoint_fp4_layers(model_path: Path, num_layers: int) -> dict[str, FP4Tensor]:
    """Every NVFP4 linear of the first `num_layers` decoder layers of a ModelOpt export (whole layers: all q/k/v/o
    parts and all experts), as FP4Tensors of the checkpoint's bytes. A linear's tensors may sit in different shards."""
    from safetensors import safe_open

    where = {}
    for shard in sorted(model_path.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            where.update({k: shard for k in f.keys()})

    def tensor(key):
        with safe_open(str(where[key]), framework="pt") as f:
            return f.get_tensor(key)

    out: dict[str, FP4Tensor] = {}
    for key in sorted(k for k in where if k.endswith(".weight_scale_2")):
        base = key[: -len(".weight_scale_2")]
        layer = layer_of(base)
        if layer is not None and layer < num_layers and {base + ".weight", base + ".weight_scale"} <= where.keys():
            out[base + ".weight"] = FP4Tensor("nvfp4", tensor(base + ".weight"), tensor(base + ".weight_scale"),
                                              tensor(key).float().reshape(()))
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
    ap.add_argument("--num-layers", type=int, default=1, help="decoder layers whose FP4 tensors are synced")
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
        original = checkpoint_fp4_layers(a.model_path, a.num_layers)
        if not check(bool(original), f"the first {a.num_layers} layer(s) have NVFP4 linears (weight, weight_scale, "
                                     "weight_scale_2)"):
            return len(FAILURES)
        print(f"       syncing {len(original)} NVFP4 linears of {a.num_layers} layer(s)")
        flipped = {n: pack_weight(-p.dequantize(torch.float32), "nvfp4") for n, p in original.items()}

        def follows(step: str, weights, version: int, expect_original: bool) -> None:
            """Sync, then the checksum and greedy outputs must be the loaded checkpoint's iff expect_original."""
            sync(engine, weights, version)
            if loaded is not None:
                now = checksums()
                check((now == loaded) == expect_original, f"{step}: /weights_checker checksum "
                      + ("equals" if expect_original else "differs from") + " the freshly loaded checkpoint's",
                      f"{now} vs {loaded}")
            out = run_greedy(engine, prompts, a.max_new_tokens)
            same = [o.tokens == b.tokens and torch.allclose(o.logprobs, b.logprobs, atol=a.logprob_tol)
                    for o, b in zip(out, base)]
            if expect_original:
                for i, (ok, o, b) in enumerate(zip(same, out, base)):
                    check(ok, f"{step}: sample {i} equals the checkpoint's greedy output", f"{o.tokens} vs {b.tokens}")
            else:
                check(not all(same), f"{step}: greedy outputs change")

        follows("step 2 (own bytes)", original, 1, True)
        follows("step 3 (negated)", flipped, 2, False)
        follows("step 4 (own bytes again)", original, 3, True)
        before = checksums() if checksums else None
        sync(engine, original, 4)
        if before is not None:
            check(checksums() == before, "step 5: an identical re-sync leaves the checksum unchanged")
        if a.colocated:
            engine.release_memory()
            engine.resume_memory()
            again = run_greedy(engine, prompts, a.max_new_tokens)
            check(all(x.tokens == b.tokens for x, b in zip(again, base)), "step 6: release/resume keeps the weights")
    finally:
        engine.shutdown()
    print(f"{len(FAILURES)} failure(s)" + (": " + "; ".join(FAILURES) if FAILURES else ""))
    return len(FAILURES)


if __name__ == "__main__":
    sys.exit(main())
