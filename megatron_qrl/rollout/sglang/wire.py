"""Weight-sync payloads on the wire to SGLang: ModelOpt NVFP4 tensor names, buckets, flattened buckets.

SGLang loads a weight update through the model's own `load_weights(name, tensor)` with checkpoint
(Hugging Face) names, so an FP4 weight travels as the tensors of a ModelOpt NVFP4 checkpoint:
  <base>.weight          uint8 [N, K/2]           packed E2M1 codes (our codec's bytes, bit-exact with ModelOpt)
  <base>.weight_scale    float8_e4m3fn [N, K/16]  block scales
  <base>.weight_scale_2  float32 []               per-tensor (global) scale
  <base>.input_scale     float32 []               static activation scale -- only if the caller supplies one
Plain tensors (norms, embeddings, router, attention under quant.targets=routed_experts) travel as they are.

Buckets bound the memory of one transfer. With load_format="flattened_bucket" the pinned release
receives one uint8 tensor per bucket: every tensor flattened, viewed as bytes and concatenated in order,
then rebuilt from the (names, dtypes, shapes) metadata -- `flatten_bucket` produces exactly that.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

import torch

from megatron_qrl.quant.wire import FP4Tensor, Payload

MODELOPT_SUFFIXES = ("weight", "weight_scale", "weight_scale_2", "input_scale")


class WireFormatError(ValueError):
    """A payload that cannot be expressed in the names/dtypes SGLang's loader reads."""


@dataclass(frozen=True)
class WireTensor:
    name: str
    tensor: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    @property
    def dtype_name(self) -> str:
        """torch dtype as SGLang's receiver resolves it: getattr(torch, name)."""
        return str(self.tensor.dtype).removeprefix("torch.")


def weight_base(name: str) -> str:
    if not name.endswith(".weight"):
        raise WireFormatError(f"an FP4 payload must belong to a '.weight' parameter, got '{name}'")
    return name[: -len(".weight")]


def modelopt_tensors(name: str, payload: Payload, input_scale: Optional[torch.Tensor] = None) -> list[WireTensor]:
    """The wire tensors of one parameter (checkpoint name): ModelOpt NVFP4 parts or the plain tensor."""
    if isinstance(payload, torch.Tensor):
        return [WireTensor(name, payload.detach().contiguous())]
    if not isinstance(payload, FP4Tensor):
        raise WireFormatError(f"'{name}': payload must be a tensor or FP4Tensor, "
                              f"got {type(payload).__name__}")
    if payload.format != "nvfp4":
        raise WireFormatError(f"'{name}': {payload.format} payloads cannot be synced to SGLang (its MXFP4 loader reads "
                              "model-specific checkpoint layouts, e.g. GPT-OSS blocks/scales); "
                              "use rollout.weights=nvfp4")
    base = weight_base(name)
    parts = [WireTensor(f"{base}.weight", payload.packed.contiguous()),
             WireTensor(f"{base}.weight_scale", payload.scales.contiguous()),
             WireTensor(f"{base}.weight_scale_2", payload.global_scale.to(torch.float32).reshape(()).contiguous())]
    if input_scale is not None:
        parts.append(WireTensor(f"{base}.input_scale", input_scale.to(torch.float32).reshape(()).contiguous()))
    return parts


def wire_tensors(weights: Mapping[str, Payload],
                 input_scales: Optional[Mapping[str, torch.Tensor]] = None) -> list[WireTensor]:
    """All wire tensors of an update, in the order of `weights`."""
    scales = input_scales or {}
    out: list[WireTensor] = []
    for name, payload in weights.items():
        out.extend(modelopt_tensors(name, payload, scales.get(name)))
    return out


def aligned_order(bucket: list[WireTensor]) -> list[WireTensor]:
    """Widest elements first (stable): the release's receiver views each slice of the flat uint8 buffer as its
    dtype in place, which torch allows only at offsets divisible by the element size (4-byte tensors first,
    then 2-, then 1-byte keeps every offset aligned without padding)."""
    return sorted(bucket, key=lambda t: -t.tensor.element_size())


def split_buckets(tensors: Iterable[WireTensor], bucket_bytes: int) -> list[list[WireTensor]]:
    """Groups of at most `bucket_bytes` in input order (a tensor larger than that gets a bucket of its own),
    each bucket in `aligned_order`."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket size must be >= 1 byte, got {bucket_bytes}")
    buckets: list[list[WireTensor]] = []
    current: list[WireTensor] = []
    size = 0
    for t in tensors:
        if current and size + t.nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(t)
        size += t.nbytes
    if current:
        buckets.append(current)
    return [aligned_order(b) for b in buckets]


@dataclass(frozen=True)
class BucketMeta:
    """The (names, dtypes, shapes) lists of one update_weights_from_distributed call."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]

    @classmethod
    def of(cls, bucket: list[WireTensor]) -> "BucketMeta":
        return cls([t.name for t in bucket], [t.dtype_name for t in bucket], [list(t.tensor.shape) for t in bucket])


def flatten_bucket(bucket: list[WireTensor], device=None) -> torch.Tensor:
    """One uint8 tensor: each tensor flattened, viewed as bytes, concatenated in bucket order."""
    if not bucket:
        raise ValueError("cannot flatten an empty bucket")
    parts = [t.tensor.reshape(-1).contiguous().view(torch.uint8) for t in bucket]
    flat = torch.cat([p.to(device) if device is not None else p for p in parts])
    return flat


def unflatten_bucket(flat: torch.Tensor, meta: BucketMeta) -> list[WireTensor]:
    """Inverse of flatten_bucket from the metadata alone (what the receiving side reconstructs)."""
    out, offset = [], 0
    for name, dtype_name, shape in zip(meta.names, meta.dtypes, meta.shapes):
        dtype = getattr(torch, dtype_name)
        size = torch.empty((), dtype=dtype).element_size()
        nbytes = int(torch.Size(shape).numel()) * size
        if offset + nbytes > flat.numel():
            raise WireFormatError(f"bucket of {flat.numel()} bytes ends inside '{name}' (needs {offset + nbytes})")
        if offset % size:
            raise WireFormatError(f"'{name}' ({dtype_name}) starts at byte {offset}, not a multiple of {size}: "
                                  "order the bucket with aligned_order")
        out.append(WireTensor(name, flat[offset: offset + nbytes].view(dtype).reshape(shape)))
        offset += nbytes
    if offset != flat.numel():
        raise WireFormatError(f"bucket holds {flat.numel()} bytes but its metadata describes {offset}")
    return out
