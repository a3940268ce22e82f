"""Routed-expert MLPs of one decode step (one new token per row), one implementation per weight form.

All take the step's rows x [B, H], the router's top-k ids / probabilities [B, k] and the rows' `active`
mask, and return (y, TRACE capture or None): y is the combined output [B, H], or the k weighted slot outputs
[B, k, H] (the grouped paths) which the step sums in fp32 in slot order (`sum_slots`, or fused into the next
residual add + norm: kernels/decode_fused.py). A capture is {"fc1": rows, "fc2": rows} with each rows
a dict of tensors [B, k, ...] in (token, slot) order -- bits, scales, global_scale (NVFP4), codes -- the
layout `ActivationCapture` gives routed-expert roles. Inactive rows (finished sequences, bucket padding)
never change what active rows compute: their inputs are zeroed before any per-expert amax.

- `MegatronExperts`: the reference. Calls the model's own expert MLPs (Megatron SequentialMLP members,
  with their FP4 hooks) on each expert's rows in the token dispatcher's order, so it computes what the
  eager engine computes. Dynamic shapes and host synchronisation: never inside a CUDA graph.
- `FP4KernelExperts`: the CUDA-graph path for FP4 weights on the grouped W4A16 Triton kernels (W4A16, and
  W4A4 with each expert's dynamic global scale and capture in one fake-quant launch per role). Its `route`
  does the router's top-k, probabilities and the kernels' expert alignment in one or two launches
  (kernels/decode_routing.py); the call then takes that precomputed routing.
- `GroupedBF16Experts`: the CUDA-graph path for BF16 weights through torch._grouped_mm, so FP4 vs BF16
  compares weights, not loops.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

Capture = Optional[dict[str, dict[str, torch.Tensor]]]


def expert_row_scales(row_amax: torch.Tensor, row_expert: torch.Tensor, num_experts: int,
                      one: Optional[torch.Tensor] = None) -> torch.Tensor:
    """NVFP4 global scale of each row's expert: amax over that expert's rows / (6 * 448) (zero -> 1/(6*448)).
    one: a float32 1 on the device, made once by the caller (saves a fill launch per call)."""
    from megatron_qrl.quant.nvfp4 import E4M3_MAX, e2m1

    amax = torch.zeros(num_experts, dtype=torch.float32, device=row_amax.device)
    amax.scatter_reduce_(0, row_expert, row_amax.float(), reduce="amax", include_self=True)
    amax = torch.where(amax > 0, amax, torch.ones_like(amax) if one is None else one)
    return (amax / (e2m1.E2M1_MAX * E4M3_MAX))[row_expert]


# ------------------------------------------------------------------------------------------- reference
class MegatronExperts:
    """The model's SequentialMLP experts, called expert by expert on the active rows (reference path)."""

    def __init__(self, mlp, capture: bool, keep_codes: bool):
        self.mlp, self.capture, self.keep_codes = mlp, capture, keep_codes

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor, active: torch.Tensor):
        B, k = ids.shape
        out = torch.zeros_like(x)
        sinks: dict[str, list] = {"fc1": [], "fc2": []}
        rows: dict[str, list] = {"fc1": [], "fc2": []}
        act = active[:, None].expand(B, k)
        for e, expert in enumerate(self.mlp.local_experts):
            tok, slot = torch.nonzero((ids == e) & act, as_tuple=True)   # ascending token: dispatcher order
            if tok.numel() == 0:
                continue
            if self.capture:
                expert.linear_fc1.site.capture_sink = sinks["fc1"]
                expert.linear_fc2.site.capture_sink = sinks["fc2"]
            try:
                y, _ = expert(x[tok], probs[tok, slot])
            finally:
                expert.linear_fc1.site.capture_sink = expert.linear_fc2.site.capture_sink = None
            out.index_add_(0, tok, y.to(out.dtype))
            for role in rows:
                rows[role].append(tok * k + slot)
        if not self.capture or not rows["fc1"]:      # no active row: nothing to record (rows stay unread)
            return out, None
        return out, {role: _scatter_capture(sinks[role], torch.cat(rows[role]) if rows[role] else None, B, k,
                                            self.keep_codes) for role in rows}


def _scatter_capture(records: list, assign: Optional[torch.Tensor], B: int, k: int, keep_codes: bool) -> dict:
    """Per-expert CaptureRecords (rows in dispatcher order) -> tensors [B, k, ...] in (token, slot) order."""
    fields = {"bits": [r.bits for r in records], "scales": [r.scales for r in records]}
    if records and records[0].global_scale is not None:
        fields["global_scale"] = [r.global_scale.float().reshape(1).expand(r.bits.shape[0]) for r in records]
    if keep_codes:
        fields["codes"] = [r.packed for r in records]
    out = {}
    for name, parts in fields.items():
        dtype = parts[0].dtype
        raw = torch.cat([_bytes(p.reshape(p.shape[0], -1) if p.dim() > 1 else p) for p in parts])
        dest = torch.zeros((B * k, *raw.shape[1:]), dtype=raw.dtype, device=raw.device)
        dest[assign] = raw
        out[name] = dest.view(dtype).view(B, k, *raw.shape[1:])
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """float8 tensors as uint8 (cat and indexing kernels need not support float8)."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


# --------------------------------------------------------------------------------------- FP4 kernels
class FP4KernelExperts:
    """Grouped W4A16 kernels over the prepared expert stacks of one layer (kernel_linears.GroupedExperts)."""

    def __init__(self, runner, fmt: str, w4a4: bool, capture: bool, keep_codes: bool):
        self.runner, self.fmt, self.w4a4 = runner, fmt, w4a4
        self.capture, self.keep_codes = capture and w4a4, keep_codes
        # W4A4 constants, made once: a Python scalar in torch.where, new_zeros or ones_like would fill a fresh
        # device tensor (one launch) at every call; torch.where keeps x's dtype with these 0-dim float32 ones
        dev = runner.w13.device
        self._zero = torch.zeros((), dtype=torch.float32, device=dev)
        self._one = torch.ones((), dtype=torch.float32, device=dev)
        self._zero_row = torch.zeros((1, runner.w13.n // 2), dtype=torch.bfloat16, device=dev)   # the pad row of h

    def _quantize(self, rows: torch.Tensor, row_expert: torch.Tensor, num_experts: int):
        """W4A4 input of one role: (dequantized rows, capture dict or None), one launch."""
        from megatron_qrl.kernels.fp4_fake_quant import (fp4_fake_quant_capture_triton, mxfp4_fake_quant_triton,
                                                         nvfp4_fake_quant_triton)

        gs = None
        if self.fmt == "nvfp4":
            gs = expert_row_scales(rows.abs().amax(-1), row_expert, num_experts, self._one).unsqueeze(-1)
        if not self.capture:
            if gs is None:
                return mxfp4_fake_quant_triton(rows, check_finite=False), None
            return nvfp4_fake_quant_triton(rows, global_scale=gs, check_finite=False), None
        deq, packed, scales, bits = fp4_fake_quant_capture_triton(rows, self.fmt, gs)
        cap = {"bits": bits, "scales": scales}
        if gs is not None:
            cap["global_scale"] = gs.reshape(-1)
        if self.keep_codes:
            cap["codes"] = packed
        return deq, cap

    def _block_m(self, n_assign: int) -> int:
        """The gate/up kernel's block_m for n_assign assignments (what moe_w4a16 and _w4a4 pick)."""
        from megatron_qrl.kernels.moe_grouped_gemm import heuristic_moe_config

        w13 = self.runner.w13
        return heuristic_moe_config(n_assign, w13.num_experts, w13.n // 2, w13.k, True, w13.fmt,
                                    tile=w13.tile).block_m

    def route(self, logits: torch.Tensor, top_k: int, pre_softmax: bool = False,
              scaling_factor: Optional[float] = None, routed: Optional[torch.Tensor] = None):
        """Router logits [B, E] -> (probs [B, k], ids [B, k], MoERouting for this layer's kernels); routed: an
        int16 [B, k] view that gets the ids too (the step's R3 record, decode_routing.route_and_align)."""
        from megatron_qrl.kernels.decode_routing import route_and_align

        return route_and_align(logits, top_k, self._block_m(logits.shape[0] * top_k), pre_softmax=pre_softmax,
                               scaling_factor=scaling_factor, routed=routed)

    def takes_fp16_operand(self, n_assign: int) -> bool:
        """Whether a call with n_assign (token, slot) assignments converts its input to the gate/up kernel's
        fp16 operand (W4A16 on the tensor-core path): then the step's norm writes that operand too and the
        call takes it as x_operand, one launch fewer."""
        from megatron_qrl.kernels.moe_grouped_gemm import converts_input, heuristic_moe_config

        w13 = self.runner.w13
        cfg = heuristic_moe_config(n_assign, w13.num_experts, w13.n // 2, w13.k, True, w13.fmt, tile=w13.tile)
        return not self.w4a4 and converts_input(cfg, w13.fmt)

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor, active: torch.Tensor,
                 routing=None, x_operand: Optional[torch.Tensor] = None):
        """routing: the MoERouting of ids from `route` (None: aligned here); x_operand: the fp16 operand of x
        (W4A16, see takes_fp16_operand), else converted here if the kernel wants it."""
        from megatron_qrl.kernels.moe_grouped_gemm import moe_w4a16

        w13, w2 = self.runner.w13, self.runner.w2
        if not self.w4a4:      # W4A16: rows are independent in every kernel, inactive ones need no zeroing
            y = moe_w4a16(x.to(torch.bfloat16), w13, w2, ids, probs, routing=routing, combine=False,
                          x_operand=x_operand)
            return y.to(x.dtype), None       # [B, k, H]: the step sums the slots in fp32, as the unpermute does
        return self._w4a4(torch.where(active[:, None], x, self._zero), ids, probs, routing)

    def _w4a4(self, x: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor, routing=None):
        """Each (token, slot) is its own row: its expert's input scale, then the kernels with top-1 routing.
        Inputs are quantized in the model's dtype, as the eager engine's grouped experts do. The top-1
        alignment of the B*k rows has the same sorted ids as the [B, k] one (row t*k + j is assignment
        t*k + j), so a precomputed routing is only relabelled."""
        from dataclasses import replace

        from megatron_qrl.kernels.decode_routing import align_only
        from megatron_qrl.kernels.moe_grouped_gemm import heuristic_moe_config, moe_down, moe_gate_up

        w13, w2 = self.runner.w13, self.runner.w2
        B, k = ids.shape
        n, e, f = B * k, w13.num_experts, w13.n // 2
        dtype = x.dtype
        flat = ids.reshape(-1).long()
        rows = x.unsqueeze(1).expand(B, k, x.shape[-1]).reshape(n, -1)
        xq, cap1 = self._quantize(rows, flat, e)
        gu = replace(heuristic_moe_config(n, e, f, w13.k, True, w13.fmt, tile=w13.tile), x_pre=False)
        dn = replace(heuristic_moe_config(n, e, w2.n, w2.k, False, w2.fmt, tile=w2.tile), x_pre=False)
        if routing is not None and routing.block_m == gu.block_m:
            routing = replace(routing, n_tokens=n, top_k=1)
        else:
            routing = align_only(flat.unsqueeze(1), e, gu.block_m)
        h_sorted = moe_gate_up(xq.to(torch.bfloat16), w13, routing, gu)
        sid = routing.sorted_ids.long()                                  # assignment per sorted row (pad = n)
        # every assignment < n is in sorted_ids once, so index_copy_ writes all of h[:n] (no zero fill needed);
        # the pads all land in the dump row n
        h = torch.empty((n + 1, f), dtype=h_sorted.dtype, device=h_sorted.device)
        h.index_copy_(0, sid, h_sorted)
        # Megatron scales the SwiGLU output by the router probability before fc2 (rounded to the model dtype);
        # the float32 product upcasts h inside the multiply: h.float() * p, without a copy of its own
        h = (h[:n] * probs.reshape(-1, 1).float()).to(dtype)
        hq, cap2 = self._quantize(h, flat, e)
        hq = torch.cat([hq.to(torch.bfloat16), self._zero_row])
        y = moe_down(hq[sid], w2, routing, torch.ones(n, dtype=torch.float32, device=hq.device), dn)
        out = y.view(B, k, -1).to(dtype)                                 # slot outputs, summed by the step
        if cap1 is None:
            return out, None
        shape = lambda t: t.view(B, k, *t.shape[1:])   # noqa: E731
        return out, {"fc1": {n_: shape(t) for n_, t in cap1.items()}, "fc2": {n_: shape(t) for n_, t in cap2.items()}}


# ----------------------------------------------------------------------------------------- BF16 grouped
class GroupedBF16Experts:
    """torch._grouped_mm over stacked expert weights; each expert's parameters become views of the stack,
    so the engine's in-place weight updates land in the stack (and in captured graphs)."""

    def __init__(self, mlp):
        experts = mlp.local_experts
        self.w13 = torch.stack([e.linear_fc1.weight.data for e in experts])      # [E, 2F, H]
        self.w2 = torch.stack([e.linear_fc2.weight.data for e in experts])       # [E, H, F]
        for j, e in enumerate(experts):
            e.linear_fc1.weight.data = self.w13[j]
            e.linear_fc2.weight.data = self.w2[j]

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor, active: torch.Tensor):
        B, k = ids.shape
        e = self.w13.shape[0]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)                         # assignments grouped by expert
        counts = torch.zeros(e, dtype=torch.int32, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        xs = torch.where(active[:, None], x, torch.zeros_like(x))[order // k]
        h = torch._grouped_mm(xs, self.w13.transpose(1, 2), offs=offs)
        gate, up = torch.chunk(h, 2, dim=-1)
        a = F.silu(gate) * up
        a = (a * probs.reshape(-1)[order].unsqueeze(-1)).to(x.dtype)
        y = torch._grouped_mm(a, self.w2.transpose(1, 2), offs=offs)
        out = torch.empty_like(y)
        out[order] = y
        return out.view(B, k, -1), None                                  # slot outputs, summed by the step
