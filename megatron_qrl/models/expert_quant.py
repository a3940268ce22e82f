"""FP4 fake quantization of a grouped expert call: all local experts' rows in one codec launch.

A grouped call holds the rows of every local expert in one tensor (Megatron's permuted order: expert by
expert). Blocks run along K, so a row's FP4 encoding depends only on the row and its tensor's NVFP4 global
scale; giving every row the global scale of its own expert (`row_scales`) makes one launch over all rows
produce exactly the bytes of one launch per expert (the codec accepts a global scale per row). MXFP4 has
no global scale at all. The same holds for the stacked expert weights ([E, N, K] -> E*N rows).
The format objects (quant/formats.py) run the Triton codec on CUDA and the torch codec elsewhere.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_qrl.quant.formats import FP4_FORMATS, fp4_format
from megatron_qrl.quant.nvfp4 import nvfp4_global_scales


def expert_amax(x: torch.Tensor, row_expert: torch.Tensor, n_experts: int) -> torch.Tensor:
    """fp32 [n_experts]: max |x| over each expert's rows (0 for an expert without rows), on x's device."""
    row_amax = x.detach().abs().amax(dim=-1).float()
    out = torch.zeros(n_experts, dtype=torch.float32, device=x.device)
    return out.scatter_reduce_(0, row_expert, row_amax, "amax", include_self=True)


def reduce_max(t: torch.Tensor, group) -> torch.Tensor:
    """All-reduce (MAX) over `group` when it has more than one rank; returns t (reduced in place)."""
    if group is not None and dist.is_initialized() and group.size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


def row_scales(amax: torch.Tensor, row_expert: torch.Tensor) -> torch.Tensor:
    """fp32 [rows, 1]: every row's NVFP4 global scale, that of its expert's amax."""
    return nvfp4_global_scales(amax).index_select(0, row_expert).unsqueeze(1).contiguous()


def fake_quant_rows(x: torch.Tensor, fmt: str, row_gs: Optional[torch.Tensor] = None, capture: bool = False):
    """dequant(quant(x)) of a 2-D tensor, nearest rounding, no gradient; NVFP4 with one global scale per row.

    Returns (values in x's dtype, (packed uint8 [rows, K/2], scales [rows, K/G], bits uint8 [rows, K/8])
    with capture=True, else None). No host synchronisation on CUDA.
    """
    if fmt not in FP4_FORMATS:
        raise ValueError(f"unknown FP4 format '{fmt}'; use nvfp4 or mxfp4")
    if fmt == "nvfp4" and row_gs is None:
        raise ValueError("NVFP4 rows need their global scales (row_scales)")
    deq, enc = fp4_format(fmt).fake_quant(x, row_gs, capture=capture, check_finite=False)
    return deq, ((enc.packed, enc.scales, enc.bits) if capture else None)


def quantize_stacked_weights(w: torch.Tensor, fmt: str, group=None):
    """The QAT weight quantizer of E experts at once: w [E, N, K] -> (dequantized [E, N, K] in w's dtype,
    packed uint8 [E, N, K/2], scales [E, N, K/G], global scales fp32 [E] or None for MXFP4).

    Each expert keeps its own global scale (amax all-reduced over `group`, the expert tensor-parallel group,
    as a sharded FP4 linear does), so the result equals quantizing every expert's weight on its own."""
    E, N, K = w.shape
    rows = w.detach().reshape(E * N, K)
    gs = None
    row_gs = None
    if fmt == "nvfp4":
        amax = reduce_max(w.detach().reshape(E, -1).abs().amax(dim=1).float(), group)
        gs = nvfp4_global_scales(amax)
        row_gs = gs.repeat_interleave(N).unsqueeze(1)
    deq, (packed, scales, _) = fake_quant_rows(rows, fmt, row_gs, capture=True)
    return deq.reshape(E, N, K), packed.reshape(E, N, -1), scales.reshape(E, N, -1), gs
