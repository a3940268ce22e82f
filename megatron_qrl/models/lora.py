"""QeRL mode: LoRA adapters on Megatron linears whose frozen base is held packed in FP4 (docs/lora.md).

`lora_linear_class(fp4_cls, target, cfg)` turns one of the spec's FP4 linear classes into a linear that
  - keeps its base weight frozen: packed NVFP4/MXFP4 *buffers* (uint8 codes, E4M3/E8M0 scale bytes, the
    NVFP4 global scale as its 4 fp32 bytes -- all uint8, so Float16Module's bf16 cast never touches them), or
    a frozen bf16 Parameter (lora.base_format=bf16, or a linear outside quant.targets);
  - computes base(x) through `_FrozenBaseGEMM`, which dequantizes the base in forward AND again in backward
    instead of saving it, so a dense copy of a base weight only ever exists for one GEMM (on CUDA the forward
    GEMM is the W4A16 Triton kernel, see `base_matmul`);
  - adds scale * B(A(x)) (scale = alpha / rank) on the raw (unquantized) input; A, B are the only Parameters
    that require grad.
Under W4A4 the base GEMM still sees the QAT-quantized input (the FP4 mixin's `_quant_input`, with TRACE
guides and capture), so the engine, which runs the same class, computes the same numbers.

Tensor parallelism (Megatron's LoRA layout): column-parallel linears (qkv, fc1) shard B along the output and
replicate A; row-parallel linears (proj, fc2) shard A along the input and replicate B. The replicated factor
enters through `copy_to_tensor_model_parallel_region` (identity forward, all-reduce backward), which turns
its per-rank partial gradient into the full one, so every adapter gradient is complete on every rank and
nothing extra is needed in finalize_model_grads. The row-parallel low-rank product is added to the partial
output before Megatron's all-reduce / reduce-scatter (both are linear), the column-parallel input is
gathered once per path exactly as Megatron does. Routed experts use the expert tensor-parallel group.

Checkpoints: `sharded_state_dict` shards the packed base and the adapters like the weight they replace.
"""
from __future__ import annotations

import zlib
from typing import Iterator, Optional

import torch
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    gather_from_sequence_parallel_region,
                                                    gather_from_tensor_model_parallel_region,
                                                    reduce_from_tensor_model_parallel_region,
                                                    reduce_scatter_to_sequence_parallel_region)
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

from megatron_qrl.quant.formats import FP4_FORMATS, fp4_format
from megatron_qrl.quant.nvfp4 import nvfp4_global_scale

from .aqn_norm import RMSNorm
from .fp4_linear import FP4ColumnParallelLinear, FP4RowParallelLinear, QuantSettings, _global_amax

BASE_BUFFERS = ("base_packed", "base_scales", "base_global_scale")
ADAPTERS = ("lora_A", "lora_B")


class _FrozenBaseGEMM(torch.autograd.Function):
    """y = x @ W^T for the frozen base W of `linear`; W is rebuilt in backward, never saved (QLoRA-style)."""

    @staticmethod
    def forward(ctx, x, linear):
        ctx.linear = linear
        return linear.base_matmul(x)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[0]:
            return None, None
        return grad.matmul(ctx.linear.base_weight(grad.dtype)), None


class _LoRAMixin:
    """Frozen base + adapters; class attributes are bound by `lora_linear_class`."""

    lora_target: str = ""
    lora_rank: int = 0          # 0: this linear is frozen without adapters (not in lora.target_modules)
    lora_scale: float = 0.0
    base_format: str = "bf16"
    column: bool = True

    def _setup_lora(self) -> None:
        self.weight.requires_grad_(False)
        self.cache_base = False     # the engine caches the dequantized/kernel-layout base (frozen)
        self._base_cache = None
        self.base_shape = tuple(self.weight.shape)
        self._expert_dp = not getattr(self.weight, "allreduce", True)  # Megatron: reduced over expert DP
        if self.base_format in FP4_FORMATS:
            self._pack_base()
        if self.lora_rank:
            self._make_adapters()

    # ------------------------------------------------------------------------------------ frozen base
    def _pack_base(self) -> None:
        w = self.weight.detach()
        f = fp4_format(self.base_format)
        with torch.no_grad():
            # NVFP4: one global scale for the whole (unsharded) weight, as the engine's pack_weight computes it
            gs = nvfp4_global_scale(_global_amax(w, self._tp())) if f.has_global_scale else None
            packed, scales, gs, _ = f.quantize(w, global_scale=gs)
            gs_bytes = (gs.float().reshape(1).view(torch.uint8) if gs is not None
                        else torch.zeros(0, dtype=torch.uint8, device=w.device))
        del self.weight
        self.weight = None
        self.register_buffer("base_packed", packed.contiguous())
        self.register_buffer("base_scales", scales.contiguous().view(torch.uint8))
        self.register_buffer("base_global_scale", gs_bytes)

    def load_full_weight(self, w: torch.Tensor) -> None:
        """Converting load: the frozen base becomes `w` (this rank's shard of a full-precision weight), packed
        exactly as if the linear had been built with it; the adapters are left as they are."""
        if self.base_format not in FP4_FORMATS:
            with torch.no_grad():
                self.weight.copy_(w)
            return
        self.weight = torch.nn.Parameter(w.detach().to(self.base_packed.device, torch.float32).clone(),
                                         requires_grad=False)
        self._pack_base()
        self._base_cache = self._kernel_cache = None

    def base_tensors(self) -> dict[str, torch.Tensor]:
        """The frozen base in its stored form (what the engine shares and what the base hash covers)."""
        if self.base_format in FP4_FORMATS:
            return {n: getattr(self, n) for n in BASE_BUFFERS}
        return {"weight": self.weight}

    def _cache_key(self, dtype) -> tuple:
        t = next(iter(self.base_tensors().values()))
        return (t.data_ptr(), t._version, dtype, t.device)

    def base_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense base weight [out_local, in_local] in `dtype` (dequantized on demand unless cached)."""
        if self.base_format not in FP4_FORMATS:
            return self.weight if self.weight.dtype == dtype else self.weight.to(dtype)
        if self.cache_base and self._base_cache is not None and self._base_cache[0] == self._cache_key(dtype):
            return self._base_cache[1]
        packed, scales, gs = self._base_fp4()
        w = fp4_format(self.base_format).dequantize(packed, scales, gs, dtype)
        if self.cache_base:
            self._base_cache = (self._cache_key(dtype), w)
        return w

    def _base_fp4(self) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """(packed codes, block scales in their dtype, NVFP4 global scale or None) of the stored base."""
        f = fp4_format(self.base_format)
        gs = self.base_global_scale.view(torch.float32).reshape(()) if f.has_global_scale else None
        return self.base_packed, self.base_scales.view(f.scale_dtype), gs

    def _kernel_weight(self, x: torch.Tensor):
        """The base in the W4A16 kernel layout (built once: the base never changes), or None if unusable."""
        if self.base_format not in FP4_FORMATS:
            return None
        from megatron_qrl.kernels.backend import w4a16_runs

        if not w4a16_runs(x):
            return None
        key = ("kernel",) + self._cache_key(x.dtype)
        cached = getattr(self, "_kernel_cache", None)
        if cached is None or cached[0] != key:
            from megatron_qrl.kernels import prepare_weight

            cached = (key, prepare_weight(self.base_format, *self._base_fp4()))
            self._kernel_cache = cached
        return cached[1]

    def base_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W_base^T: the W4A16 kernel on CUDA when shapes allow, else dequantize then matmul."""
        prepared = self._kernel_weight(x) if x.numel() else None
        if prepared is not None:
            from megatron_qrl.kernels.w4a16_gemm import select_config, w4a16_gemm

            m = x.numel() // x.shape[-1]
            k_step = getattr(select_config(prepared, m, x.device), "block_k", None)   # only the wgmma GEMM has one
            if k_step is None or prepared.k % k_step == 0:
                return w4a16_gemm(x, prepared)
        return torch.matmul(x, self.base_weight(x.dtype).t())

    # --------------------------------------------------------------------------------------- adapters
    def _make_adapters(self) -> None:
        out_local, in_local = self.base_shape
        r = self.lora_rank
        dev = self.base_packed.device if self.weight is None else self.weight.device
        dtype = self.config.params_dtype
        self.lora_A = torch.nn.Parameter(torch.zeros(r, in_local, device=dev, dtype=dtype))
        self.lora_B = torch.nn.Parameter(torch.zeros(out_local, r, device=dev, dtype=dtype))
        sharded, replicated = (self.lora_B, self.lora_A) if self.column else (self.lora_A, self.lora_B)
        set_tensor_model_parallel_attributes(sharded, is_parallel=True, dim=0 if self.column else 1, stride=1)
        set_tensor_model_parallel_attributes(replicated, is_parallel=False, dim=-1, stride=1)
        for p in (self.lora_A, self.lora_B):  # same DDP group as the weight they adapt
            setattr(p, "allreduce", not self._expert_dp)

    def init_adapters(self, seed: int) -> None:
        """A ~ U(-1/sqrt(in), 1/sqrt(in)) drawn for the FULL tensor from a generator keyed on the site name
        (so every TP layout and every replica holds the same A), B = 0: the model starts as its base."""
        if not self.lora_rank:
            return
        k_total = self.site.k_total
        g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(self.site.name.encode())) % 2 ** 63)
        bound = 1.0 / k_total ** 0.5
        full = (torch.rand(self.lora_rank, k_total, generator=g) * 2 - 1) * bound
        lo = 0 if self.column else self.site.k_offset
        with torch.no_grad():
            self.lora_A.copy_(full[:, lo:lo + self.lora_A.shape[1]])
            self.lora_B.zero_()

    def _lora_delta(self, x: torch.Tensor, full_factor: str) -> torch.Tensor:
        """scale * (x @ A^T) @ B^T with the replicated factor's gradient all-reduced over the TP group."""
        A, B = self.lora_A, self.lora_B
        if full_factor == "A":
            A = copy_to_tensor_model_parallel_region(A, group=self.tp_group)
        else:
            B = copy_to_tensor_model_parallel_region(B, group=self.tp_group)
        return (x.matmul(A.t().to(x.dtype))).matmul(B.t().to(x.dtype)) * self.lora_scale

    def _quantized_input(self, x: torch.Tensor) -> torch.Tensor:
        q = self.quant
        return self._quant_input(x) if (q.enabled and q.activations and x.numel() > 0) else x

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Base buffers and adapters sharded like the weight they stand for; replicated factors as replicas."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        axis = 0 if self.column else 1
        axes = {"weight": axis, "base_packed": axis, "base_scales": axis,
                ("lora_B" if self.column else "lora_A"): axis}
        if self.column:
            axes["bias"] = 0
        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, axes, sharded_offsets, tp_group=self.tp_group,
                                                   dp_cp_group=metadata["dp_cp_group"])

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, lora_target={self.lora_target}, rank={self.lora_rank}, "
                f"base={self.base_format}")


class LoRAColumnParallelLinear(_LoRAMixin, FP4ColumnParallelLinear):
    """Column-parallel (qkv, fc1): B sharded along the output, A replicated."""

    column = True

    def __init__(self, input_size, output_size, *args, **kwargs):
        super().__init__(input_size, output_size, *args, **kwargs)
        self._setup_lora()

    def _to_full_input(self, x: torch.Tensor) -> torch.Tensor:
        # Megatron's column-parallel input handling, made explicit (our GEMM is not Megatron's autograd fn)
        if self.explicit_expert_comm:
            return x
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(x, group=self.tp_group)
        return copy_to_tensor_model_parallel_region(x, group=self.tp_group)

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None):
        if weight is not None:
            raise RuntimeError(f"{type(self).__name__} holds a frozen base; it does not take an external weight")
        x_q = self._quantized_input(input_)
        x_base = self._to_full_input(x_q)
        y = _FrozenBaseGEMM.apply(x_base, self)
        if self.lora_rank:  # without activation quantization both paths share one gathered input
            x_full = x_base if x_q is input_ else self._to_full_input(input_)
            y = y + self._lora_delta(x_full, full_factor="A")
        if self.bias is not None and not self.skip_bias_add:
            y = y + self.bias
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather:
            y = gather_from_tensor_model_parallel_region(y, group=self.tp_group)
        return y, (self.bias if self.skip_bias_add else None)


class LoRARowParallelLinear(_LoRAMixin, FP4RowParallelLinear):
    """Row-parallel (proj, fc2): A sharded along the input, B replicated."""

    column = False

    def __init__(self, input_size, output_size, *args, **kwargs):
        super().__init__(input_size, output_size, *args, **kwargs)
        if not self.input_is_parallel:
            raise NotImplementedError("LoRA row-parallel linears expect input_is_parallel=True (Megatron's layers)")
        self._setup_lora()

    def forward(self, input_: torch.Tensor):
        y = _FrozenBaseGEMM.apply(self._quantized_input(input_), self)
        if self.lora_rank:  # partial sums over TP ranks: the reduction below completes both paths at once
            y = y + self._lora_delta(input_, full_factor="B")
        if self.explicit_expert_comm:
            out = y
        elif self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(y, group=self.tp_group)
        else:
            out = reduce_from_tensor_model_parallel_region(y, group=self.tp_group)
        if self.bias is not None and not self.skip_bias_add:
            return out + self.bias, None
        return out, self.bias if self.skip_bias_add else None


def lora_linear_class(fp4_cls: type, target: str, cfg) -> type:
    """The LoRA variant of a spec's FP4 linear class for Megatron module `target` (config.LORA_TARGET_MODULES).

    Base storage: lora.base_format inside quant.targets (routed experts always, the rest with all_linears,
    which is what the engine runs in FP4), bf16 outside. The class's QAT settings keep only activation fake
    quantization: its base weights are FP4 values already.
    """
    lo = cfg.lora
    expert = target.startswith("experts.")
    in_scope = expert or cfg.quant.targets == "all_linears"
    base = lo.base_format if in_scope else "bf16"
    q = fp4_cls.quant
    quant = QuantSettings(format=q.format, weights=False, activations=q.activations and base != "bf16",
                          fallback_shift=q.fallback_shift)
    column = issubclass(fp4_cls, FP4ColumnParallelLinear)
    if not column and not issubclass(fp4_cls, FP4RowParallelLinear):
        raise TypeError(f"lora_linear_class expects an FP4 linear class, got {fp4_cls.__name__}")
    rank = lo.rank if target in lo.target_modules else 0
    parent = LoRAColumnParallelLinear if column else LoRARowParallelLinear
    attrs = {"quant": quant, "lora_target": target, "lora_rank": rank, "lora_scale": lo.alpha / lo.rank,
             "base_format": base, "__module__": __name__}
    name = f"LoRA_{target.replace('.', '_')}_r{rank}_{base}"
    return type(name, (parent,), attrs)


# ------------------------------------------------------------------------------------ model-level helpers
def lora_linears(model) -> Iterator[_LoRAMixin]:
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        for m in chunk.modules():
            if isinstance(m, _LoRAMixin):
                yield m


def is_lora_linear(module) -> bool:
    return isinstance(module, _LoRAMixin)


def prepare_lora_model(chunks: list, cfg) -> None:
    """After assign_sites: deterministic adapter init, then freeze everything but adapters (+ norms)."""
    for lin in lora_linears(chunks):
        lin.init_adapters(cfg.trainer.seed)
    for chunk in chunks:
        norm_weights = {id(m.weight) for m in chunk.modules() if isinstance(m, RMSNorm)}
        for name, p in chunk.named_parameters():
            train = name.rsplit(".", 1)[-1] in ADAPTERS or (cfg.lora.train_norms and id(p) in norm_weights)
            p.requires_grad_(train)


def load_full_state(chunks: list, state: dict) -> list[str]:
    """A full-weight model's state dict (`name -> tensor`, this rank's shards; e.g. an SFT checkpoint loaded
    into a full-weight trainer) into a LoRA model: every LoRA linear's frozen base is packed from its
    `<name>.weight`, every other tensor of the same name and shape is copied; adapters keep their init (B = 0:
    the model starts as the FP4 base). Returns the LoRA model's tensors it found nothing for (ideally only the
    adapters)."""
    missing = []
    for chunk in chunks:
        linears = {name: m for name, m in chunk.named_modules() if isinstance(m, _LoRAMixin)}
        for name, lin in linears.items():
            if f"{name}.weight" not in state:
                raise KeyError(f"the full-weight state has no '{name}.weight' for the LoRA base of {name}: load a "
                               "checkpoint of the same model (model.* sizes) without lora.enabled")
            lin.load_full_weight(state[f"{name}.weight"])
        owned = {f"{n}.{b}" for n in linears for b in BASE_BUFFERS + ("weight",)}
        with torch.no_grad():
            for name, t in chunk.state_dict(keep_vars=True).items():
                if name in owned or not torch.is_tensor(t):
                    continue
                src = state.get(name)
                if src is None or tuple(src.shape) != tuple(t.shape):
                    missing.append(name)
                else:
                    t.copy_(src)
    return missing


def configure_engine_linear(lin: _LoRAMixin, cfg) -> QuantSettings:
    """Engine settings of a LoRA linear: cached frozen base, adapters as a separate low-rank path (docs/lora.md),
    activations quantized under W4A4 exactly where the trainer quantizes them."""
    lin.cache_base = True
    ro = cfg.rollout
    w4a4 = ro.scheme == "w4a4" and lin.base_format in FP4_FORMATS
    return QuantSettings(format=lin.base_format if w4a4 else "bf16", weights=False, activations=w4a4,
                         fallback_shift=cfg.trace.fallback_shift)
