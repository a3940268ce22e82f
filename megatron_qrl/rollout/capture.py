"""Per-token records of one engine step: R3 routed experts and TRACE activation captures.

Both come from the model code the trainer runs: R3TopKRouter remembers its own top-k ids
(`last_topk_ids`, [tokens, k] in Megatron's [seq, batch]-flattened order = our packed order), and the FP4
linears hand a CaptureRecord per quantized activation site call to `capture_activations`. A routed
expert's record holds one row per token dispatched to it, in the token dispatcher's order: tokens of
that expert by ascending token index (Megatron's `permute` over the routing map, no capacity drops).
`scatter_records` turns those rows back into [token, slot] tensors using the routed ids; records of
dense sites (qkv, proj, shared experts: quantized with quant.targets=all_linears) already hold one row
per token and become [token] tensors.
"""
from __future__ import annotations

import contextlib
import re
from typing import Iterable, Optional

import torch

from .protocol import ActivationCapture

SITE = re.compile(r"^L(\d+)\.([a-z_0-9]+?)(?:\.E(\d+))?$")


class RoutingRecorder:
    """Collects the routers' own top-k choices after each forward, stacked over MoE layers."""

    def __init__(self, model: torch.nn.Module):
        from megatron_qrl.models import clear_replay, r3_routers

        clear_replay(model)   # the engine routes freely; replay is the trainer's business
        self.routers = sorted(r3_routers(model), key=lambda r: r.layer_index)
        if any(r.layer_index < 0 for r in self.routers):
            raise RuntimeError("routers carry no layer index; build the engine model with "
                               "megatron_qrl.models.build_model")
        self.layers = [r.layer_index for r in self.routers]

    @property
    def enabled(self) -> bool:
        return bool(self.routers)

    def collect(self, num_tokens: int) -> Optional[torch.Tensor]:
        """int16 [T, num_moe_layers, k] of the forward that just ran (None for a dense model)."""
        if not self.routers:
            return None
        ids = []
        for r in self.routers:
            if r.last_topk_ids is None or r.last_topk_ids.shape[0] != num_tokens:
                raise RuntimeError(f"router of layer {r.layer_index} recorded no top-k ids for this step's "
                                   f"{num_tokens} tokens")
            ids.append(r.last_topk_ids.to(torch.int16))
            r.last_topk_ids = None
        return torch.stack(ids, dim=1)


def traced_sites(model: torch.nn.Module, layers: Iterable[int]) -> set[str]:
    """Names of the activation-quantized sites of `layers` (routed experts, plus dense sites under
    quant.targets=all_linears) -- what the engine captures for TRACE."""
    from megatron_qrl.models import fp4_linears

    layers = set(layers)
    return {lin.site.name for lin in fp4_linears(model)
            if lin.quant.enabled and lin.quant.activations and lin.site.layer in layers}


@contextlib.contextmanager
def recording_trace(model: torch.nn.Module, sites: set[str]):
    """Yields the list the FP4 linears of `sites` append CaptureRecords to during the block."""
    if not sites:
        yield []
        return
    from megatron_qrl.models import capture_activations

    with capture_activations(model, sites) as records:
        yield records


def scatter_records(records: list, routed: Optional[torch.Tensor], num_tokens: int, moe_layers: list[int],
                    fmt: str, keep_codes: bool = False) -> dict[int, dict[str, ActivationCapture]]:
    """Capture records of one forward -> per layer and role an ActivationCapture over the step's tokens.

    Routed-expert roles get rows [T, k] (slot j = routed[:, layer, j]); dense roles rows [T]. routed: int
    [T, num_moe_layers, k] of the same forward. keep_codes also keeps the packed E2M1 codes
    (`ActivationCapture.codes`, for tests and debugging; the trainer needs only bits and scales).
    """
    layer_pos = {layer: i for i, layer in enumerate(moe_layers)}
    out: dict[int, dict[str, ActivationCapture]] = {}
    filled: dict[tuple[int, str], torch.Tensor] = {}
    for rec in records:
        match = SITE.match(rec.site)
        if match is None:
            raise RuntimeError(f"capture record of unknown site '{rec.site}'")
        layer, role = int(match.group(1)), match.group(2)
        if match.group(3) is None:
            _put_dense(out, rec, layer, role, num_tokens, fmt, keep_codes)
            continue
        expert = int(match.group(3))
        hit = routed[:, layer_pos[layer], :].long() == expert
        tokens, slots = hit.nonzero(as_tuple=True)      # row-major: ascending token index, as dispatched
        if tokens.numel() != rec.bits.shape[0]:
            raise RuntimeError(f"site {rec.site}: {rec.bits.shape[0]} captured rows but {tokens.numel()} tokens "
                               "routed to the expert; the token dispatcher dropped or reordered tokens")
        cap = out.setdefault(layer, {}).get(role)
        if cap is None:
            cap = out[layer][role] = _empty_capture(rec, (num_tokens, routed.shape[-1]), fmt, keep_codes)
            filled[(layer, role)] = torch.zeros(num_tokens, routed.shape[-1], dtype=torch.bool,
                                                device=routed.device)
        cap.bits[tokens, slots] = rec.bits
        cap.scales[tokens, slots] = rec.scales
        if cap.global_scale is not None:
            cap.global_scale[tokens, slots] = rec.global_scale.float()
        if keep_codes:
            cap.codes[tokens, slots] = rec.packed
        filled[(layer, role)][tokens, slots] = True
    for (layer, role), mask in filled.items():
        if not bool(mask.all()):
            raise RuntimeError(f"TRACE capture of layer {layer} {role}: {int((~mask).sum())} (token, slot) pairs "
                               "got no record")
    return out


def _put_dense(out: dict, rec, layer: int, role: str, num_tokens: int, fmt: str, keep_codes: bool) -> None:
    """A dense site's record already has one row per packed token ([T, 1, K/8] in Megatron's layout)."""
    if role in out.get(layer, {}):
        raise RuntimeError(f"site {rec.site} was captured twice in one forward")
    if rec.bits.numel() // rec.bits.shape[-1] != num_tokens:
        raise RuntimeError(f"site {rec.site}: {rec.bits.numel() // rec.bits.shape[-1]} captured rows for "
                           f"{num_tokens} tokens")

    def rows(t):
        return t.reshape(num_tokens, t.shape[-1])

    gs = None if rec.global_scale is None else rec.global_scale.float().reshape(()).expand(num_tokens).clone()
    out.setdefault(layer, {})[role] = ActivationCapture(fmt, rows(rec.bits), rows(rec.scales), gs,
                                                        rows(rec.packed) if keep_codes else None)


def _empty_capture(rec, rows: tuple[int, ...], fmt: str, keep_codes: bool) -> ActivationCapture:
    dev = rec.bits.device
    bits = torch.zeros(*rows, rec.bits.shape[-1], dtype=torch.uint8, device=dev)
    scales = torch.zeros(*rows, rec.scales.shape[-1], dtype=rec.scales.dtype, device=dev)
    gs = torch.zeros(*rows, dtype=torch.float32, device=dev) if fmt == "nvfp4" else None
    codes = torch.zeros(*rows, rec.packed.shape[-1], dtype=torch.uint8, device=dev) if keep_codes else None
    return ActivationCapture(fmt, bits, scales, gs, codes)


def slice_rows(cap: ActivationCapture, start: int, stop: int) -> ActivationCapture:
    return ActivationCapture(cap.format, cap.bits[start:stop], cap.scales[start:stop],
                             None if cap.global_scale is None else cap.global_scale[start:stop],
                             None if cap.codes is None else cap.codes[start:stop])


def concat_rows(chunks: list[ActivationCapture]) -> ActivationCapture:
    first = chunks[0]

    def cat(attr):
        parts = [getattr(c, attr) for c in chunks]
        return None if parts[0] is None else torch.cat(parts, dim=0)

    return ActivationCapture(first.format, cat("bits"), cat("scales"), cat("global_scale"), cat("codes"))


def guided_requantize(x: torch.Tensor, bits: torch.Tensor, scales: torch.Tensor,
                      global_scale: Optional[torch.Tensor], fmt: str, fallback_shift: float = 0.25,
                      stats: Optional[dict] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """TRACE replay of captured rows: x [N, K] -> (packed codes [N, K/2], dequantized x in x.dtype).

    Rows of one ActivationCapture come from different engine steps and so carry different NVFP4 global
    scales ([N]); the codec's guided mode takes one global scale per call, so rows are replayed in groups
    sharing a scale. Fallbacks are counted in `stats` like nvfp4_quantize does.
    """
    from megatron_qrl.quant import mxfp4_dequantize, mxfp4_quantize, nvfp4_dequantize, nvfp4_quantize

    if x.numel() == 0:  # an expert that got no tokens
        return torch.empty(*x.shape[:-1], x.shape[-1] // 2, dtype=torch.uint8, device=x.device), x.clone()
    if fmt == "mxfp4":
        packed, sc = mxfp4_quantize(x, "guided", scales=scales, trace_bits=bits, fallback_shift=fallback_shift,
                                    stats=stats)
        return packed, mxfp4_dequantize(packed, sc, dtype=x.dtype)
    if fmt != "nvfp4" or global_scale is None:
        raise ValueError(f"guided_requantize needs nvfp4 rows with global scales or mxfp4 rows, got {fmt}")
    packed = torch.empty(*x.shape[:-1], x.shape[-1] // 2, dtype=torch.uint8, device=x.device)
    deq = torch.empty_like(x)
    for g in torch.unique(global_scale):
        rows = (global_scale == g).nonzero(as_tuple=True)[0]
        p, s, gs = nvfp4_quantize(x[rows], g, "guided", scales=scales[rows], trace_bits=bits[rows],
                                  fallback_shift=fallback_shift, stats=stats)
        packed[rows] = p
        deq[rows] = nvfp4_dequantize(p, s, gs, dtype=x.dtype)
    return packed, deq
