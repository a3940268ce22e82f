"""Run the real Megatron-Core (0.19.2) on CPU torch with gloo, without editing Megatron's files.

Megatron-Core assumes a CUDA device in a few dozen places. On a machine where
`torch.cuda.is_available()` is False, `install()` applies the runtime patches below; on a GPU machine
it does nothing. Every patch is scoped to Megatron's own modules (torch itself is never modified) and
keeps Megatron's math: only *where* tensors live and *how* CUDA-only side channels behave changes.

Patches (each one names the obstacle it removes):

1. Per-module `torch` proxy. Megatron modules call `torch.cuda.current_device()` to place buffers
   (attention softmax offsets, schedules' token counters, p2p shape buffers, gather/scatter outputs,
   DDP grad buffers, optimizer flags), create `torch.cuda.Stream`/`Event` objects (alltoall token
   dispatcher, shared-expert overlap, DDP comm stream) and pass `device="cuda"` literals (schedules,
   clip_grads, optimizer, grad scaler). Each loaded `megatron.*` module's global name `torch` is
   replaced by a module object that is torch except for: `torch.cuda` (a stand-in whose
   current_device() is the CPU device, whose streams/events are no-ops and whose RNG calls act on the
   CPU default generator) and the tensor factories (zeros, empty, tensor, ...), which map a CUDA
   device argument to the CPU.
2. RNG tracker (tensor_parallel.random): `_get_cuda_rng_state`/`_set_cuda_rng_state` read and write
   the CPU default generator. Upstream they go through `torch.cuda._lazy_call`, which without CUDA
   silently queues the call forever, so `model_parallel_cuda_manual_seed` and tracker forks would
   not seed anything. The tracker's "CPU RNG state changed within GPU RNG context" warning is
   expected here (the CPU generator *is* the device generator) and is silenced.
3. MoE alltoall dispatcher: `maybe_move_tensor_to_cpu` only converts CUDA tensors, so with EP>1 the
   split sizes stay CPU *tensors* and gloo's all_to_all_single rejects them; the patch converts
   CPU tensors the same way (to numpy when asked).
4. Gradient clipping: `clip_grad_by_total_norm_fp32` asserts `param.grad.type() ==
   'torch.cuda.FloatTensor'`; the patch checks for float32 on any device and scales identically.

Not patched, on purpose: Megatron's distributed optimizer and its mixed-precision optimizer check for
`torch.cuda.*Tensor` parameter types. On CPU the trainer uses Megatron's non-distributed FP32 optimizer
(megatron_qrl.trainer.optim) and refuses bf16 with a clear error.

Call `install()` once, after torch.distributed is initialised or before, but before building models;
`megatron_qrl.platform.distributed.init_distributed` calls it for you. It is idempotent and calls
`refresh()` to cover Megatron modules imported later.
"""
from __future__ import annotations

import contextlib
import logging
import sys
import types
from typing import Any

import torch

_INSTALLED = False
_CPU = torch.device("cpu")

# Megatron modules whose import must happen before patching (so their global `torch` is replaced).
_PRELOAD = [
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.tensor_parallel.cross_entropy",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.language_module.language_module",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.transformer_block",
    "megatron.core.transformer.module",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.shared_experts",
    "megatron.core.transformer.moe.experts",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer_param_scheduler",
    "megatron.core.dist_checkpointing",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.async_utils",
]


def needed() -> bool:
    """True when Megatron must run without CUDA (the only case where the shim is installed)."""
    return not torch.cuda.is_available()


# --------------------------------------------------------------------------------------------------
# 1. torch proxy
# --------------------------------------------------------------------------------------------------
def _cpu_device(device: Any) -> Any:
    """Map any CUDA device spelling (int, 'cuda', 'cuda:0', torch.device('cuda')) to the CPU."""
    if device is None:
        return None
    if isinstance(device, int):
        return _CPU
    if isinstance(device, str) and device.startswith("cuda"):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


def _on_cpu(factory):
    def wrapped(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return factory(*args, **kwargs)

    wrapped.__name__ = getattr(factory, "__name__", "factory")
    wrapped.__doc__ = factory.__doc__
    return wrapped


class _NullStream:
    """Stands in for torch.cuda.Stream: CPU work is synchronous, so waiting/recording is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return _NullEvent()

    def synchronize(self):
        pass

    def __eq__(self, other):
        return isinstance(other, _NullStream)

    def __hash__(self):
        return 0


class _NullEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


_NULL_STREAM = _NullStream()


def _make_cuda_standin() -> types.ModuleType:
    real = torch.cuda
    cuda = types.ModuleType("torch.cuda")  # stand-in seen only by Megatron's modules
    cuda.__dict__.update({k: v for k, v in real.__dict__.items() if not k.startswith("__")})
    cuda.__getattr__ = lambda name: getattr(real, name)  # lazily-loaded attributes
    cuda.current_device = lambda: _CPU
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda *a, **k: None
    cuda.Stream = _NullStream
    cuda.Event = _NullEvent
    cuda.current_stream = lambda *a, **k: _NULL_STREAM
    cuda.default_stream = lambda *a, **k: _NULL_STREAM
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.is_current_stream_capturing = lambda: False
    cuda.get_rng_state = lambda device=None: torch.get_rng_state()
    cuda.set_rng_state = lambda state, device=None: torch.set_rng_state(state)
    cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    cuda.manual_seed_all = lambda seed: torch.manual_seed(seed)
    cuda.default_generators = (torch.default_generator,)
    rnd = types.ModuleType("torch.cuda.random")
    rnd.get_rng_state = cuda.get_rng_state
    rnd.set_rng_state = cuda.set_rng_state
    cuda.random = rnd
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.memory_reserved = lambda *a, **k: 0
    cuda.max_memory_reserved = lambda *a, **k: 0
    nvtx = types.ModuleType("torch.cuda.nvtx")
    nvtx.range_push = lambda *a, **k: None
    nvtx.range_pop = lambda *a, **k: None
    nvtx.range = lambda *a, **k: contextlib.nullcontext()
    cuda.nvtx = nvtx
    return cuda


_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint",
              "as_tensor", "zeros_like", "ones_like", "empty_like", "full_like", "eye", "linspace")


def _make_torch_proxy() -> types.ModuleType:
    proxy = types.ModuleType("torch")
    proxy.__dict__.update({k: v for k, v in torch.__dict__.items() if k not in ("__getattr__",)})
    proxy.__getattr__ = lambda name: getattr(torch, name)
    proxy.cuda = _make_cuda_standin()
    for name in _FACTORIES:
        setattr(proxy, name, _on_cpu(getattr(torch, name)))
    proxy.__megatron_qrl_cpu_proxy__ = True
    return proxy


_TORCH_PROXY: types.ModuleType | None = None


def refresh() -> int:
    """Point every loaded megatron.* module's global `torch` at the proxy; returns how many changed."""
    if _TORCH_PROXY is None:
        return 0
    changed = 0
    for name, mod in list(sys.modules.items()):
        if not (name == "megatron" or name.startswith("megatron.")) or mod is None:
            continue
        if getattr(mod, "torch", None) is torch:
            mod.torch = _TORCH_PROXY
            changed += 1
    return changed


# --------------------------------------------------------------------------------------------------
# 2-4. targeted function patches
# --------------------------------------------------------------------------------------------------
def _patch_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    logging.getLogger(mrandom.__name__).setLevel(logging.ERROR)


def _patch_moe_cpu_splits() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor):
            tensor = tensor.to(_CPU)
            if as_numpy:
                return tensor.numpy()
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _patch_clip_grads() -> None:
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.utils import to_local_if_dtensor

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = []
        for p in parameters:
            g = getattr(p, attr, None)
            if g is not None:
                if g.dtype != torch.float32 and not use_decoupled_grad:
                    raise TypeError(f"gradient clipping expects float32 grads, got {g.dtype}")
                grads.append(to_local_if_dtensor(g).detach())
        clip_coeff = max_norm / (float(total_norm) + 1.0e-6)
        if clip_coeff < 1.0:
            for g in grads:
                g.mul_(clip_coeff)

    clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32


def install() -> bool:
    """Apply the CPU patches (no-op on CUDA machines). Returns True when the shim is active."""
    global _INSTALLED, _TORCH_PROXY
    if not needed():
        return False
    if _INSTALLED:
        refresh()
        return True
    import importlib
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in _PRELOAD:
            importlib.import_module(name)
    _TORCH_PROXY = _make_torch_proxy()
    refresh()
    _patch_rng()
    _patch_moe_cpu_splits()
    _patch_clip_grads()
    _INSTALLED = True
    return True


def installed() -> bool:
    return _INSTALLED
