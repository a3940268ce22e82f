"""Weight payloads from trainer rank 0 to the engine ranks as flat byte buckets, not pickled objects.

A disaggregated sync used to torch.save the whole payload dict, copy it through host memory and broadcast
it as one byte tensor (~0.12 GB/s on two H200s). Here only a small manifest (names, formats, shapes,
dtypes, byte offsets) travels as an object; the tensors are concatenated as raw bytes into buckets on the
collective's device (the GPU under NCCL) and broadcast as they are, and the receiver rebuilds every
payload as a view into its bucket: no serialization, no host round trip under NCCL. The digests still
travel with the message and the engine still checks them before installing (rollout/weights.py).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_qrl.quant.wire import FP4Tensor, Payload

ALIGN = 16                 # every part starts 16-byte aligned, so any dtype view of its slice is legal
BUCKET_BYTES = 1 << 28     # 256 MiB per broadcast bounds the sender's and receivers' extra memory


def _parts(payload: Payload) -> tuple[Optional[str], list[torch.Tensor]]:
    if isinstance(payload, FP4Tensor):
        return payload.format, payload.parts()
    if isinstance(payload, torch.Tensor):
        return None, [payload]
    raise TypeError(f"weight payload must be a torch.Tensor or FP4Tensor, got {type(payload).__name__}")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _part_nbytes(dtype: str, shape: tuple) -> int:
    """Bytes of a manifest part (dtype name without "torch.", shape)."""
    return int(torch.Size(shape).numel()) * getattr(torch, dtype).itemsize


def manifest(weights: dict[str, Payload], bucket_bytes: int = BUCKET_BYTES) -> list[dict]:
    """Per payload: name, FP4 format (None for a plain tensor) and its parts' (dtype, shape, bucket, offset).
    Parts fill buckets in order; a part larger than bucket_bytes gets a bucket of its own."""
    out, bucket, offset = [], 0, 0
    for name, payload in weights.items():
        fmt, parts = _parts(payload)
        entry = {"name": name, "format": fmt, "parts": []}
        for t in parts:
            size = _nbytes(t)
            if offset and offset + size > bucket_bytes:
                bucket, offset = bucket + 1, 0
            entry["parts"].append((str(t.dtype).removeprefix("torch."), tuple(t.shape), bucket, offset))
            offset += -(-size // ALIGN) * ALIGN
        out.append(entry)
    return out


def bucket_sizes(spec: list[dict]) -> list[int]:
    sizes: dict[int, int] = {}
    for entry in spec:
        for dtype, shape, bucket, offset in entry["parts"]:
            sizes[bucket] = max(sizes.get(bucket, 0), offset + _part_nbytes(dtype, shape))
    return [sizes[b] for b in range(len(sizes))]


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _filled_buckets(weights: dict[str, Payload], spec: list[dict], device, sizes: Optional[list[int]] = None):
    """The buckets of `spec`, filled from `weights`, one at a time (so one bucket of extra memory); `sizes`
    may pad them (bytes past the parts are left unset)."""
    sizes = sizes or bucket_sizes(spec)
    fills: list[list[tuple[int, torch.Tensor]]] = [[] for _ in sizes]
    for entry in spec:
        _, parts = _parts(weights[entry["name"]])
        for t, (_, _, bucket, offset) in zip(parts, entry["parts"]):
            fills[bucket].append((offset, t))
    for size, fill in zip(sizes, fills):
        buf = torch.empty(size, dtype=torch.uint8, device=device)
        for offset, t in fill:
            raw = _byte_view(t)
            buf[offset:offset + raw.numel()].copy_(raw, non_blocking=True)
        yield buf


def _unpack(spec: list[dict], buckets: list[torch.Tensor]) -> dict[str, Payload]:
    """The payloads of `spec` as views into `buckets`."""
    out: dict[str, Payload] = {}
    for entry in spec:
        parts = []
        for dtype, shape, bucket, offset in entry["parts"]:
            n = _part_nbytes(dtype, shape)
            parts.append(buckets[bucket][offset:offset + n].view(getattr(torch, dtype)).reshape(shape))
        out[entry["name"]] = FP4Tensor(entry["format"], *parts) if entry["format"] is not None else parts[0]
    return out


def send_weights(weights: dict[str, Payload], spec: list[dict], src: int, group, device) -> int:
    """Sender side (rank `src`): every bucket of `spec` filled from `weights` and broadcast. Returns bytes sent."""
    sent = 0
    for buf in _filled_buckets(weights, spec, device):
        dist.broadcast(buf, src, group=group)
        sent += buf.numel()
    return sent


def receive_weights(spec: list[dict], src: int, group, device) -> dict[str, Payload]:
    """Receiver side: the payloads of `spec`, as views into the received buckets (on `device`)."""
    buckets = []
    for size in bucket_sizes(spec):
        buf = torch.empty(size, dtype=torch.uint8, device=device)
        dist.broadcast(buf, src, group=group)
        buckets.append(buf)
    return _unpack(spec, buckets)


def all_gather_tensors(local: dict[str, torch.Tensor], group, device) -> dict[str, torch.Tensor]:
    """Every rank's tensors (distinct names, any shapes and dtypes) on every rank of `group`: one manifest
    exchange as objects, then one all_gather of flat byte buffers on `device` (the GPU under NCCL)."""
    spec = manifest(local, bucket_bytes=1 << 62)
    specs: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(specs, spec, group=group)
    size = max([sum(bucket_sizes(s)) for s in specs] + [1])
    buf = next(_filled_buckets(local, spec, device, sizes=[size]))   # one bucket, padded to the largest
    parts = [torch.empty(size, dtype=torch.uint8, device=device) for _ in specs]
    dist.all_gather(parts, buf, group=group)
    out: dict[str, torch.Tensor] = {}
    for s, part in zip(specs, parts):
        out.update(_unpack(s, [part]))
    return out
