"""Trainer memory of QeRL mode: full fine-tuning vs LoRA on a bf16 base vs LoRA on a packed NVFP4 base.

    python tools/bench_lora_memory.py [--config configs/single_h200.yaml] [--batch B] [--seq-len T]
                                      [--rank R] [--out result.json] [overrides ...]
    python tools/bench_lora_memory.py --tiny          # CPU smoke run of the same code at toy size

Each mode runs in its own subprocess (a fresh CUDA context, so each peak is clean), on the same config, batch
and seed; every mode has quant.qat=false (no QAT fake-quant caches), so only the weight storage and what
trains differ:
    full       every parameter trains: bf16 weights + fp32 grads + Adam (Megatron's optimizer)
    lora_bf16  lora.base_format=bf16: frozen bf16 base, adapters train
    lora_nvfp4 lora.base_format=nvfp4: frozen base packed (uint8 codes + E4M3 scales), adapters train
Per mode: build the Trainer, then one train_step (random tokens [B, T], a token-mean loss over all positions).
Reported: `static` = memory allocated after the step (weights/buffers, grads, optimizer state: what stays
resident), `build_peak` / `step_peak` = torch.cuda.max_memory_allocated during the build / the step (reset
in between; `peak` = the larger, the trainer's peak), all minus what was allocated before, the bytes of parameters and buffers, the
trainable parameter count. On CPU (--tiny or no GPU) only the tensor byte counts are measured (no allocator).
Prints a markdown table and the ratios against full fine-tuning and LoRA-on-bf16.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = ["quant.qat=false", "trace.enabled=false", "rollout.scheme=w4a16", "aqn.enabled=false"]
MODES = {  # the packed mode first: it compiles the W4A16 kernels, the riskiest part of a one-shot GPU run
    "lora_nvfp4": ["lora.enabled=true", "lora.base_format=nvfp4", "rollout.weights=nvfp4"],
    "lora_bf16": ["lora.enabled=true", "lora.base_format=bf16", "rollout.weights=bf16"],
    "full": ["lora.enabled=false"],
}
TINY = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.num_query_groups=2",
        "model.num_experts=4", "model.moe_ffn_hidden_size=64", "model.vocab_size=64", "model.max_sequence_length=64",
        "rollout.max_new_tokens=8", "trace.num_cached_layers=null", "trainer.bf16=false", "trainer.use_distributed_optimizer=false"]
GIB = 2 ** 30
MIB = 2 ** 20


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def run_mode(args) -> dict:
    """Child process: one mode, one train step; prints one JSON line."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from megatron_qrl.config import load_config
    from megatron_qrl.trainer import Trainer

    cfg = load_config(args.config, args.overrides + COMMON + MODES[args.mode] + [f"lora.rank={args.rank}"])
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    trainer = Trainer(cfg)
    model = trainer.unwrapped[0]
    if cuda:
        torch.cuda.synchronize()
        after_build = torch.cuda.memory_allocated() - base
        build_peak = torch.cuda.max_memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (args.batch, args.seq_len), generator=g)
    mask = torch.ones(args.batch, args.seq_len)
    mask[:, 0] = 0

    def loss_fn(logp, mb):
        return -(logp * mb["loss_mask"]).sum() / mb["num_global_tokens"], {}

    stats = trainer.train_step({"tokens": tokens, "loss_mask": mask}, loss_fn)
    out = {"mode": args.mode, "device": torch.cuda.get_device_name() if cuda else "cpu",
           "param_bytes": _bytes(model.parameters()), "buffer_bytes": _bytes(model.buffers()),
           "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
           "total_params": sum(p.numel() for p in model.parameters()), "loss": stats.get("loss"),
           "kernels": os.environ.get("QRL_KERNELS", "auto")}
    if cuda:
        torch.cuda.synchronize()
        out.update(build_peak=build_peak, after_build=after_build, static=torch.cuda.memory_allocated() - base,
                   step_peak=torch.cuda.max_memory_allocated() - base)
        out["peak"] = max(build_peak, out["step_peak"])
    print("RESULT " + json.dumps(out), flush=True)
    return out


def spawn(mode: str, args, env_extra=None) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--batch", str(args.batch), "--seq-len",
           str(args.seq_len), "--rank", str(args.rank)] + (["--config", args.config] if args.config else [])
    cmd += args.overrides
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env_extra or {})}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"mode {mode} failed (rc {r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def table(results: dict) -> str:
    order = ["full", "lora_bf16", "lora_nvfp4"]
    results = dict(sorted(results.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else 9))
    cuda = any("peak" in r for r in results.values())
    cols = ["mode", "trainable params", "param bytes", "buffer bytes"] + (
        ["after build GiB", "static GiB", "build peak GiB", "step peak GiB"] if cuda else [])
    rows = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for m, r in results.items():
        row = [m, f"{r['trainable']:,}", f"{r['param_bytes'] / MIB:,.1f} MiB", f"{r['buffer_bytes'] / MIB:,.1f} MiB"]
        if cuda:
            row += [f"{r['after_build'] / GIB:.2f}", f"{r['static'] / GIB:.2f}", f"{r['build_peak'] / GIB:.2f}",
                    f"{r['step_peak'] / GIB:.2f}"]
        rows.append("| " + " | ".join(row) + " |")
    key = "peak" if cuda else "param_bytes"
    lines = ["\n".join(rows), ""]
    if {"full", "lora_nvfp4", "lora_bf16"} <= set(results):
        f, b, n = (results[m] for m in ("full", "lora_bf16", "lora_nvfp4"))
        lines.append(f"{key}: lora_nvfp4 / full = {n[key] / f[key]:.3f}, lora_nvfp4 / lora_bf16 = "
                     f"{n[key] / b[key]:.3f}, lora_bf16 / full = {b[key] / f[key]:.3f}")
        if cuda:
            lines.append(f"static: lora_nvfp4 / full = {n['static'] / f['static']:.3f}, lora_nvfp4 / lora_bf16 = "
                         f"{n['static'] / b['static']:.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=None)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run at toy size")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--out", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    if args.tiny:
        args.config = args.config or os.path.join(ROOT, "configs/tiny_cpu.yaml")
        args.overrides = TINY + args.overrides
        args.batch, args.seq_len, args.rank = 2, 32, 4
    elif args.config is None:
        args.config = os.path.join(ROOT, "configs/single_h200.yaml")
    if args.child:
        args.mode = args.child
        run_mode(args)
        return 0
    results = {}
    for mode in args.modes.split(","):
        try:
            results[mode] = spawn(mode, args)
        except RuntimeError as e:
            if mode != "lora_nvfp4":
                raise
            # one retry without the Triton W4A16 forward (dequantize + matmul): same memory model
            print(f"{e}\nretrying {mode} with QRL_KERNELS=torch", file=sys.stderr)
            results[mode] = spawn(mode, args, {"QRL_KERNELS": "torch"})
        print(json.dumps(results[mode]), flush=True)
        if args.out:
            tmp = args.out + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"args": vars(args), "results": results}, f, indent=1)
            os.replace(tmp, args.out)
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
