"""Trainer step cost of FP4 QAT: Megatron-Core train_step with quant.qat=true vs quant.qat=false.

    python tools/bench_trainer.py [--config configs/single_h200.yaml] [--device auto|cpu|cuda]
                                  [--global-batch B] [--seq-len T] [--warmup W] [--steps N]
                                  [--time-budget S] [--modes on,off] [--isolate] [--out result.json]
                                  [overrides ...]          # e.g. trainer.micro_batch_size=8
    python tools/bench_trainer.py --smoke [--config configs/tiny_cpu.yaml]   # correctness smoke, no timing

Modes (same config, same random batch, same seed, so the same initial weights):
    on   quant.qat=true  with the config's quant.format / targets / scheme (default nvfp4, routed_experts, w4a4)
    off  quant.qat=false (every linear is a plain Megatron GEMM)
    on-nosync  (diagnostic, opt-in) `on` with the codec's input check minus its finiteness test, which
         reads bool(isfinite(x).all()) back from the GPU, i.e. one host-device synchronisation per quantized
         tensor per forward; the difference on-nosync vs on is what that sync costs
    suffixes (opt-in, combinable): -seq  the per-expert reference experts (trainer.moe_experts=sequential, the
         path before the grouped experts), e.g. on-seq / off-seq; -mbN  trainer.micro_batch_size=N, e.g. off-seq-mb4
Extras of every grouped `on` mode (--extras, default trace,sync): `trace` -- a log-prob pass with TRACE guides
(a cache of the trainer's own forward on the cached layers, device guides indexed in the timed pass) against
the same pass without, both with R3 replay of random expert ids; `sync` -- the weight-sync payload (pack +
digest on the device, the QAT quantizer's expert bytes reused) after an optimizer step, the engine's digest
re-check, and the previous path (pack_weight per tensor + SHA-256 over host bytes). tools/trainer_costs.py
also gives the FLOP count behind the MFU column (see its docstring).
Both modes run IN ONE PROCESS, one after the other: `Trainer(cfg)` calls `init_distributed`, which keeps
torch.distributed and re-creates Megatron's model-parallel groups (`platform.set_layout`), so the first
trainer is dropped (gc + CUDA cache emptied, checked with a weak reference) and the second one is built in
the same process. `--isolate` instead launches one subprocess per mode (fresh CUDA context and allocator).

Per mode: build the Trainer, one `logprobs` pass over the batch (gives logp_old, as the RL loop does), W
warm-up `train_step`s, then N timed `train_step`s, each bracketed by torch.cuda.synchronize + perf_counter
(the median is reported; also the min and this process's CPU time), then one warm timed `logprobs` pass
(skipped under --time-budget when it would not fit; the first, cold pass is then reported).
Loss: the project's clipped GRPO objective (`megatron_qrl.rl.policy_loss`) as a global token mean
(sum over micro-batches = mean over the batch's loss tokens) with random per-sample advantages.
Batch: random token ids [B, T]; loss_mask 0 on a T/4 prompt and on a random right padding of each row
(tokens/s counts all B*T positions, since every position is computed).
Memory: CUDA -> torch.cuda.max_memory_allocated over the timed steps (reset after the warm-up) and the
memory allocated between steps (params, grads, optimizer state), both minus what was allocated before the
trainer was built; CPU -> the process's current RSS after the timed steps and its lifetime peak RSS
(ru_maxrss, which includes earlier modes), labelled as such.
Defaults: B = min(64, rollout.prompts_per_step * rollout.group_size), T = min(512,
model.max_sequence_length), on CPU trainer.bf16/use_distributed_optimizer are turned off (Megatron's
mixed-precision optimizers need CUDA). --time-budget caps the number of timed steps (never below 2) so
the whole benchmark fits. Prints a markdown table and the ratios measured in the run: QAT-on / QAT-off
(target <= 1.25), grouped vs per-expert, log-probs with TRACE / without (target <= 1.3), sync vs 0.15 s;
writes JSON to --out (after each mode, so a killed run keeps what finished). Runs under torchrun too
(every rank builds the same batch; rank 0 prints and writes).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import weakref

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trainer_costs import flops_per_token, peak_tflops, random_r3_ids, sync_cost, trace_logprobs  # noqa: E402

TARGET_RATIO = 1.25
MODES = {"on": "quant.qat=true", "off": "quant.qat=false",
         # diagnostic (opt-in): QAT on without the codec's per-call finiteness check, which reads a flag back
         # from the GPU (bool(torch.isfinite(x).all())) and so synchronises host and device on every quantize
         "on-nosync": "quant.qat=true"}
TARGET_TRACE_RATIO = 1.3
TARGET_TOKENS_PER_S = 45_000     # 10x the 4,571 of the per-expert trainer on single_h200 (docs/PERF.md)


def mode_overrides(mode: str) -> list[str]:
    """Config overrides of a mode name: base (off / on / on-nosync) plus optional -seq and -mbN suffixes."""
    parts = mode.split("-")
    base, rest = parts[0], parts[1:]
    if base == "on" and rest[:1] == ["nosync"]:
        base, rest = "on-nosync", rest[1:]
    if base not in MODES:
        raise ValueError(f"unknown mode '{mode}': use off / on / on-nosync with optional -seq and -mbN suffixes")
    out = [MODES[base]]
    for r in rest:
        if r == "seq":
            out.append("trainer.moe_experts=sequential")
        elif r.startswith("mb") and r[2:].isdigit():
            out.append(f"trainer.micro_batch_size={int(r[2:])}")
        else:
            raise ValueError(f"unknown mode suffix '-{r}' in '{mode}': use -seq or -mbN")
    return out


def mode_base(mode: str) -> str:
    return "on-nosync" if mode.startswith("on-nosync") else mode.split("-")[0]


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None,
                   help="YAML config (default configs/single_h200.yaml; configs/tiny_cpu.yaml with --smoke)")
    p.add_argument("--device", default=os.environ.get("QRL_BENCH_DEVICE", "auto"), choices=["auto", "cpu", "cuda"],
                   help="cpu hides the GPU (CUDA_VISIBLE_DEVICES=''); default $QRL_BENCH_DEVICE or auto")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step (B)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (T)")
    p.add_argument("--warmup", type=int, default=2, help="untimed train steps per mode")
    p.add_argument("--steps", type=int, default=5, help="timed train steps per mode")
    p.add_argument("--time-budget", type=float, default=0.0,
                   help="seconds for the whole benchmark; fewer timed steps (>= 2) when the warm-up says they "
                        "won't fit (0 = no cap)")
    p.add_argument("--modes", default="off,on",
                   help="comma list of off/on/on-nosync (+ -seq, -mbN suffixes), run in this order (default off first: "
                        "the cheap baseline is kept even if the QAT mode runs out of time)")
    p.add_argument("--extras", default="trace,sync",
                   help="measurements added to grouped QAT-on modes: trace (log-probs with/without TRACE), sync "
                        "(weight-sync pack + digest); '' for none")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak bf16 TFLOP/s for MFU (default: 989 on an H100/H200, none elsewhere)")
    p.add_argument("--isolate", action="store_true", help="one subprocess per mode instead of one process")
    p.add_argument("--smoke", action="store_true",
                   help="correctness smoke of the trainer (logprobs == loss, loss falls, finite grads); no timing")
    p.add_argument("--out", default=None, help="JSON file (a directory gets bench_trainer.json)")
    p.add_argument("--seed", type=int, default=0, help="batch seed")
    p.add_argument("overrides", nargs="*", help="config overrides section.field=value")
    a = p.parse_args(argv)
    if a.config is None:
        a.config = "configs/tiny_cpu.yaml" if a.smoke else "configs/single_h200.yaml"
    return a


# ----------------------------------------------------------------------------------------------- helpers
def _log(msg: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(msg, flush=True)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _maxrss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _gib(x) -> float:
    return float(x) / 2 ** 30


def _out_path(out: str | None) -> str | None:
    if not out:
        return None
    if out.endswith(os.sep) or os.path.isdir(out):
        os.makedirs(out, exist_ok=True)
        return os.path.join(out, "bench_trainer.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    return out


def _write(path: str | None, res: dict) -> None:
    if path and int(os.environ.get("RANK", "0")) == 0:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f, indent=2, default=str)
        os.replace(tmp, path)


def load_cfg(a, extra: list[str], device_type: str):
    """The config with the CLI overrides, plus what the device needs (CPU: fp32, non-distributed optimizer)."""
    from megatron_qrl.config import load_config

    path = a.config if os.path.isabs(a.config) or os.path.exists(a.config) else os.path.join(ROOT, a.config)
    cfg = load_config(path, [*a.overrides, *extra])
    forced = []
    if device_type == "cpu" and cfg.trainer.bf16:
        forced += ["trainer.bf16=false", "trainer.use_distributed_optimizer=false"]
    if forced:
        cfg = load_config(path, [*a.overrides, *extra, *forced])
    return cfg, forced


def make_batch(cfg, B: int, T: int, seed: int) -> dict:
    """Random GRPO-shaped batch: tokens, loss_mask (prompt T/4 and random right padding masked), advantages."""
    import torch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.model.vocab_size, (B, T), generator=g)
    prompt = max(1, T // 4)
    lengths = torch.randint(max(1, (T - prompt) // 2), T - prompt + 1, (B,), generator=g)
    pos = torch.arange(T).expand(B, T)
    loss_mask = ((pos >= prompt) & (pos < prompt + lengths[:, None])).float()
    group = max(1, min(cfg.rollout.group_size, B))
    rewards = torch.randn(B, generator=g)
    adv = rewards.clone()
    for s in range(0, B, group):  # GRPO: standardise within each group of responses
        r = rewards[s:s + group]
        adv[s:s + group] = (r - r.mean()) / (r.std(unbiased=False) + 1e-6) if r.numel() > 1 else 0.0
    return {"tokens": tokens, "loss_mask": loss_mask, "advantages": adv}


def grpo_loss_fn(rl_cfg):
    """Clipped GRPO token mean over the global batch (the trainer sums it over micro-batches and ranks)."""
    from megatron_qrl.rl import policy_loss

    def loss_fn(logp_new, mb):
        loss, stats = policy_loss(logp_new, mb["logp_old"], mb["advantages"], mb["loss_mask"], None,
                                  rl_cfg.clip_low, rl_cfg.clip_high, num_tokens_global=mb["num_global_tokens"])
        return loss, {}

    return loss_fn


def sft_loss_fn(logp_new, mb):
    """-logp token mean over the global batch."""
    import torch

    mask = mb["loss_mask"]
    nll = -(torch.where(mask > 0, logp_new, torch.zeros_like(logp_new)) * mask).sum()
    return nll / max(float(mb["num_global_tokens"]), 1.0), {}


def qat_linears(trainer) -> int:
    from megatron_qrl.models.fp4_linear import fp4_linears

    return sum(1 for c in trainer.unwrapped for lin in fp4_linears(c) if lin.quant.enabled)


def _env(device) -> dict:
    import torch

    info = {"device": str(device), "torch": torch.__version__, "python": sys.version.split()[0]}
    try:
        from importlib.metadata import version

        info["megatron_core"] = version("megatron-core")
    except Exception:  # noqa: BLE001
        info["megatron_core"] = None
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    else:
        info["cpu_threads"] = torch.get_num_threads()
    return info


# ----------------------------------------------------------------------------------------------- one mode
def run_mode(a, mode: str, B: int, T: int, budget_s: float) -> dict:
    """Build a Trainer for `mode`, time its train steps, drop it; returns the mode's numbers."""
    import torch

    dev_type = "cuda" if torch.cuda.is_available() else "cpu"
    cfg, forced = load_cfg(a, mode_overrides(mode), dev_type)
    with _codec_checks(enabled=mode_base(mode) != "on-nosync"):
        return _run_mode(a, mode, cfg, forced, dev_type, B, T, budget_s)


class _codec_checks:
    """Context: with enabled=False the codec's input check skips its device->host finiteness read."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.saved = []

    def __enter__(self):
        if not self.enabled:
            from megatron_qrl.quant import mxfp4, nvfp4, validate

            def check_no_sync(x, block, where):
                if x.dim() == 0 or x.numel() == 0 or x.shape[-1] % block or x.dtype not in validate.SUPPORTED_DTYPES:
                    validate.check_input(x, block, where)  # the error path, with its message

            for mod in (nvfp4, mxfp4):
                self.saved.append((mod, mod.check_input))
                mod.check_input = check_no_sync
        return self

    def __exit__(self, *exc):
        for mod, fn in self.saved:
            mod.check_input = fn
        return False


def _run_mode(a, mode, cfg, forced, dev_type, B, T, budget_s) -> dict:
    import torch
    import torch.distributed as dist

    from megatron_qrl.platform import device as platform_device
    from megatron_qrl.trainer import Trainer

    t_mode = time.perf_counter()
    if dev_type == "cuda":
        dev = platform_device() if dist.is_initialized() else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        gc.collect()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    else:
        dev = torch.device("cpu")
        base = _rss_bytes()

    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    _sync(trainer.device)
    build_s = time.perf_counter() - t0
    dev = trainer.device
    n_params = sum(p.numel() for c in trainer.unwrapped for p in c.parameters())
    n_qat = qat_linears(trainer)
    q = cfg.quant
    _log(f"[{mode}] built in {build_s:.1f}s: {n_params / 1e6:.1f}M params on this rank, {n_qat} QAT linears "
         f"({q.format} {q.targets} {q.scheme}, qat={q.qat}), dtype "
         f"{next(trainer.unwrapped[0].parameters()).dtype}, micro_batch {cfg.trainer.micro_batch_size}")

    batch = make_batch(cfg, B, T, a.seed)
    t0 = time.perf_counter()
    logp_old = trainer.logprobs(batch)
    _sync(dev)
    first_logprobs_s = time.perf_counter() - t0
    batch["logp_old"] = logp_old.cpu()
    loss_fn = grpo_loss_fn(cfg.rl)

    def step():
        _sync(dev)
        t, c = time.perf_counter(), time.process_time()
        st = trainer.train_step(batch, loss_fn)
        _sync(dev)
        dt, dc = time.perf_counter() - t, time.process_time() - c
        if not (math.isfinite(st["loss"]) and math.isfinite(st["grad_norm"])):
            raise RuntimeError(f"[{mode}] non-finite train step: loss {st['loss']} grad_norm {st['grad_norm']}")
        return dt, dc, st

    _log(f"[{mode}] first logprobs pass {first_logprobs_s:.3f}s")
    warm = []
    for i in range(a.warmup):
        warm.append(step()[0])
        _log(f"[{mode}] warm-up step {i + 1}/{a.warmup}: {warm[-1]:.4f}s")
    _sync(dev)
    if dev.type == "cuda":
        static = torch.cuda.memory_allocated(dev) - base
        torch.cuda.reset_peak_memory_stats(dev)
    steps = a.steps
    if budget_s > 0:
        est = warm[-1] if warm else first_logprobs_s * 3
        left = budget_s - (time.perf_counter() - t_mode)
        steps = max(2, min(a.steps, int(left // max(est, 1e-9))))
        if steps < a.steps:
            _log(f"[{mode}] time budget: {steps} timed steps instead of {a.steps} (~{est:.2f}s each)")
    times, cpu, stats = [], [], []
    for i in range(steps):
        dt, dc, st = step()
        times.append(dt)
        cpu.append(dc)
        stats.append(st)
        _log(f"[{mode}] step {i + 1}/{steps}: {dt:.4f}s (CPU {dc:.4f}s) loss {st['loss']:.5f} "
             f"grad_norm {st['grad_norm']:.4f}")
    if dev.type == "cuda":
        peak_bytes = torch.cuda.max_memory_allocated(dev) - base
    else:
        rss_after = _rss_bytes()
    # a warm logprobs pass, when the budget leaves room for it (else the first, cold one is reported)
    logprobs_warm = budget_s <= 0 or (time.perf_counter() - t_mode) + first_logprobs_s < budget_s
    if logprobs_warm:
        t0 = time.perf_counter()
        trainer.logprobs(batch)
        _sync(dev)
        logprobs_s = time.perf_counter() - t0
    else:
        logprobs_s = first_logprobs_s

    extras = {}
    if mode_base(mode) == "on" and cfg.trainer.moe_experts == "grouped":
        extras = _extras(a, trainer, cfg, batch, B, T, mode)
    med = statistics.median(times)
    loss_tokens = float(batch["loss_mask"].sum())
    res = {
        "mode": mode, "quant": {"qat": q.qat, "format": q.format, "targets": q.targets, "scheme": q.scheme},
        "forced_overrides": forced, "bf16": cfg.trainer.bf16,
        "distributed_optimizer": bool(cfg.trainer.use_distributed_optimizer and dev.type == "cuda"),
        "micro_batch_size": cfg.trainer.micro_batch_size, "num_micro_batches": stats[-1]["num_micro_batches"],
        "params_this_rank": n_params, "qat_linears": n_qat, "build_s": build_s,
        "first_logprobs_s": first_logprobs_s, "warmup_step_s": warm, "steps": steps,
        "step_s_median": med, "step_s_min": min(times), "step_s_all": times,
        "cpu_s_median": statistics.median(cpu), "tokens_per_s": B * T / med, "loss_tokens_per_s": loss_tokens / med,
        "logprobs_s": logprobs_s, "logprobs_warm": logprobs_warm, "losses": [s["loss"] for s in stats], "grad_norms": [s["grad_norm"] for s in stats],
        "moe_experts": cfg.trainer.moe_experts, **extras,
    }
    flops = flops_per_token(cfg, T)
    tflops = peak_tflops(torch.cuda.get_device_name(dev) if dev.type == "cuda" else None, a.peak_tflops)
    res.update(flops_per_token=flops, peak_tflops=tflops,
               mfu=(B * T / med) * flops["train"] / (tflops * 1e12) if tflops else None,
               logprobs_mfu=(B * T / logprobs_s) * flops["forward"] / (tflops * 1e12) if tflops else None)
    if dev.type == "cuda":
        res.update(memory_kind="cuda_allocated", peak_mem_gib=_gib(peak_bytes), static_mem_gib=_gib(static),
                   peak_reserved_gib=_gib(torch.cuda.max_memory_reserved(dev)),
                   mem_before_build_gib=_gib(base),
                   peak_mem_gib_max_rank=_max_over_ranks(_gib(peak_bytes), dev))
    else:
        res.update(memory_kind="cpu_rss", rss_after_steps_gib=_gib(rss_after), rss_before_build_gib=_gib(base),
                   peak_rss_process_gib=_gib(_maxrss_bytes()))

    # drop the trainer (and check that it is really gone before the next mode is built)
    ref = weakref.ref(trainer.unwrapped[0])
    res["graph_refs_dropped"] = drop_graph_refs(trainer)
    trainer = batch = logp_old = stats = None  # (the step() closure shares these cells)
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        res["mem_after_teardown_gib"] = _gib(torch.cuda.memory_allocated(dev))
    res["freed"] = ref() is None
    res["mode_wall_s"] = time.perf_counter() - t_mode
    return res


def _extras(a, trainer, cfg, batch, B, T, mode) -> dict:
    """The --extras measurements of a grouped QAT-on mode; a failure is recorded, the mode's numbers kept."""
    import traceback

    wanted = {x.strip() for x in a.extras.split(",") if x.strip()}
    out = {}
    if "trace" in wanted:
        try:
            if not (cfg.quant.format == "nvfp4" and cfg.quant.scheme == "w4a4" and cfg.model.num_experts):
                raise ValueError("TRACE needs NVFP4 W4A4 QAT on an MoE model")
            rb = {**batch, "r3_expert_ids": random_r3_ids(cfg, B, T, a.seed)}
            out["trace"] = trace_logprobs(trainer, cfg, rb)
            t = out["trace"]
            _log(f"[{mode}] log-probs {t['logprobs_s']:.4f}s, with TRACE {t['logprobs_trace_s']:.4f}s "
                 f"({t['ratio']:.3f}x; code mismatch {t['code_mismatch_before']} -> {t['code_mismatch_after']}, "
                 f"fallback {t['guided_fallback']:.2e})")
        except Exception as e:  # noqa: BLE001 -- keep the mode's other numbers
            out["trace"] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            _log(f"[{mode}] trace extra failed: {out['trace']['error']}")
    if "sync" in wanted:
        try:
            out["sync"] = sync_cost(trainer, cfg)
            sc = out["sync"]
            _log(f"[{mode}] sync payload {sc['payload_mb']:.1f} MB: pack+digest {sc['pack_digest_s']:.4f}s "
                 f"(verify {sc['verify_s']:.4f}s), previous path {sc['old_total_s']:.4f}s ({sc['speedup']:.1f}x)")
        except Exception as e:  # noqa: BLE001
            out["sync"] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            _log(f"[{mode}] sync extra failed: {out['sync']['error']}")
    return out


def drop_graph_refs(trainer) -> int:
    """Detach tensors with autograd history that modules keep as attributes after a training forward.

    Megatron's MoEAlltoAllTokenDispatcher keeps `self.probs` (the router probabilities of the last micro-batch,
    with grad_fn) until the next forward. Its autograd graph reaches the parameters' grad accumulators, whose
    DDP hooks hold the DDP wrapper and so the model: a reference cycle through C++ that Python's gc cannot
    see, so a trainer dropped right after train_step is never freed (a following forward-only pass, e.g.
    logprobs, overwrites it). Detaching them lets gc free the trainer. Returns how many were detached.
    """
    import torch

    def detach_in(obj) -> int:
        n = 0
        for k, v in list(vars(obj).items()):
            if torch.is_tensor(v) and v.grad_fn is not None:
                obj.__dict__[k] = v.detach()
                n += 1
        return n

    n = 0
    for chunk in trainer.model:
        for m in chunk.modules():
            n += detach_in(m)
            for v in list(vars(m).values()):  # helpers that are not modules (token dispatchers, ...)
                if (hasattr(v, "__dict__") and not isinstance(v, (torch.nn.Module, type)) and not callable(v)
                        and type(v).__module__.startswith(("megatron", "megatron_qrl"))):
                    n += detach_in(v)
    return n


def _max_over_ranks(x: float, dev) -> float:
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return x
    t = torch.tensor([x], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


# ----------------------------------------------------------------------------------------------- report
def table(res: dict) -> str:
    modes = res["modes"]
    cuda = any(m.get("memory_kind") == "cuda_allocated" for m in modes.values())
    mem_hdr = "peak mem GiB | static mem GiB" if cuda else "RSS after steps GiB | peak RSS (process) GiB"
    lines = [f"| mode | QAT | experts | mb | step s (median) | min | CPU s | tokens/s | MFU | logprobs s | {mem_hdr} "
             "| steps | build s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in modes.items():
        q = m["quant"]
        qs = f"{q['format']} {q['targets']} {q['scheme']}" if q["qat"] else "off"
        mem = (f"{m['peak_mem_gib']:.2f} | {m['static_mem_gib']:.2f}" if m.get("memory_kind") == "cuda_allocated"
               else f"{m['rss_after_steps_gib']:.2f} | {m['peak_rss_process_gib']:.2f}")
        mfu = f"{100 * m['mfu']:.1f}%" if m.get("mfu") else "-"
        lines.append(f"| {name} | {qs} | {m.get('moe_experts', '-')} | {m.get('micro_batch_size', '-')} | "
                     f"{m['step_s_median']:.4f} | {m['step_s_min']:.4f} | {m['cpu_s_median']:.4f} | "
                     f"{m['tokens_per_s']:,.0f} | {mfu} | {m['logprobs_s']:.4f} | {mem} | {m['steps']} | "
                     f"{m['build_s']:.1f} |")
    r = res.get("ratio")
    if r:
        lines.append("")
        lines.append(f"QAT on / off step time: {r['step_time']:.3f}x (min {r['step_time_min']:.3f}x, CPU time "
                     f"{r['cpu_time']:.3f}x); target <= {TARGET_RATIO}: {'PASS' if r['meets_target'] else 'FAIL'}"
                     + (f"; peak memory {r['peak_mem']:.3f}x" if r.get("peak_mem") else "")
                     + (f"; without the codec's finiteness sync {r['step_time_nosync']:.3f}x"
                        if r.get("step_time_nosync") else ""))
    for key, text in (("grouped_vs_seq_off", "QAT off: grouped experts vs per-expert step time"),
                      ("grouped_vs_seq_on", "QAT on: grouped experts vs per-expert step time"),
                      ("seq_step_time", "per-expert experts: QAT on / off step time")):
        if r and r.get(key):
            lines.append(f"{text}: {r[key]:.3f}x")
    if r and r.get("tokens_per_s_off"):
        lines.append(f"QAT-off tokens/s {r['tokens_per_s_off']:,.0f} (target >= {TARGET_TOKENS_PER_S:,}: "
                     f"{'PASS' if r['tokens_per_s_off'] >= TARGET_TOKENS_PER_S else 'FAIL'}; "
                     f"{r['tokens_per_s_off'] / 4571:.1f}x the per-expert trainer's 4,571 of docs/PERF.md)")
    for name, m in modes.items():
        t, sc = m.get("trace"), m.get("sync")
        if t and "ratio" in t:
            lines.append(f"[{name}] log-probs with TRACE / without: {t['ratio']:.3f}x ({t['logprobs_trace_s']:.4f}s "
                         f"vs {t['logprobs_s']:.4f}s, cached layers {t['cached_layers']}); target <= "
                         f"{TARGET_TRACE_RATIO}: {'PASS' if t['ratio'] <= TARGET_TRACE_RATIO else 'FAIL'}; code "
                         f"mismatch {t['code_mismatch_before']} -> {t['code_mismatch_after']}, fallback "
                         f"{t['guided_fallback']:.2e}")
        elif t:
            lines.append(f"[{name}] TRACE extra failed: {t.get('error')}")
        if sc and "pack_digest_s" in sc:
            lines.append(f"[{name}] weight sync {sc['payload_mb']:.1f} MB: pack+digest {sc['pack_digest_s']:.4f}s "
                         f"(target <= {sc['target_s']}: {'PASS' if sc['meets_target'] else 'FAIL'}), engine re-check "
                         f"{sc['verify_s']:.4f}s; previous path {sc['old_total_s']:.4f}s (pack "
                         f"{sc['old_pack_s']:.4f}s + sha256 {sc['old_sha256_s']:.4f}s): {sc['speedup']:.1f}x")
        elif sc:
            lines.append(f"[{name}] sync extra failed: {sc.get('error')}")
    mm = next(iter(modes.values()), None)
    if mm and mm.get("flops_per_token"):
        f = mm["flops_per_token"]
        lines.append(f"MFU: train FLOPs/token {f['train'] / 1e9:.3f} G (3 x forward {f['forward'] / 1e9:.3f} G: "
                     f"2 x {f['active_matmul_params'] / 1e6:.1f}M active matmul params + causal attention) / peak "
                     f"{mm.get('peak_tflops')} TFLOP/s bf16")
    return "\n".join(lines)


def add_ratio(res: dict) -> None:
    m = res["modes"]
    if "on" in m and "off" in m:
        on, off = m["on"], m["off"]
        r = {"step_time": on["step_s_median"] / off["step_s_median"],
             "step_time_min": on["step_s_min"] / off["step_s_min"],
             "cpu_time": on["cpu_s_median"] / off["cpu_s_median"],
             "logprobs": on["logprobs_s"] / off["logprobs_s"]}
        if on.get("peak_mem_gib") and off.get("peak_mem_gib"):
            r["peak_mem"] = on["peak_mem_gib"] / off["peak_mem_gib"]
        r["meets_target"] = r["step_time"] <= TARGET_RATIO
        if "on-nosync" in m:
            r["step_time_nosync"] = m["on-nosync"]["step_s_median"] / off["step_s_median"]
        r["tokens_per_s_off"] = off["tokens_per_s"]
        res["ratio"] = r
    r = res.get("ratio", {})
    for a, b, key in (("off-seq", "off", "grouped_vs_seq_off"), ("on-seq", "on", "grouped_vs_seq_on"),
                      ("on-seq", "off-seq", "seq_step_time")):
        if a in m and b in m:   # grouped_vs_seq_*: how many times faster the grouped step is
            r[key] = m[a]["step_s_median"] / m[b]["step_s_median"]
    if r:
        res["ratio"] = r


# ----------------------------------------------------------------------------------------------- drivers
def _shape(a, cfg) -> tuple[int, int]:
    B = a.global_batch or min(64, cfg.rollout.prompts_per_step * cfg.rollout.group_size)
    T = a.seq_len or min(512, cfg.model.max_sequence_length)
    if T > cfg.model.max_sequence_length:
        raise SystemExit(f"--seq-len {T} exceeds model.max_sequence_length {cfg.model.max_sequence_length}")
    return B, T


def bench(a) -> dict:
    import torch

    from megatron_qrl.platform import teardown

    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = []
    for m in modes:
        try:
            mode_overrides(m)
        except ValueError:
            bad.append(m)
    if bad or not modes:
        raise SystemExit(f"--modes: unknown {bad}; use {', '.join(MODES)} with optional -seq / -mbN suffixes")
    dev_type = "cuda" if torch.cuda.is_available() else "cpu"
    cfg, forced = load_cfg(a, [], dev_type)
    B, T = _shape(a, cfg)
    out = _out_path(a.out)
    res = {"config": a.config, "overrides": a.overrides, "forced_overrides": forced,
           "global_batch": B, "seq_len": T, "tokens_per_step": B * T, "warmup": a.warmup, "steps": a.steps,
           "target_ratio": TARGET_RATIO, "same_process": not a.isolate,
           "loss": "GRPO clipped surrogate, global token mean (megatron_qrl.rl.policy_loss)", "modes": {}}
    res.update(_env(torch.device(dev_type)))
    m = cfg.model
    _log(f"bench_trainer: {a.config} {' '.join(a.overrides)} | {m.num_layers} layers, hidden {m.hidden_size}, "
         f"{m.num_experts} experts top-{m.moe_router_topk} (ffn {m.moe_ffn_hidden_size}), vocab {m.vocab_size} | "
         f"B={B} T={T} ({B * T} tokens/step) | {dev_type}" + (f" | forced: {' '.join(forced)}" if forced else ""))
    t_start = time.perf_counter()
    for i, mode in enumerate(modes):
        left = a.time_budget - (time.perf_counter() - t_start) if a.time_budget > 0 else 0.0
        share = max(left / (len(modes) - i), 1e-6) if a.time_budget > 0 else 0.0  # spent budget: minimum steps
        if mode_base(mode) == "on-nosync" and a.time_budget > 0 and "on" in res["modes"] \
                and res["modes"]["on"]["mode_wall_s"] > left:
            _log(f"[{mode}] skipped: {left:.0f}s of the time budget left, the 'on' mode took "
                 f"{res['modes']['on']['mode_wall_s']:.0f}s")
            res.setdefault("skipped", []).append(mode)
            continue
        try:
            if a.isolate:
                res["modes"][mode] = _run_child(a, mode, B, T, share)
            else:
                res["modes"][mode] = run_mode(a, mode, B, T, share)
        except Exception as e:  # noqa: BLE001 -- record it and run the other modes (their numbers count)
            import traceback

            res.setdefault("failed", {})[mode] = {"error": f"{type(e).__name__}: {e}",
                                                  "traceback": traceback.format_exc()[-4000:]}
            _log(f"[{mode}] FAILED: {type(e).__name__}: {e}")
            _write(out, res)
            gc.collect()
            if dev_type == "cuda":
                torch.cuda.empty_cache()
            continue
        mm = res["modes"][mode]
        _log(f"[{mode}] median step {mm['step_s_median']:.4f}s over {mm['steps']} steps, "
             f"{mm['tokens_per_s']:,.0f} tokens/s, freed={mm['freed']}")
        add_ratio(res)
        _write(out, res)
    if not a.isolate:
        teardown()
    res["wall_s"] = time.perf_counter() - t_start
    add_ratio(res)
    _write(out, res)
    _log("\n" + table(res))
    if out:
        _log(f"wrote {out}")
    if res.get("failed"):
        _log(f"modes that failed: {', '.join(res['failed'])} (errors in the JSON)")
    return res


def _run_child(a, mode: str, B: int, T: int, budget: float) -> dict:
    """--isolate: one subprocess per mode (its own CUDA context); it writes its mode's numbers as JSON."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "mode.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--config", a.config, "--device", a.device,
               "--global-batch", str(B), "--seq-len", str(T), "--warmup", str(a.warmup), "--steps", str(a.steps),
               "--time-budget", str(budget), "--modes", mode, "--seed", str(a.seed), "--out", path, *a.overrides]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
        subprocess.run(cmd, check=True, env=env)
        with open(path) as f:
            return json.load(f)["modes"][mode]


def smoke(a) -> dict:
    """The trainer on this device, QAT as configured (bf16 + distributed optimizer on CUDA):
    logprobs == the loss train_step reports at the same weights, -logp falls over 5 SFT steps, finite grads."""
    import torch

    from megatron_qrl.platform import teardown
    from megatron_qrl.trainer import Trainer

    dev_type = "cuda" if torch.cuda.is_available() else "cpu"
    extra = ["trainer.bf16=true", "trainer.use_distributed_optimizer=true"] if dev_type == "cuda" else []
    cfg, forced = load_cfg(a, [*extra, "trainer.lr_warmup_steps=0"], dev_type)
    B, T = a.global_batch or 16, a.seq_len or min(64, cfg.model.max_sequence_length)
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    res = {"smoke": True, "config": a.config, "overrides": a.overrides + extra, "forced_overrides": forced,
           "bf16": cfg.trainer.bf16, "qat_linears": qat_linears(trainer), "B": B, "T": T, **_env(trainer.device),
           "param_dtype": str(next(trainer.unwrapped[0].parameters()).dtype),
           "param_device": str(next(trainer.unwrapped[0].parameters()).device)}
    batch = make_batch(cfg, B, T, a.seed)
    logp = trainer.logprobs(batch)
    assert logp.shape == (B, T) and bool(torch.isfinite(logp).all()), "logprobs not finite / wrong shape"
    mask = batch["loss_mask"].to(logp.device)
    nll0 = float(-(logp * mask).sum() / mask.sum())
    losses, norms = [], []
    for _ in range(5):
        st = trainer.train_step(batch, sft_loss_fn)
        losses.append(st["loss"])
        norms.append(st["grad_norm"])
        assert st["update_successful"] == 1.0, f"optimizer step skipped: {st}"
    logp_after = trainer.logprobs(batch)
    nll_after = float(-(logp_after * mask).sum() / mask.sum())
    tol = 2e-2 if cfg.trainer.bf16 else 1e-4
    res.update(build_and_run_s=time.perf_counter() - t0, nll_logprobs=nll0, losses=losses, grad_norms=norms,
               nll_after=nll_after, logprobs_vs_loss_abs=abs(nll0 - losses[0]), tolerance=tol)
    if dev_type == "cuda":
        res["peak_mem_gib"] = _gib(torch.cuda.max_memory_allocated(trainer.device))
    checks = {"logprobs_match_loss": abs(nll0 - losses[0]) <= tol * max(1.0, abs(nll0)),
              "finite": all(map(math.isfinite, losses + norms + [nll_after])),
              "loss_falls": losses[-1] < losses[0] and nll_after < nll0,
              "qat_on": res["qat_linears"] > 0 if cfg.quant.qat and cfg.quant.format != "bf16" else True}
    res["checks"] = checks
    res["ok"] = all(checks.values())
    teardown()
    _write(_out_path(a.out), res)
    _log(json.dumps(res, indent=1, default=str))
    _log("SMOKE OK" if res["ok"] else f"SMOKE FAILED: {[k for k, v in checks.items() if not v]}")
    return res


def main(argv=None) -> int:
    a = _parse(argv)
    if a.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch initialises CUDA
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU")
    if a.isolate and "RANK" in os.environ and os.environ.get("WORLD_SIZE", "1") != "1":
        raise SystemExit("--isolate launches its own processes; do not combine it with torchrun")
    if a.smoke:
        return 0 if smoke(a)["ok"] else 1
    res = bench(a)
    return 1 if res.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
