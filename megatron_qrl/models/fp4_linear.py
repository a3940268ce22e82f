"""FP4-aware Megatron linears: QAT fake quantization of the weight and of the input (METHODS.md section 2).

`FP4ColumnParallelLinear` / `FP4RowParallelLinear` subclass Megatron's ColumnParallelLinear /
RowParallelLinear and change one thing: `_forward_impl` (the local GEMM, after Megatron's own
communication set-up) sees `fake_quant(input)` and `fake_quant(weight)` instead of the originals. The
straight-through estimator keeps gradients identity, master weights stay high precision. Routed experts
use the same classes (SequentialMLP builds its experts from MLP linears).

Sharded tensors quantize exactly as the unsharded tensor would. Blocks run along K (the last dim), so
each block lies inside one shard as long as the per-shard K is a multiple of the block (the config
validates it); what couples shards is the per-tensor FP32 global scale (NVFP4), built from amax:
- weight: amax all-reduced (MAX) over the linear's tensor-parallel group (the expert-TP group for
  routed experts), because every TP layout shards a weight;
- input of a row-parallel linear: K-sharded over TP -> amax all-reduced over the TP group;
- input of a column-parallel linear with sequence parallelism: token-sharded -> amax all-reduced over
  the TP group; without sequence parallelism the input is replicated and no reduction is needed;
- input of a routed expert: the tokens of this data-parallel micro-batch routed to that expert. The
  token dispatcher gathers them over EP and expert-TP; when sequence parallelism leaves part of them
  on TP peers that hold a replica of the same expert (TP > EP*ETP), megatron_qrl.models.experts
  reduces the per-expert amax over the TP group. Because the activation global scale is dynamic (per
  tensor per forward), it depends on which tokens share the tensor: identical under TP/SP/PP/EP with
  one data-parallel replica, but when EP spans data-parallel replicas, tokens of several replicas'
  micro-batches meet at an expert, so W4A4 expert activations then differ slightly from a single
  process. TRACE guides carry the rollout's scales and remove this dependence for guided sites.

Activation sites have stable names (`site_name`, megatron_qrl/quant/sites.py): "L{layer}.{role}" or
"L{layer}.{role}.E{expert}", with the global 0-based layer index and global expert index. A guide provider
(`set_guide_provider`) may return a `GuidedRounding` for a site and micro-batch (TRACE replay); a
capture sink (`capture_activations`) receives the codes/bits/scales each site used.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from megatron_qrl.quant.formats import FP4_FORMATS, fp4_format, uses_kernels
from megatron_qrl.quant.nvfp4 import nvfp4_global_scale
from megatron_qrl.quant.qat import GuidedRounding
from megatron_qrl.quant.sites import site_name  # noqa: F401  (models.site_name, the builder of site names)


@dataclass(frozen=True)
class QuantSettings:
    """What one linear quantizes; built by the spec from `cfg.quant` and the linear's role."""

    format: str = "nvfp4"          # nvfp4 | mxfp4 | bf16 (bf16 = no quantization)
    weights: bool = True
    activations: bool = True
    fallback_shift: float = 0.25   # TRACE: guided elements beyond this shift fall back to nearest

    @property
    def enabled(self) -> bool:
        return self.format != "bf16" and (self.weights or self.activations)


OFF = QuantSettings(format="bf16", weights=False, activations=False)


@dataclass
class CaptureRecord:
    """The FP4 encoding one site used for one forward call (the engine and TRACE reuse it)."""

    site: str
    packed: torch.Tensor                 # uint8 [..., K/2] E2M1 codes
    scales: torch.Tensor                 # float8_e4m3fn [..., K/16] (NVFP4) or uint8 E8M0 [..., K/32]
    global_scale: Optional[torch.Tensor]  # fp32 0-dim (NVFP4) / None (MXFP4)
    bits: torch.Tensor                   # uint8 [..., K/8] mantissa bits (the TRACE cache payload)


@dataclass
class QuantSite:
    """Identity of one quantized activation site plus its optional guide provider and capture sink."""

    name: str = ""
    layer: int = -1                 # global 0-based layer index
    role: str = ""                  # qkv | proj | fc1 | fc2 | shared_fc1 | shared_fc2
    expert: Optional[int] = None    # global expert index for routed experts
    k_offset: int = 0               # this rank's offset along the full K (row-parallel under TP)
    k_total: int = 0                # the full (unsharded) K
    guide_provider: Optional[Callable[["QuantSite", torch.Tensor], Optional[GuidedRounding]]] = None
    capture_sink: Optional[list] = None
    stats: dict = field(default_factory=dict)
    # set for one call by the expert MLP: the input amax of this expert over the TP group (see experts.py)
    amax_floor: Optional[torch.Tensor] = None


def _global_amax(x: torch.Tensor, group, floor: Optional[torch.Tensor] = None) -> torch.Tensor:
    amax = x.detach().abs().amax().float()
    if floor is not None:
        amax = torch.maximum(amax, floor.float())
    if group is not None and dist.is_initialized() and group.size() > 1:
        amax = amax.clone()
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


_WEIGHT_EPOCH = [0]


def weights_changed() -> None:
    """Invalidate every FP4 linear's cached fake-quant weight: call after anything writes model weights
    outside autograd's version tracking (an optimizer step, a checkpoint load)."""
    _WEIGHT_EPOCH[0] += 1


def quantize_dequantize(x: torch.Tensor, fmt: str, group=None, guide: Optional[GuidedRounding] = None,
                        capture: bool = False, fallback_shift: float = 0.25,
                        stats: Optional[dict] = None, amax_floor: Optional[torch.Tensor] = None):
    """dequant(quant(x)) without gradient, with the global amax max(amax(x), amax_floor) reduced over `group`.

    Returns (dequantized x in x.dtype, CaptureRecord fields or None). The codec does the rounding, so the
    bytes are exactly those the engine and the exporter compute.
    """
    with torch.no_grad():
        if getattr(guide, "device_rows", False) and not capture:
            # TRACE rows gathered on the device (trace/device_guides.py): replayed without a host sync; rows
            # the cache lacks round to nearest with this tensor's own (local) global scale
            from megatron_qrl.trace.replay import replay_rows

            return replay_rows(x, guide, nvfp4_global_scale(x), fallback_shift, stats), None
        if fmt not in FP4_FORMATS:
            raise ValueError(f"unknown FP4 format '{fmt}'; use nvfp4, mxfp4 or bf16")
        f = fp4_format(fmt)
        # the format object runs the Triton codec on GPU (one fused launch, no host sync, byte-identical to the
        # torch codec: tests/test_kernels_codec.py) and the torch codec elsewhere
        if guide is not None:
            gs = guide.global_scale
            if (f.has_global_scale and torch.is_tensor(gs) and gs.numel() > 1
                    and (capture or not uses_kernels(x))):
                # rows the engine quantized in different calls carry their own global scale
                # (megatron_qrl.trace.replay runs the codec's guided rounding per row); no capture here
                from megatron_qrl.trace.replay import guided_quant_dequant

                return guided_quant_dequant(x, guide, fallback_shift, stats), None
            deq, enc = f.guided(x, guide, fallback_shift=fallback_shift, stats=stats, capture=capture,
                                check_finite=False)
        else:
            gs = nvfp4_global_scale(_global_amax(x, group, amax_floor)) if f.has_global_scale else None
            deq, enc = f.fake_quant(x, gs, capture=capture, check_finite=False)
        return deq, (tuple(enc) if capture else None)


def straight_through(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Forward value q, gradient identity to x."""
    return x + (q - x).detach()


class _FP4LinearMixin:
    """Shared QAT logic; `quant` is a class attribute set by `fp4_linear_class`."""

    quant: QuantSettings = OFF
    # set per instance by megatron_qrl.models.sites.assign_sites
    site: QuantSite

    def _init_site(self, input_size: int) -> None:
        self.site = QuantSite(k_total=input_size)

    # whether this linear's input is sharded over its TP group (so its amax needs a reduction)
    def _input_sharded(self) -> bool:
        raise NotImplementedError

    def _tp(self):
        group = getattr(self, "tp_group", None)
        return group if group is not None and group.size() > 1 else None

    def _quant_input(self, x: torch.Tensor) -> torch.Tensor:
        q = self.quant
        site = self.site
        guide = site.guide_provider(site, x) if site.guide_provider is not None else None
        deq, rec = quantize_dequantize(
            x, q.format, group=self._tp() if self._input_sharded() else None, guide=guide,
            capture=site.capture_sink is not None, fallback_shift=q.fallback_shift, stats=site.stats,
            amax_floor=site.amax_floor)
        if rec is not None:
            site.capture_sink.append(CaptureRecord(site.name, *rec))
        return straight_through(x, deq)

    def _quant_weight(self, w: torch.Tensor) -> torch.Tensor:
        # Quantize a weight once per change instead of in every micro-batch and pass (the STE below still
        # runs per forward). Changes are seen through the version counter (in-place autograd-visible edits)
        # and the weight epoch (`weights_changed`): Megatron's bf16 optimizers write the model params through
        # `.data` / the DDP param buffer, which no version counter sees.
        key = (id(w), w.data_ptr(), w._version, _WEIGHT_EPOCH[0], w.dtype, self.quant.format)
        cached = getattr(self, "_fq_weight_cache", None)
        if cached is None or cached[0] != key:
            deq, _ = quantize_dequantize(w, self.quant.format, group=self._tp())
            cached = (key, deq)
            self._fq_weight_cache = cached
        return straight_through(w, cached[1])

    def _forward_impl(self, input, weight, *args, **kwargs):
        q = self.quant
        if q.enabled and torch.is_tensor(input) and input.numel() > 0:
            if q.activations:
                input = self._quant_input(input)
            if q.weights:
                weight = self._quant_weight(weight)
        return super()._forward_impl(input, weight, *args, **kwargs)


class FP4ColumnParallelLinear(_FP4LinearMixin, ColumnParallelLinear):
    """ColumnParallelLinear with QAT fake quantization (input: replicated or sequence-sharded)."""

    def __init__(self, input_size, output_size, *args, **kwargs):
        super().__init__(input_size, output_size, *args, **kwargs)
        self._init_site(input_size)

    def _input_sharded(self) -> bool:
        return bool(self.sequence_parallel) and not self.explicit_expert_comm


class FP4RowParallelLinear(_FP4LinearMixin, RowParallelLinear):
    """RowParallelLinear with QAT fake quantization (input: K-sharded over TP)."""

    def __init__(self, input_size, output_size, *args, **kwargs):
        super().__init__(input_size, output_size, *args, **kwargs)
        self._init_site(input_size)
        tp = self.tp_group.size() if self.tp_group is not None else 1
        rank = self.tp_group.rank() if self.tp_group is not None else 0
        self.site.k_offset = rank * (input_size // tp)

    def _input_sharded(self) -> bool:
        return True


def fp4_linear_class(base: type, settings: QuantSettings) -> type:
    """A subclass of FP4ColumnParallelLinear/FP4RowParallelLinear bound to `settings` (a spec entry)."""
    if base not in (FP4ColumnParallelLinear, FP4RowParallelLinear):
        raise TypeError(f"fp4_linear_class expects an FP4 linear base, got {base.__name__}")
    tag = "Off" if not settings.enabled else f"{settings.format}_w{4 if settings.weights else 16}" \
        f"a{4 if settings.activations else 16}"
    return type(f"{base.__name__}_{tag}", (base,), {"quant": settings, "__module__": __name__})


def fp4_linears(model: torch.nn.Module) -> Iterator[_FP4LinearMixin]:
    for m in model.modules():
        if isinstance(m, _FP4LinearMixin):
            yield m


def set_guide_provider(model, provider: Optional[Callable[[QuantSite, torch.Tensor],
                                                            Optional[GuidedRounding]]]) -> None:
    """Give every activation site of `model` (a module or list of chunks) a TRACE guide provider.

    provider(site, x) returns the rollout's GuidedRounding for this site and the current micro-batch, or
    None for nearest rounding. None clears it. The trainer sets it per micro-batch from the batch.
    """
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        for lin in fp4_linears(chunk):
            lin.site.guide_provider = provider


@contextlib.contextmanager
def capture_activations(model, sites: Optional[set] = None):
    """Collect a CaptureRecord per quantized activation per forward call inside the block.

    Yields the list that fills up; `sites` restricts capture to those site names.
    """
    records: list = []
    chunks = model if isinstance(model, (list, tuple)) else [model]
    touched = []
    for chunk in chunks:
        for lin in fp4_linears(chunk):
            if lin.quant.enabled and lin.quant.activations and (sites is None or lin.site.name in sites):
                lin.site.capture_sink = records
                touched.append(lin)
    try:
        yield records
    finally:
        for lin in touched:
            lin.site.capture_sink = None


def guided_fallback_stats(model) -> dict:
    """Sum of TRACE fallback counters over all sites (then reset): {'guided_fallback', 'guided_elements'}.

    Counters may be device tensors (device-side replay and grouped experts, whose grouped calls count on
    their first expert's site); they are read here, once."""
    total = {"guided_fallback": 0, "guided_elements": 0}
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        for lin in fp4_linears(chunk):
            for k in total:
                total[k] = total[k] + lin.site.stats.pop(k, 0)
    return {k: int(v) for k, v in total.items()}
