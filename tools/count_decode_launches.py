#!/usr/bin/env python3
"""Kernel launches of one static decode step (DecodeModel.forward), per layer, counted on the host.

Builds the static-decode tests' tiny MoE (tests/test_rollout_engine.py TINY: 2 layers, hidden 64, 4 experts
top-2) as an engine with the kernel path forced on (kernels="on": grouped FP4 experts, fused norms, the
decode attention kernels -- the branch a CUDA graph captures), then runs one warm-up and one logged
DecodeModel.forward. Logged: every aten op that computes (views, allocations and arithmetic on host scalars
made by torch.tensor are not launches; a read of a device value is flagged HOST SYNC) and every Triton
launch, with the layer and the engine function it ran in. On CUDA each logged op is one kernel launch (a
cuBLAS GEMM can be two). Without a GPU the Triton kernels run in the interpreter (same launches).

--bf16 builds the model in bf16 as on the GPU: the dtype casts of the router (moe_router_dtype=fp32) only
exist then. The expert GEMM branch depends on assignments per expert (kernels/moe_grouped_gemm.py
heuristic_moe_config, printed): with 4 experts top-2, --batch 32 takes the branch of E=128 top-8 at B = 64
(16-row blocks, the fp16 operand converted by its own launch); --batch 2 the GEMV branch (B = 16).
--kv-cache fp8 takes the packed cache path (packed fp4 needs head_dim >= 32; the test model's is 16).

    python tools/count_decode_launches.py [--batch 32] [--bf16] [--weights nvfp4] [--scheme w4a16]
        [--targets routed_experts|all_linears] [--kv-cache bf16|fp8|fp4] [--experts 4] [--topk 2] [--all]
"""
from __future__ import annotations

import argparse
import os
import sys
import weakref
from collections import Counter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from test_rollout_engine import TINY  # noqa: E402  (the tests' model: the counts describe what they check)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from seeded_weights import sync_seeded  # noqa: E402

ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
# the engine's own code: an op is attributed to the innermost frame in one of these files
ENGINE_FILES = ("static_decode.py", "decode_experts.py", "decode_linears.py")


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--bf16", action="store_true", help="model in bf16 (as on the GPU); default fp32 (the tests)")
    p.add_argument("--weights", default="nvfp4", choices=["nvfp4", "mxfp4", "bf16"])
    p.add_argument("--scheme", default="w4a16", choices=["w4a16", "w4a4"])
    p.add_argument("--targets", default="routed_experts", choices=["routed_experts", "all_linears"])
    p.add_argument("--kv-cache", default="bf16", choices=["bf16", "fp8", "fp4"])
    p.add_argument("--layers", type=int, default=TINY["num_layers"])
    p.add_argument("--experts", type=int, default=TINY["num_experts"])
    p.add_argument("--topk", type=int, default=TINY["moe_router_topk"])
    p.add_argument("--all", action="store_true", help="list every layer's ops (default: the last layer's)")
    return p.parse_args(argv)


class Log:
    """Launch log of one forward: (section, engine function, op name) in launch order."""

    def __init__(self):
        self.section, self.events, self.in_triton = "before layers", [], 0

    def add(self, name: str) -> None:
        self.events.append((self.section, _engine_function(), name))


def _engine_function() -> str:
    f = sys._getframe(2)
    while f is not None:
        if f.f_code.co_filename.endswith(ENGINE_FILES):
            return f.f_code.co_qualname
        f = f.f_back
    return "?"


def _install_triton_hook(log: Log):
    """Log each Triton launch (compiled or interpreted) by kernel name; torch ops inside are not launches."""
    from triton.runtime import interpreter, jit

    def wrap(cls):
        run = cls.run

        def logged(self, *args, **kwargs):
            if kwargs.get("warmup"):
                return run(self, *args, **kwargs)
            log.add(self.fn.__name__)
            log.in_triton += 1
            try:
                return run(self, *args, **kwargs)
            finally:
                log.in_triton -= 1
        cls.run = logged

    wrap(jit.JITFunction)
    wrap(interpreter.InterpretedFunction)


def _dispatch_mode(log: Log):
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    def storages(x):
        return {t.untyped_storage().data_ptr() for t in tree_leaves(x) if isinstance(t, torch.Tensor)}

    host = weakref.WeakSet()       # tensors made by torch.tensor(...) and ops on them only: host scalars

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if log.in_triton or name in ALLOCATIONS:
                return out
            inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if name == "lift_fresh" or (inputs and all(t in host for t in inputs)):
                host.update(t for t in tree_leaves(out) if isinstance(t, torch.Tensor))
                return out
            # a view (outputs alias inputs without mutating them) computes nothing
            if not func._schema.is_mutable and storages(out) & storages(inputs):
                return out
            log.add(f"aten.{name}" + (" (HOST SYNC)" if name == "_local_scalar_dense" else ""))
            return out

    return Mode()


class _MarkedLayers(list):
    """The step's layer list; iterating it (the forward's layer loop) names the log's current section."""

    def __init__(self, layers, log: Log, moe: list[bool]):
        super().__init__(layers)
        self.log, self.moe = log, moe

    def __iter__(self):
        for i, layer in enumerate(list.__iter__(self)):
            self.log.section = f"layer {i}" + (" (MoE)" if self.moe[i] else "")
            yield layer
        self.log.section = "after layers"


def main(argv=None) -> int:
    a = _parse(argv)
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")     # before triton is imported (megatron imports it)
    from megatron_qrl.config import QRLConfig
    from megatron_qrl.kernels.moe_grouped_gemm import heuristic_moe_config
    from megatron_qrl.platform import init_distributed
    from megatron_qrl.rollout import EmbeddedEngine
    from megatron_qrl.rollout.decode_path import build_graph_loop

    model = dict(TINY, num_layers=a.layers, num_experts=a.experts, moe_router_topk=a.topk)
    traced = a.weights != "bf16" and a.scheme == "w4a4"        # TRACE on every layer under W4A4, as the tests
    cfg = QRLConfig.model_validate({
        "model": model, "trainer": {"bf16": a.bf16}, "quant": {"targets": a.targets},
        "trace": {"enabled": traced, "num_cached_layers": a.layers} if traced else {"enabled": False},
        "rollout": {"weights": a.weights, "scheme": a.scheme, "kv_cache": a.kv_cache, "max_batch_size": a.batch,
                    "decode": "static"}})
    init_distributed(cfg)
    torch.manual_seed(0)
    eng = EmbeddedEngine(cfg, kernels="on", keep_codes=True)
    sync_seeded(eng, seed=0)            # the kernels' weights have no dense copy in the engine to sync from
    step = build_graph_loop(eng, "static").model
    dev, B = eng.device, a.batch
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model["vocab_size"], (B,), generator=g).to(dev)
    positions = torch.zeros(B, dtype=torch.long, device=dev)
    slots = torch.arange(B, device=dev)
    active = torch.ones(B, dtype=torch.bool, device=dev)
    step.forward(tokens, positions, slots, active)                 # warm-up: lazy set-up is not per step

    log = Log()
    _install_triton_hook(log)
    step.layers = _MarkedLayers(step.layers, log, step.moe)
    with _dispatch_mode(log):
        step.forward(tokens, positions, slots, active)

    n = B * a.topk
    f = cfg.model.moe_ffn_hidden_size
    print(f"model: {a.layers} layers, hidden {model['hidden_size']}, {a.experts} experts top-{a.topk}, "
          f"{'bf16' if a.bf16 else 'fp32'}; engine {a.weights} {a.scheme}, targets {a.targets}, KV {a.kv_cache}, "
          f"batch {B}; kernel attention {step.kernel_attention}, fused norms {step.fused_norms}, fused QK-norm/"
          f"RoPE/KV write {step.fused_qkv}")
    if a.weights != "bf16":
        print(f"expert gate/up config at {n} assignments: "
              f"{heuristic_moe_config(n, a.experts, f, model['hidden_size'], True, a.weights)}")
    sections = list(dict.fromkeys(s for s, _, _ in log.events))
    per = Counter(s for s, _, _ in log.events)
    print(f"\nlaunches per step: {len(log.events)}")
    for s in sections:
        print(f"  {s:>18}: {per[s]}")
    layer_sections = [s for s in sections if s.startswith("layer")]
    show = sections if a.all else [s for s in sections if not s.startswith("layer")] + layer_sections[-1:]
    for s in show:
        print(f"\n{s}: {per[s]} launches")
        for _, where, name in (e for e in log.events if e[0] == s):
            print(f"    {name:<40} {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
