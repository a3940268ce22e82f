"""Routed experts as grouped GEMMs with FP4 QAT: `QATGroupedMLP`, the layer spec's default expert MLP.

Megatron's SequentialMLP (and our QATSequentialMLP) runs the local experts one after another: per expert
two GEMMs, and under QAT two fake-quant launches for the inputs plus the weight STE, i.e. hundreds of small
launches per layer. QATGroupedMLP computes the same function with
- the experts' fc1 and fc2 GEMMs as one `torch._grouped_mm` each, forward and backward (a per-expert loop
  where the grouped kernel does not take the dtype/device);
- FP4 QAT of the weights as one codec launch per role for all experts, once per weight change (cached by the
  FP4 weight epoch, like the FP4 linears' own cache); the forward uses the cached effective weight
  W + (fq(W) - W) stacked [E, N, K] and the backward hands its gradient to each expert's weight (STE);
- FP4 QAT of the inputs as one codec launch per grouped call, every row with its expert's global scale
  (amax over that expert's rows, all-reduced over TP exactly as QATSequentialMLP does);
- TRACE replay of the inputs from a device-side guide for all local experts at once (`for_experts` of the
  guide provider, megatron_qrl/trace/device_guides.py).
The parameters are the experts' own linears (`local_experts.{j}.linear_fc1.weight`), so checkpoints, the
converter, the rollout engine and weight sync see the same names. The per-expert code path stays the
reference: the module runs it (QATSequentialMLP.forward) whenever the grouped path would not be the same
function -- capture of activations (the engine's TRACE record), forward hooks on the expert linears (they
observe each expert's call: calibration, tests), a guide provider without `for_experts`, LoRA experts,
biases, probabilities applied on the input.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .expert_quant import expert_amax, fake_quant_rows, quantize_stacked_weights, reduce_max, row_scales
from .experts import QATSequentialMLP, _activation
from .fp4_linear import _WEIGHT_EPOCH, FP4ColumnParallelLinear, FP4RowParallelLinear, straight_through
from .lora import is_lora_linear
from megatron_qrl.quant.wire import FP4Tensor


# ------------------------------------------------------------------------------------------- layout
@dataclass
class GroupLayout:
    """Where each expert's rows lie: Megatron's permuted order (expert by expert) and the grouped GEMM's.

    CUDA's grouped kernel needs every group to start on a 16-byte boundary along the token dimension in the
    backward (grad_w = x^T @ grad_y groups along tokens), so there groups are padded to `align` rows;
    elsewhere align = 1 and the layout is the permuted order itself. Everything lives on the device: no
    host synchronisation, whatever tokens_per_expert's device.
    """

    n_experts: int
    rows: int
    row_expert: torch.Tensor            # int64 [rows]: local expert of every row
    offs: torch.Tensor                  # int32 [E]: cumulative group ends in the GEMM layout
    dst: Optional[torch.Tensor]         # int64 [rows]: row in the padded layout (None: no padding)
    gemm_rows: int                      # rows of the padded layout
    host_counts: Optional[list]         # tokens per expert when known on the host (a CPU tokens_per_expert)

    @classmethod
    def build(cls, tokens_per_expert, rows: int, n_experts: int, device, align: int = 1) -> "GroupLayout":
        tpe = torch.as_tensor(tokens_per_expert)
        host = tpe.tolist() if tpe.device.type == "cpu" else None
        counts = tpe.to(device=device, dtype=torch.int64, non_blocking=True)
        ends = torch.cumsum(counts, 0)
        row_expert = torch.searchsorted(ends, torch.arange(rows, device=device), right=True)
        if align <= 1:
            return cls(n_experts, rows, row_expert, ends.to(torch.int32), None, rows, host)
        padded = (counts + (align - 1)) // align * align
        pends = torch.cumsum(padded, 0)
        dst = torch.arange(rows, device=device) + (pends - padded - ends + counts).index_select(0, row_expert)
        gemm_rows = sum(-(-c // align) * align for c in host) if host is not None else rows + n_experts * (align - 1)
        return cls(n_experts, rows, row_expert, pends.to(torch.int32), dst, gemm_rows, host)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        if self.dst is None:
            return x
        return x.new_zeros(self.gemm_rows, x.shape[-1]).index_copy(0, self.dst, x)

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.dst is None else y.index_select(0, self.dst)

    def counts(self) -> list:
        """Tokens per expert on the host (a device->host read only when they were not there already)."""
        if self.host_counts is None:
            self.host_counts = torch.bincount(self.row_expert, minlength=self.n_experts).tolist()
        return self.host_counts


def gemm_alignment(x: torch.Tensor) -> int:
    """Rows each group is padded to: 16 bytes of the token dimension on CUDA, none elsewhere."""
    return 16 // x.element_size() if x.is_cuda else 1


# ------------------------------------------------------------------------------------------- GEMMs
_GROUPED_OK: dict = {}


def grouped_mm_available(device: torch.device, dtype: torch.dtype, k: int, n: int) -> bool:
    """Whether torch._grouped_mm runs forward and backward for this device, dtype and [K, N] (probed once)."""
    key = (device.type, dtype, k, n)
    if key not in _GROUPED_OK:
        ok = hasattr(torch, "_grouped_mm")
        if ok:
            try:
                with torch.enable_grad():   # the first call may come from a no-grad forward (log-probs)
                    a = torch.zeros(16, k, device=device, dtype=dtype, requires_grad=True)
                    b = torch.zeros(2, n, k, device=device, dtype=dtype, requires_grad=True)
                    offs = torch.tensor([8, 16], device=device, dtype=torch.int32)
                    y = torch._grouped_mm(a, b.transpose(-2, -1), offs=offs)
                    y.backward(torch.ones_like(y))
            except (RuntimeError, NotImplementedError, TypeError):
                ok = False
        _GROUPED_OK[key] = ok
    return _GROUPED_OK[key]


def grouped_linear(x: torch.Tensor, w: torch.Tensor, layout: GroupLayout, force_loop: bool = False) -> torch.Tensor:
    """y[rows of expert e] = x[rows of e] @ w[e]^T for w [E, N, K]: one grouped GEMM (autograd: one for
    grad_x, one for grad_w), or a per-expert loop where the grouped kernel is not available (and for no rows
    at all, where the loop gives every expert the zero gradient the per-expert path gives it)."""
    E, N, K = w.shape
    if not force_loop and x.shape[0] > 0 and grouped_mm_available(x.device, x.dtype, K, N):
        y = torch._grouped_mm(layout.pad(x), w.transpose(-2, -1), offs=layout.offs)
        if y.requires_grad:   # the grouped backward needs real strides (an expanded gradient, e.g. of a sum, has 0)
            y.register_hook(lambda g: g.contiguous())
        return layout.unpad(y)
    parts = torch.split(x, layout.counts())
    return torch.cat([p @ w[e].t() for e, p in enumerate(parts)], dim=0)


class _StackedWeights(torch.autograd.Function):
    """Forward: the experts' weights as one [E, N, K] tensor -- their stack, or a value computed from them
    (the cached QAT weight); backward: the gradient split back onto each expert's weight."""

    @staticmethod
    def forward(ctx, value, *weights):
        return torch.stack(weights) if value is None else value.detach()

    @staticmethod
    def backward(ctx, grad):
        return (None, *grad.unbind(0))


@dataclass
class _QuantizedWeights:
    key: tuple
    effective: torch.Tensor               # [E, N, K]: W + (fq(W) - W), the value QAT's forward uses
    fp4: list                             # per expert FP4Tensor (the same bytes the weight sync sends)


def _global_module_hooks() -> bool:
    """torch.nn.modules.module.register_module_forward(_pre)_hook hooks would miss the expert linears' calls."""
    from torch.nn.modules import module as m

    return bool(m._global_forward_pre_hooks or m._global_forward_hooks)


# ------------------------------------------------------------------------------------------- the MLP
class QATGroupedMLP(QATSequentialMLP):
    """QATSequentialMLP with grouped GEMMs and fused FP4 QAT (see the module docstring)."""

    ROLES = ("fc1", "fc2")
    force_loop = False   # tests: the per-expert GEMM loop in place of torch._grouped_mm, same layout

    def _linears(self, role: str) -> list:
        return [getattr(e, f"linear_{role}") for e in self.local_experts]

    def _grouped_applies(self) -> bool:
        """The grouped path computes exactly the per-expert function for the current hooks and settings."""
        c = self.config
        if c.moe_apply_probs_on_input or getattr(c, "fp8", None) or getattr(c, "fp4", None):
            return False
        if _global_module_hooks():
            return False
        for role, base in (("fc1", FP4ColumnParallelLinear), ("fc2", FP4RowParallelLinear)):
            lins = self._linears(role)
            first = lins[0]
            if not isinstance(first, base) or is_lora_linear(first) or first.bias is not None:
                return False
            if any(lin.site.capture_sink is not None or lin._forward_pre_hooks or lin._forward_hooks for lin in lins):
                return False      # capture (the engine's TRACE record) or hooks observe each expert's own call
            provider = first.site.guide_provider
            if provider is not None and not (hasattr(provider, "for_experts") and first.quant.format == "nvfp4"):
                return False
        return True

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        if not self.local_experts or not self._grouped_applies():
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        x = permuted_local_hidden_states
        layout = GroupLayout.build(tokens_per_expert, x.shape[0], self.num_local_experts, x.device,
                                   gemm_alignment(x))
        h = grouped_linear(self._quant_input("fc1", x, layout), self._weights("fc1"), layout, self.force_loop)
        h = _activation(self.config, h)
        h = (h * permuted_probs.unsqueeze(-1)).to(h.dtype)
        out = grouped_linear(self._quant_input("fc2", h, layout), self._weights("fc2"), layout, self.force_loop)
        return out, None

    # ---------------------------------------------------------------------------------- activations
    def _input_amax(self, x: torch.Tensor, layout: GroupLayout, lin, expert_tp: bool = True) -> torch.Tensor:
        """Per local expert, the amax QATSequentialMLP and the FP4 linear give that expert's input: the
        expert's rows, MAX over the TP group when TP peers hold replicas of it, and (fc2, K-sharded) over the
        expert tensor-parallel group."""
        amax = expert_amax(x, layout.row_expert, self.num_local_experts)
        if self._needs_amax_reduction():     # experts replicated over TP peers that route other tokens
            first = self.ep_group.rank() * self.num_local_experts
            full = torch.zeros(self.ep_group.size() * self.num_local_experts, dtype=torch.float32, device=x.device)
            full[first:first + self.num_local_experts] = amax
            from megatron.core import parallel_state as ps

            amax = reduce_max(full, ps.get_tensor_model_parallel_group())[first:first + self.num_local_experts]
        if expert_tp and lin._input_sharded():   # fc2: K-sharded over the expert tensor-parallel group
            amax = reduce_max(amax.contiguous(), lin._tp())
        return amax

    def _quant_input(self, role: str, x: torch.Tensor, layout: GroupLayout) -> torch.Tensor:
        lin = self._linears(role)[0]
        q = lin.quant
        if not (q.enabled and q.activations):
            return x
        if x.shape[0] == 0:   # nothing to quantize here, but TP peers may have rows: take part in their all-reduce
            if self._needs_amax_reduction():
                self._input_amax(x, layout, lin, expert_tp=False)
            return x
        site = lin.site
        provider = site.guide_provider
        guide = provider.for_experts(site, self.num_local_experts, x) if provider is not None else None
        if guide is None:
            if q.format == "nvfp4":
                gs = row_scales(self._input_amax(x, layout, lin), layout.row_expert)
                deq, _ = fake_quant_rows(x, "nvfp4", gs)
            else:
                deq, _ = fake_quant_rows(x, q.format)
            return straight_through(x, deq)
        if self._needs_amax_reduction():     # the reference's TP collective runs on every rank, guided or not
            self._input_amax(x, layout, lin, expert_tp=False)
        from megatron_qrl.trace.replay import replay_rows

        own = row_scales(expert_amax(x, layout.row_expert, self.num_local_experts), layout.row_expert)
        return straight_through(x, replay_rows(x, guide, own, q.fallback_shift, site.stats))

    # ---------------------------------------------------------------------------------- weights
    def _weight_key(self, lins) -> tuple:
        q = lins[0].quant
        return (_WEIGHT_EPOCH[0], q.format, tuple((lin.weight.data_ptr(), lin.weight._version, lin.weight.dtype)
                                                  for lin in lins))

    def _quantized(self, role: str) -> _QuantizedWeights:
        """The role's QAT weights for the current parameter values: one codec launch for all experts per
        weight change, shared by the forward (effective weight) and the weight sync (FP4 bytes)."""
        lins = self._linears(role)
        key = self._weight_key(lins)
        cache = getattr(self, "_qat_weights", None)
        if cache is None:
            cache = self._qat_weights = {}
        hit = cache.get(role)
        if hit is None or hit.key != key:
            with torch.no_grad():
                w = torch.stack([lin.weight.detach() for lin in lins])
                fmt = lins[0].quant.format
                deq, packed, scales, gs = quantize_stacked_weights(w, fmt, lins[0]._tp())
                effective = w + (deq - w)   # exactly straight_through's value, as each FP4 linear computes it
                fp4 = [FP4Tensor(fmt, packed[e], scales[e], gs[e] if gs is not None else None)
                       for e in range(len(lins))]
            hit = cache[role] = _QuantizedWeights(key, effective, fp4)
        return hit

    def _weights(self, role: str) -> torch.Tensor:
        lins = self._linears(role)
        q = lins[0].quant
        value = self._quantized(role).effective if (q.enabled and q.weights) else None
        return _StackedWeights.apply(value, *(lin.weight for lin in lins))

    def fp4_weights(self, fmt: str) -> dict:
        """{'local_experts.{j}.linear_fcX.weight': FP4Tensor} of the current weights in `fmt` when this
        module's QAT quantizes its weights in that format (the bytes its forward uses); else {}."""
        out = {}
        for role in self.ROLES:
            lins = self._linears(role)
            q = lins[0].quant
            if not (q.enabled and q.weights and q.format == fmt) or lins[0]._tp() is not None:
                continue
            for j, t in enumerate(self._quantized(role).fp4):
                out[f"local_experts.{j}.linear_{role}.weight"] = t
        return out


def grouped_expert_modules(model):
    """(module name, QATGroupedMLP) of a model or list of chunks."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    for c in chunks:
        for name, m in c.named_modules():
            if isinstance(m, QATGroupedMLP):
                yield name, m
