"""The FP4 wire format of weight syncs and exports: FP4Tensor, packing with the codec, payload digests.

One definition for the trainer's sync, the engines and the NVFP4 export (DESIGN.md: "the engine runs
exactly the weights the trainer quantized" is checked by a digest per tensor at every sync):
- `pack_weight(w, fmt)` quantizes one full (unsharded) weight, nearest rounding;
- `pack_weights(ws, fmt)` does the same for many weights with one codec launch per group of equal shapes
  (each tensor keeps its own NVFP4 global scale, amax(|w|) / (6*448), so the bytes equal pack_weight's);
- `pack_state` builds a sync payload and its digests; `payload_digests` hashes many payloads at once
  (quant/digest.py: qh128 on the payload's device by default).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional, Sequence, Union

import torch

from .digest import DEFAULT_DIGEST, combine, tensor_digests
from .formats import FP4_FORMATS, fp4_format
from .nvfp4 import nvfp4_global_scale

PACK_CHUNK_ELEMENTS = 1 << 28      # elements stacked per launch in pack_weights (bounds the extra memory)


@dataclass
class FP4Tensor:
    """A weight in the project's FP4 format: what SGLang/vLLM/ModelOpt read (METHODS.md section 1).

    packed: uint8 [N, K/2]; scales: float8_e4m3fn [N, K/16] (nvfp4) or uint8 E8M0 [N, K/32] (mxfp4);
    global_scale: fp32 0-dim (nvfp4) or None (mxfp4).
    """

    format: str
    packed: torch.Tensor
    scales: torch.Tensor
    global_scale: Optional[torch.Tensor] = None

    def __post_init__(self):
        if self.format not in FP4_FORMATS:
            raise ValueError(f"FP4Tensor.format must be one of {FP4_FORMATS}, got '{self.format}'")
        if self.format == "nvfp4" and self.global_scale is None:
            raise ValueError("an nvfp4 FP4Tensor needs its global_scale (weight_scale_2)")

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.packed.shape[:-1], self.packed.shape[-1] * 2))

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return fp4_format(self.format).dequantize(self.packed, self.scales, self.global_scale, dtype)

    def parts(self) -> list[torch.Tensor]:
        return [self.packed, self.scales] + ([self.global_scale] if self.global_scale is not None else [])

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parts())

    def to(self, device) -> "FP4Tensor":
        return FP4Tensor(self.format, *(p.to(device) if p is not None else None
                                        for p in (self.packed, self.scales, self.global_scale)))


Payload = Union[torch.Tensor, FP4Tensor]


def payload_nbytes(x: Payload) -> int:
    """Bytes a payload occupies (packed FP4 parts, or the plain tensor)."""
    return x.nbytes() if isinstance(x, FP4Tensor) else x.numel() * x.element_size()


def _parts(x: Payload) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, FP4Tensor):
        return x.parts()
    raise TypeError(f"weight payload must be a torch.Tensor or FP4Tensor, got {type(x).__name__}")


def payload_digests(payloads: Sequence[Payload], algorithm: str = DEFAULT_DIGEST) -> list[str]:
    """Digests of many payloads (all parts hashed together per device): a plain tensor's tensor_digest,
    or one digest over an FP4Tensor's format and parts."""
    parts = [_parts(x) for x in payloads]
    flat = tensor_digests([p for ps in parts for p in ps], algorithm)
    out, i = [], 0
    for x, ps in zip(payloads, parts):
        ds = flat[i:i + len(ps)]
        i += len(ps)
        out.append(ds[0] if isinstance(x, torch.Tensor) else combine(x.format, ds, algorithm))
    return out


def payload_digest(x: Payload, algorithm: str = DEFAULT_DIGEST) -> str:
    """Digest of one sync payload (see payload_digests)."""
    return payload_digests([x], algorithm)[0]


def _quantize_rows(x2: torch.Tensor, fmt: str, row_gs: Optional[torch.Tensor], check_finite: bool):
    """(packed, scales, global scale as given) of a 2-D tensor, nearest rounding (the format object picks the
    Triton codec or the torch reference); NVFP4 with one global scale per row ([rows, 1]) or a scalar."""
    enc = fp4_format(fmt).quantize(x2, global_scale=row_gs, check_finite=check_finite)
    return enc.packed, enc.scales, enc.global_scale


def pack_weight(w: torch.Tensor, fmt: str) -> FP4Tensor:
    """Quantize a full (unsharded) weight with the project codec, nearest rounding -- the trainer side.

    The NVFP4 global scale is amax(|w|) / (6*448) over the whole tensor, which is what the QAT linears use
    (their amax is all-reduced over tensor-parallel shards), so the engine runs the trainer's FP4 weights.
    """
    if fmt not in FP4_FORMATS:
        raise ValueError(f"cannot pack a weight as '{fmt}'; use one of {FP4_FORMATS}")
    w = w.detach()
    gs = nvfp4_global_scale(w) if fmt == "nvfp4" else None
    packed, scales, gs = _quantize_rows(w, fmt, gs, check_finite=True)
    return FP4Tensor(fmt, packed, scales, gs)


def pack_weights(ws: Sequence[torch.Tensor], fmt: str) -> list[FP4Tensor]:
    """pack_weight of every tensor in `ws`, the same bytes, with one codec launch per group of tensors of
    equal shape, dtype and device (stacked in chunks of at most PACK_CHUNK_ELEMENTS). The results are views
    into the group's outputs. Non-finite weights are rejected (one host check per call)."""
    if fmt not in FP4_FORMATS:
        raise ValueError(f"cannot pack a weight as '{fmt}'; use one of {FP4_FORMATS}")
    out: list[Optional[FP4Tensor]] = [None] * len(ws)
    groups: dict = {}
    for i, w in enumerate(ws):
        groups.setdefault((tuple(w.shape), w.dtype, w.device), []).append(i)
    finite = []
    for (shape, _, _), idx in groups.items():
        if len(shape) == 0:
            raise ValueError("pack_weights: a 0-dim tensor cannot be packed as FP4")
        per = max(1, PACK_CHUNK_ELEMENTS // max(1, ws[idx[0]].numel()))
        for c0 in range(0, len(idx), per):
            chunk = idx[c0:c0 + per]
            w = torch.stack([ws[i].detach() for i in chunk])                 # [G, *shape]
            finite.append(torch.isfinite(w).all())
            rows = w.reshape(-1, shape[-1])
            if fmt == "nvfp4":
                gs = fp4_format(fmt).global_scales(w.reshape(len(chunk), -1).abs().amax(dim=1))   # [G]
                row_gs = gs.repeat_interleave(rows.shape[0] // len(chunk)).unsqueeze(1)
                packed, scales, _ = _quantize_rows(rows, fmt, row_gs, check_finite=False)
            else:
                gs = None
                packed, scales, _ = _quantize_rows(rows, fmt, None, check_finite=False)
            packed = packed.reshape(len(chunk), *shape[:-1], -1)
            scales = scales.reshape(len(chunk), *shape[:-1], -1)
            for j, i in enumerate(chunk):
                out[i] = FP4Tensor(fmt, packed[j], scales[j], gs[j] if gs is not None else None)
    if finite and not bool(torch.stack([f.to(finite[0].device) for f in finite]).all()):
        raise ValueError("pack_weights: a weight holds NaN or Inf values; FP4 cannot encode them "
                         "(find where they come from: overflow, a diverged step)")
    return out  # type: ignore[return-value]


def pack_state(named_params: Iterable[tuple[str, torch.Tensor]], fmt: str, is_quantized: Callable[[str], bool],
               prepacked: Optional[Mapping[str, FP4Tensor]] = None, algorithm: str = DEFAULT_DIGEST,
               ) -> tuple[dict[str, Payload], dict[str, str]]:
    """(payloads, digests) for a weight sync: FP4 for quantized linears' weights, plain tensors elsewhere.

    `prepacked` supplies FP4 payloads that were already quantized from the current weights (the QAT
    quantizer's bytes, models/grouped_experts.py); the rest is packed with `pack_weights`.
    """
    prepacked = prepacked or {}
    weights: dict[str, Payload] = {}
    to_pack: list[tuple[str, torch.Tensor]] = []
    for name, p in named_params:
        if fmt in FP4_FORMATS and is_quantized(name):
            if name in prepacked:
                weights[name] = prepacked[name]
            else:
                weights[name] = None  # placeholder keeps the parameter order
                to_pack.append((name, p))
        else:
            weights[name] = p.detach()
    for (name, _), q in zip(to_pack, pack_weights([p for _, p in to_pack], fmt) if to_pack else []):
        weights[name] = q
    names = list(weights)
    return weights, dict(zip(names, payload_digests([weights[n] for n in names], algorithm)))


__all__ = ["FP4_FORMATS", "FP4Tensor", "Payload", "pack_state", "pack_weight", "pack_weights", "payload_digest",
           "payload_digests", "payload_nbytes"]
