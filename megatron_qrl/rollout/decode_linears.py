"""Dense FP4 linears of one decode step (qkv and proj under quant.targets=all_linears), graph-capturable.

The eager engine runs such a linear as: (W4A4) its own input hook -- NVFP4/MXFP4 fake quantization with a
dynamic per-tensor global scale (amax over the rows of the call) and, for a cached TRACE layer, a capture
record -- then the GEMM over the synced FP4 weight (`w4a16_gemm` on `lin.kernel_weight` on the kernel path,
kernel_linears.py; else a matmul over the dequantized parameter). `DenseFP4Linear` computes the same thing
as plain tensor code: no capture sink, no host synchronisation, no data-dependent shape. Differences that
matter for the static step:
- inactive rows (finished sequences, bucket padding) are zeroed before the amax, so the global scale is the
  eager engine's over the step's active rows (the eager step holds exactly those tokens);
- the capture comes back as tensors [B, ...] (one row per token, the layout `capture._dense_rows` gives
  dense sites: bits, scales, global_scale [B], codes), which the graph loop copies into its ring.
Weights are read from the linear at every call (`lin.weight`, `lin.kernel_weight`): weight syncs update
both in place (WeightStore.materialize, kernel_linears._install), so captured graphs see new weights.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron_qrl.quant.e2m1 import E2M1_MAX
from megatron_qrl.quant.formats import FP4_FORMATS, fp4_format
from megatron_qrl.quant.nvfp4 import E4M3_MAX


class DenseFP4Linear:
    """One quantized dense linear of the engine model, as the static decode step runs it (module docstring)."""

    def __init__(self, lin, fmt: Optional[str], w4a4: bool, capture: bool, keep_codes: bool, kernels: bool):
        self.lin, self.format, self.w4a4 = lin, fp4_format(fmt) if fmt is not None else None, w4a4
        self.capture, self.keep_codes, self.kernels = capture and w4a4, keep_codes, kernels
        self.site = lin.site
        self.width = lin.site.k_total           # the input width (TP = 1: the whole K)
        # nvfp4_global_scale's divisor, made once: a tensor built inside a CUDA graph capture would be a
        # host->device copy, and dividing by a Python scalar may round differently on CUDA (its docstring)
        # (the weight's device: a packed-only weight keeps an empty tensor on it, EmbeddedEngine._free_dense_copies)
        dev = next((t for t in (*lin.parameters(), *lin.buffers()) if t.numel()), lin.weight).device
        self._divisor = torch.tensor(E2M1_MAX * E4M3_MAX, dtype=torch.float32, device=dev)
        # 0 and 1 for torch.where, made once: a Python scalar or ones_like fills a fresh device tensor per call
        self._zero = torch.zeros((), dtype=torch.float32, device=dev)
        self._one = torch.ones((), dtype=torch.float32, device=dev)

    def __call__(self, x: torch.Tensor, active: torch.Tensor) -> tuple[torch.Tensor, Optional[dict]]:
        """x [B, K], active bool [B] -> (y [B, N], capture {bits, scales, global_scale, codes} or None)."""
        x, cap = self.quantize(x, active)
        return self.gemm(x), cap

    def quantize(self, x: torch.Tensor, active: torch.Tensor) -> tuple[torch.Tensor, Optional[dict]]:
        """The GEMM's input: (W4A4) the eager hook's fake quantization over the active rows, and its capture."""
        cap = None
        if self.w4a4:
            x = torch.where(active[:, None], x, self._zero)       # keeps x's dtype
            gs = self._global_scale(x) if self.format.has_global_scale else None
            # the format object picks the codec as the eager hook does; on the kernel path the Triton
            # fake-quant (+ capture) kernel, byte-identical to the torch codec
            x, enc = self.format.fake_quant(x, gs, capture=self.capture, check_finite=False,
                                            kernels=True if self.kernels else None)
            if enc is not None:
                cap = {"bits": enc.bits, "scales": enc.scales}
                if gs is not None:
                    cap["global_scale"] = gs.reshape(1).expand(x.shape[0])
                if self.keep_codes:
                    cap["codes"] = enc.packed
        return x, cap

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T over the synced FP4 weight: the W4A16 kernel on the kernel path, else the dequantized parameter."""
        if self.kernels:
            from megatron_qrl.kernels.w4a16_gemm import w4a16_gemm

            return w4a16_gemm(x, self.lin.kernel_weight)
        return F.linear(x, self.lin.weight)

    def _global_scale(self, x: torch.Tensor) -> torch.Tensor:
        """`nvfp4_global_scale(x)` (the eager hook's rule, the same operations) without a new device tensor."""
        amax = x.abs().amax().float()
        return torch.where(amax > 0, amax, self._one) / self._divisor


def dense_fp4_linears(engine) -> dict:
    """{linear module: DenseFP4Linear} for the engine model's FP4 attention linears (none without them)."""
    from megatron_qrl.models import fp4_linears
    from megatron_qrl.models.lora import is_lora_linear

    if engine.format not in FP4_FORMATS:
        return {}
    on_kernels = {id(lin) for lin in engine.kernels.dense.values()} if engine.kernels is not None else set()
    sites = engine.trace_recorder.sites
    return {lin: DenseFP4Linear(lin, engine.format, engine.scheme == "w4a4", lin.site.name in sites,
                                engine.keep_codes, id(lin) in on_kernels)
            for lin in fp4_linears(engine.model)
            if lin.site.expert is None and lin.quant.format in FP4_FORMATS and lin.site.role in ("qkv", "proj")
            and not is_lora_linear(lin)}      # LoRA linears: decode_lora.py


def capture_widths(linears: dict) -> dict[int, dict[str, int]]:
    """layer -> role -> input width of the runners that capture TRACE (graph_decode.record_shapes)."""
    out: dict[int, dict[str, int]] = {}
    for run in linears.values():
        if run.capture:
            out.setdefault(run.site.layer, {})[run.site.role] = run.width
    return out


__all__ = ["DenseFP4Linear", "capture_widths", "dense_fp4_linears"]
