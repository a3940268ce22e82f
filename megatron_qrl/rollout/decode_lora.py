"""LoRA adapters (QeRL mode, docs/lora.md) in the static decode step, graph-capturable.

The eager engine runs a LoRA linear as  y = base(x_q) + (x @ A^T) @ B^T * scale  (models/lora.py): x_q is the
W4A4-quantized input (FP4 base under W4A4, with the TRACE capture of the linear's own hook), the low-rank delta
sees the unquantized x, everything in the model dtype. Here:

- `LoRADenseLinear` (qkv / proj): DenseFP4Linear's input quantization and capture, the base GEMM through the
  linear's own `base_matmul` (the W4A16 kernel on CUDA, the cached dequantized base elsewhere) and the delta
  with the eager op sequence: the same numbers as the eager linear.
- `LoRAKernelExperts` (routed experts over an FP4 base, kernel path): the grouped W4A16 kernels over the
  experts' frozen base (prepared once: it never changes) and the adapters of all experts as stacked tensors.
  The fc1 delta joins before SwiGLU, so fc1 runs unfused: each (token, slot) is one row in expert order through
  the sorted-rows kernel (`moe_down`'s, with unit weights), which writes it back in (token, slot) order.
  Each delta is every row's  (x A_e^T) B_e^T  with no data-dependent shape: at few assignments per expert two
  torch._grouped_mm over the rows in the kernels' expert order (group ends from the routing on the device),
  reading only the touched experts' adapters; at more, two dense GEMMs against all experts' A and B with the
  other experts' blocks exactly zero (`GROUPED_BELOW`).
The adapter parameters of the experts become views of the stacks, so weight syncs (in place) reach the graphs.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron_qrl.quant.formats import FP4_FORMATS

from .decode_experts import FP4KernelExperts
from .decode_linears import DenseFP4Linear


def adapter_delta(lin, x: torch.Tensor) -> torch.Tensor:
    """scale * (x @ A^T) @ B^T with the eager LoRA linear's operations (TP = 1: no region copies)."""
    return (x.matmul(lin.lora_A.t().to(x.dtype))).matmul(lin.lora_B.t().to(x.dtype)) * lin.lora_scale


class LoRADenseLinear(DenseFP4Linear):
    """One LoRA attention linear of the engine model, as the static decode step runs it."""

    def __init__(self, lin, w4a4: bool, capture: bool, keep_codes: bool):
        fp4 = lin.base_format in FP4_FORMATS
        super().__init__(lin, lin.base_format if fp4 else None, w4a4 and fp4, capture, keep_codes, kernels=False)

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin.base_matmul(x)

    def __call__(self, x: torch.Tensor, active: torch.Tensor) -> tuple[torch.Tensor, Optional[dict]]:
        xq, cap = self.quantize(x, active)
        y = self.gemm(xq)
        if self.lin.lora_rank:
            y = y + adapter_delta(self.lin, x)
        return y, cap


def stack_as_views(params: list) -> torch.Tensor:
    """torch.stack of the parameters' data, each parameter then a view of its row of the stack (in-place
    updates of a parameter land in the stack; the stack's address stays fixed for captured graphs)."""
    stack = torch.stack([p.data for p in params])
    for j, p in enumerate(params):
        p.data = stack[j]
    return stack


# Below this many (token, slot) assignments per expert the deltas run as grouped GEMMs in expert order (reading
# only the touched experts' adapters); from it on, as two dense GEMMs against every expert's A and B (H100, 4
# layers, rank 16: 128 tiny grouped GEMMs cost ~44 us each at 2,048 assignments; dense 97.8k vs grouped 81.8k
# tok/s at batch 256, grouped faster at batch 1: docs/PERF.md "Session of 2026-12-06 (third)").
GROUPED_BELOW = 1.0


class _Adapters:
    """The adapters of one role (fc1 or fc2) of every expert: A [E, r, K], B [E, N, r] (None without adapters)."""

    def __init__(self, linears: list):
        self.rank = linears[0].lora_rank
        self.scale = linears[0].lora_scale
        self.A = stack_as_views([lin.lora_A for lin in linears]) if self.rank else None
        self.B = stack_as_views([lin.lora_B for lin in linears]) if self.rank else None

    def grouped(self, xs: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """Rows xs [P, K] in expert order (expert e's rows end at offs[e]) -> scale * (x A_e^T) B_e^T [P, N],
        the eager delta's operations per expert (rows past offs[-1] are garbage: the caller drops them)."""
        u = torch._grouped_mm(xs, self.A.transpose(1, 2).to(xs.dtype), offs=offs)
        return torch._grouped_mm(u, self.B.transpose(1, 2).to(xs.dtype), offs=offs) * self.scale

    def dense(self, rows: torch.Tensor, src: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """Input rows [m, K], each assignment's row src [n] and expert [n] -> scale * (x A_e^T) B_e^T [n, N] in
        assignment order: x A^T against every expert's A, each assignment's own block of it placed in an
        otherwise zero row (exact zeros), times every expert's B."""
        e, r, k = self.A.shape
        n = src.shape[0]
        u = rows.matmul(self.A.view(e * r, k).t().to(rows.dtype)).view(-1, r)          # [m * e, r]
        sel = u.index_select(0, src * e + expert)                                       # [n, r]
        blocks = torch.zeros((n, e, r), dtype=u.dtype, device=u.device)
        blocks.scatter_(1, expert.view(n, 1, 1).expand(n, 1, r), sel.unsqueeze(1))
        b = self.B.transpose(1, 2).reshape(e * r, -1).to(rows.dtype)                   # [e * r, N]
        return blocks.view(n, e * r).matmul(b) * self.scale


def group_ends(routing, e: int) -> torch.Tensor:
    """int32 [e]: where each expert's (block-padded) sorted rows end, for torch._grouped_mm (no host sync);
    the routing's blocks come in expert order."""
    blocks = routing.block_expert
    counts = torch.zeros(e + 1, dtype=torch.int32, device=blocks.device)
    counts.scatter_add_(0, torch.where(blocks >= 0, blocks, e).long(), torch.ones_like(blocks, dtype=torch.int32))
    return torch.cumsum(counts[:e] * routing.block_m, 0, dtype=torch.int32)


class _BaseStacks:
    """The experts' frozen FP4 base as the grouped kernels' prepared stacks (what kernel_linears builds from
    synced payloads; here from the LoRA linears' packed buffers, which never change)."""

    def __init__(self, fc1: list, fc2: list, fmt: str):
        self.w13, self.w2 = self._prepare(fc1, fmt), self._prepare(fc2, fmt)

    @staticmethod
    def _prepare(linears: list, fmt: str):
        from megatron_qrl.kernels import prepare_weight

        parts = [lin._base_fp4() for lin in linears]
        gs = torch.stack([p[2].float() for p in parts]) if parts[0][2] is not None else None
        return prepare_weight(fmt, torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]), gs)


class LoRAKernelExperts(FP4KernelExperts):
    """Routed LoRA experts over an FP4 base: grouped W4A16 kernels + stacked adapters (module docstring)."""

    def __init__(self, mlp, fmt: str, w4a4: bool, capture: bool, keep_codes: bool):
        experts = mlp.local_experts
        fc1 = [e.linear_fc1 for e in experts]
        fc2 = [e.linear_fc2 for e in experts]
        super().__init__(_BaseStacks(fc1, fc2, fmt), fmt, w4a4, capture, keep_codes)
        self.fc1, self.fc2 = _Adapters(fc1), _Adapters(fc2)
        dtype = fc1[0].lora_A.dtype                  # the model dtype: the pad rows of the sorted gathers
        self._zero_x = torch.zeros((1, self.runner.w13.k), dtype=dtype, device=self._zero.device)
        self._zero_h = torch.zeros((1, self.runner.w2.k), dtype=dtype, device=self._zero.device)

    def takes_fp16_operand(self, n_assign: int) -> bool:
        return False          # fc1 runs on the sorted-rows kernel over bf16 rows

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor, active: torch.Tensor,
                 routing=None, x_operand: Optional[torch.Tensor] = None):
        from dataclasses import replace

        from megatron_qrl.kernels.decode_routing import align_only
        from megatron_qrl.kernels.moe_grouped_gemm import heuristic_moe_config, moe_down

        w13, w2 = self.runner.w13, self.runner.w2
        B, k = ids.shape
        n, e, dtype = B * k, w13.num_experts, x.dtype
        flat = ids.reshape(-1).long()
        rows = torch.where(active[:, None], x, self._zero).unsqueeze(1).expand(B, k, x.shape[-1]).reshape(n, -1)
        xq, cap1 = self._quantize(rows, flat, e) if self.w4a4 else (rows, None)
        gu = replace(heuristic_moe_config(n, e, w13.n, w13.k, False, w13.fmt), x_pre=False)
        dn = replace(heuristic_moe_config(n, e, w2.n, w2.k, False, w2.fmt), x_pre=False)
        if routing is not None and routing.block_m == gu.block_m == dn.block_m:
            routing = replace(routing, n_tokens=n, top_k=1)     # row t*k + j is assignment t*k + j
        else:
            routing = align_only(flat.unsqueeze(1), e, gu.block_m)
            dn = replace(dn, block_m=gu.block_m)
        sid = routing.sorted_ids.long()                          # assignment per sorted row (pad = n)
        ones = torch.ones(n, dtype=torch.float32, device=x.device)
        xs = torch.cat([rows, self._zero_x])[sid]                # rows in expert order, pads zero
        xqs = xs if xq is rows else torch.cat([xq, self._zero_x])[sid]
        grouped = n < GROUPED_BELOW * e
        if grouped:   # where each assignment's sorted row is, and where each expert's rows end
            pos = torch.zeros(n + 1, dtype=torch.long, device=x.device)
            pos = pos.scatter_(0, sid, torch.arange(sid.numel(), device=x.device))[:n]
            offs = group_ends(routing, e)
        # fc1 without its SwiGLU epilogue: the sorted-rows kernel (moe_down's) writes (token, slot) order
        g = moe_down(xqs.to(torch.bfloat16), w13, routing, ones, gu).to(dtype)
        if self.fc1.rank:
            token = torch.arange(n, device=x.device) // k
            g = g + (self.fc1.grouped(xs, offs).index_select(0, pos) if grouped
                     else self.fc1.dense(rows.view(B, k, -1)[:, 0], token, flat))
        gate, up = torch.chunk(g, 2, dim=-1)
        # Megatron's SwiGLU, then the router probability before fc2 (rounded to the model dtype)
        h = ((F.silu(gate) * up) * probs.reshape(-1, 1).float()).to(dtype)
        hq, cap2 = self._quantize(h, flat, e) if self.w4a4 else (h, None)
        hs = torch.cat([h, self._zero_h])[sid]
        hqs = hs if hq is h else torch.cat([hq, self._zero_h])[sid]
        y = moe_down(hqs.to(torch.bfloat16), w2, routing, ones, dn).to(dtype)
        if self.fc2.rank:
            y = y + (self.fc2.grouped(hs, offs).index_select(0, pos) if grouped
                     else self.fc2.dense(h, torch.arange(n, device=x.device), flat))
        out = y.view(B, k, -1)
        if cap1 is None:
            return out, None
        shape = lambda t: t.view(B, k, *t.shape[1:])   # noqa: E731
        return out, {"fc1": {n_: shape(t) for n_, t in cap1.items()}, "fc2": {n_: shape(t) for n_, t in cap2.items()}}


def lora_dense_linears(engine) -> dict:
    """{linear: LoRADenseLinear} for the engine model's LoRA attention linears (none outside QeRL mode)."""
    from megatron_qrl.models.lora import lora_linears

    sites = engine.trace_recorder.sites
    w4a4 = engine.scheme == "w4a4"
    return {lin: LoRADenseLinear(lin, w4a4, lin.site.name in sites, engine.keep_codes)
            for lin in lora_linears(engine.model) if lin.site.expert is None and lin.site.role in ("qkv", "proj")}


def lora_experts(mlp) -> bool:
    """Whether an expert MLP's linears are LoRA linears."""
    from megatron_qrl.models.lora import is_lora_linear

    return is_lora_linear(mlp.local_experts[0].linear_fc1)


__all__ = ["LoRADenseLinear", "LoRAKernelExperts", "adapter_delta", "lora_dense_linears", "lora_experts",
           "stack_as_views"]
