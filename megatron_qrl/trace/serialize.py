"""Byte layout of a TRACE cache (one contiguous uint8 buffer; docs/trace.md has the table).

    offset  size  field
    0       8     magic b"QRLTRACE"
    8       4     format version, u32 little-endian (2)
    12      4     checksum, u32 LE (below)
    16      8     header length H, u64 LE
    24      H     header, UTF-8 JSON (sorted keys, no spaces)
    ...           zero padding to a multiple of 8, then the sections, each preceded by zero padding to a
                  multiple of its element size (4 for int32/fp32, none for bytes):
                  token_runs int32 [R, 3]; rowsets uint8 [S, ceil(n_tokens/8)];
                  per entry (header order): bits uint8 [rows, Kw/8], scales uint8 [rows, Kw/16],
                  gs_table fp32 [U], gs_index uint8 [ceil(rows * index_width(U) / 8)]

All multi-byte numbers are little-endian. Alignment lets a decoded cache be zero-copy dtype views into
the received buffer on any device.

Checksum (format 2): the little-endian u32 of blake2b (digest_size=4) over bytes [16, 24 + H) (header
length and header) followed by the ASCII qh128 digest ('qh128:<32 hex>', quant/digest.py) of every
section's bytes as a 1-D uint8 tensor, in layout order. The digests are computed where the sections live
(one batched `tensor_digests` call: a Triton launch on CUDA), so sealing, slicing and verifying a GPU
cache never copies it to the host. The padding is not hashed (the header fixes it); a verifying decoder
requires it to be zero. Format 1 (CRC32 of bytes [16, end) on the host) is refused.
"""
from __future__ import annotations

import hashlib
import json
import struct
from typing import Iterator

import torch

from megatron_qrl.quant.digest import DEVICE_DIGEST, tensor_digests

from .cache import BLOCK, FORMAT, EntryKey, TraceCache, TraceEntry
from .errors import CorruptCacheError
from .packing import index_width, packed_index_bytes

MAGIC = b"QRLTRACE"
FORMAT_VERSION = 2
PREFIX_BYTES = 24
ALIGN = 8


def _align(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def _header(cache: TraceCache) -> bytes:
    entries = [[k.layer, k.site, k.expert, e.rowset, e.rows, e.k_start, e.k_width, e.k_full,
                int(e.gs_table.numel())] for k, e in cache.entries.items()]
    head = {"weight_version": cache.weight_version, "step": cache.step, "fingerprint": cache.fingerprint,
            "format": FORMAT, "block": BLOCK, "n_token_runs": int(cache.token_runs.shape[0]),
            "n_rowsets": int(cache.rowsets.shape[0]), "rowset_bytes": int(cache.rowsets.shape[1]),
            "entry_fields": ["layer", "site", "expert", "rowset", "rows", "k_start", "k_width", "k_full",
                             "n_global_scales"],
            "entries": entries}
    return json.dumps(head, sort_keys=True, separators=(",", ":")).encode()


def _sections(cache: TraceCache) -> list[torch.Tensor]:
    out = [cache.token_runs.to(torch.int32), cache.rowsets]
    for e in cache.entries.values():
        out.extend(e.tensors())
    return out


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return (t.reshape(-1).view(torch.uint8) if t.numel() else torch.zeros(0, dtype=torch.uint8, device=t.device))


def _pieces(cache: TraceCache) -> Iterator[tuple[int, object]]:
    """(zero padding before it, bytes-like or uint8 tensor) in layout order from offset 16.

    The header starts the payload at a multiple of 8; each section starts at a multiple of its element
    size (4 for int32/fp32, 1 for bytes), which is what zero-copy dtype views need.
    """
    header = _header(cache)
    yield 0, struct.pack("<Q", len(header))
    yield 0, header
    at = PREFIX_BYTES + len(header)
    first = True
    for t in _sections(cache):
        b = _as_bytes(t)
        align = ALIGN if first else t.element_size()
        first = False
        pad = -at % align
        yield pad, b
        at += pad + b.numel()


def serialized_size(cache: TraceCache) -> int:
    return 16 + sum(pad + (p.numel() if torch.is_tensor(p) else len(p)) for pad, p in _pieces(cache))


def _checksum(head: bytes, sections: list[torch.Tensor]) -> int:
    """The format-2 checksum (module docstring) of the bytes [16, 24 + H) and the sections' uint8 bytes.

    One tensor_digests call: a launch per device and one small host read, never a host copy of the sections.
    """
    h = hashlib.blake2b(head, digest_size=4)
    for digest in tensor_digests(sections, DEVICE_DIGEST):
        h.update(digest.encode())
    return int.from_bytes(h.digest(), "little")


def compute_checksum(cache: TraceCache) -> int:
    """The checksum of the serialized form without building it (hashed where the sections live)."""
    header = _header(cache)
    return _checksum(struct.pack("<Q", len(header)) + header, [_as_bytes(t) for t in _sections(cache)])


def to_bytes(cache: TraceCache, device=None, pin_memory: bool = False) -> torch.Tensor:
    """The cache as one uint8 buffer on `device` (default CPU; pinned when asked and CUDA exists)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    total = serialized_size(cache)
    pin = pin_memory and device.type == "cpu" and torch.cuda.is_available()
    out = torch.zeros(total, dtype=torch.uint8, device=device, pin_memory=pin)
    checksum = cache.checksum if cache.checksum is not None else cache.compute_checksum()
    prefix = MAGIC + struct.pack("<II", FORMAT_VERSION, checksum)
    out[:16].copy_(torch.frombuffer(bytearray(prefix), dtype=torch.uint8))
    at = 16
    for pad, piece in _pieces(cache):
        at += pad
        t = piece if torch.is_tensor(piece) else torch.frombuffer(bytearray(piece), dtype=torch.uint8)
        if t.numel():
            out[at:at + t.numel()].copy_(t, non_blocking=pin)
        at += t.numel()
    if pin:
        torch.cuda.synchronize()
    return out


def _blob_tensor(blob) -> torch.Tensor:
    if torch.is_tensor(blob):
        if blob.dtype != torch.uint8 or blob.dim() != 1:
            raise CorruptCacheError(f"a serialized TRACE cache is a 1-D uint8 tensor, got {blob.dtype} "
                                    f"{tuple(blob.shape)}")
        # a piece of a larger receive buffer may start unaligned; dtype views need aligned offsets
        return blob if blob.storage_offset() % ALIGN == 0 and blob.is_contiguous() else blob.clone()
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def _version_problem(version: int) -> str:
    if version == 1:
        return ("TRACE cache format version 1 was written by an older build (a CRC32 checksum); this build "
                f"reads version {FORMAT_VERSION} only: re-record the cache (an older run's caches, e.g. spilled "
                "*.qrltrace files, cannot be read)")
    return (f"TRACE cache format version {version}; this build reads version {FORMAT_VERSION} only (written by "
            "another build, or corrupt)")


def read_prefix(blob: torch.Tensor) -> tuple[int, int]:
    """(stored checksum, header length) after checking magic and format version."""
    if blob.numel() < PREFIX_BYTES:
        raise CorruptCacheError(f"TRACE cache truncated: {blob.numel()} bytes, the fixed prefix alone is "
                                f"{PREFIX_BYTES}")
    prefix = bytes(blob[:PREFIX_BYTES].cpu().numpy())
    if prefix[:8] != MAGIC:
        raise CorruptCacheError(f"not a TRACE cache: magic {prefix[:8]!r}, expected {MAGIC!r}")
    version, checksum = struct.unpack("<II", prefix[8:16])
    if version != FORMAT_VERSION:
        raise CorruptCacheError(_version_problem(version))
    (header_len,) = struct.unpack("<Q", prefix[16:24])
    return checksum, header_len


def from_bytes(blob, verify: bool = True) -> TraceCache:
    """Decode a buffer from to_bytes (any device); the payload stays as views into it.

    verify=True checks the checksum where the buffer lives (only the prefix and header are read to the host)
    and that the padding is zero; CorruptCacheError on a mismatch.
    """
    blob = _blob_tensor(blob)
    checksum, header_len = read_prefix(blob)
    if PREFIX_BYTES + header_len > blob.numel():
        raise CorruptCacheError(f"TRACE cache truncated or corrupt: header of {header_len} bytes in a "
                                f"{blob.numel()}-byte buffer")
    head = bytes(blob[16:PREFIX_BYTES + header_len].cpu().numpy())   # the header length and the header
    reader = _Reader(blob, PREFIX_BYTES + header_len)
    try:
        cache = _decode(reader, json.loads(head[8:].decode()))
    except CorruptCacheError:
        raise
    except (ValueError, KeyError, TypeError, IndexError, RuntimeError) as err:
        raise CorruptCacheError(f"TRACE cache header or layout is corrupt: {err}") from None
    if verify:
        actual = _checksum(head, reader.sections)
        if actual != checksum:
            raise CorruptCacheError(f"TRACE cache checksum mismatch: stored {checksum:08x}, content {actual:08x} "
                                    "(corrupted in transit or on disk)")
        reader.check_padding()
    cache.checksum = checksum
    cache.verified = verify
    return cache


class _Reader:
    """Walks a buffer's sections in layout order, keeping each section's bytes (for the checksum) and where
    the padding lies (a verifying decoder requires it zero: a to_bytes buffer is byte for byte reproducible)."""

    def __init__(self, blob: torch.Tensor, at: int):
        self.blob, self.at = blob, at
        self.sections: list[torch.Tensor] = []
        self.gaps: list[tuple[int, int]] = []

    def take(self, dtype: torch.dtype, shape: tuple[int, ...], align: int = 0) -> torch.Tensor:
        """The next section as a zero-copy view; `align` overrides its element size as the alignment."""
        size = torch.empty(0, dtype=dtype).element_size()
        start = _align(self.at, align or size)
        if start > self.at:
            self.gaps.append((self.at, start))
        n = torch.Size(shape).numel() * size
        if min(shape, default=0) < 0 or start + n > self.blob.numel():
            raise CorruptCacheError(f"TRACE cache truncated: a section of {n} bytes at offset {start} overruns the "
                                    f"{self.blob.numel()}-byte buffer")
        raw = self.blob[start:start + n]
        self.sections.append(raw)
        self.at = start + n
        return raw.view(dtype).reshape(shape) if n else torch.zeros(shape, dtype=dtype, device=self.blob.device)

    def check_padding(self) -> None:
        """CorruptCacheError unless every padding byte is zero (one gather and one host read)."""
        if not self.gaps:
            return
        starts = torch.tensor([a for a, _ in self.gaps], dtype=torch.int64)
        lengths = torch.tensor([b - a for a, b in self.gaps], dtype=torch.int64)
        first = torch.repeat_interleave(starts - torch.cumsum(lengths, 0) + lengths, lengths)
        where = first + torch.arange(first.numel(), dtype=torch.int64)
        if bool(self.blob[where.to(self.blob.device)].any()):
            raise CorruptCacheError("TRACE cache padding bytes are not zero (corrupted in transit or on disk)")


def _decode(reader: _Reader, head: dict) -> TraceCache:
    if head["format"] != FORMAT or head["block"] != BLOCK:
        raise CorruptCacheError(f"TRACE cache format {head['format']}/{head['block']}, expected {FORMAT}/{BLOCK}")
    take = reader.take
    token_runs = take(torch.int32, (int(head["n_token_runs"]), 3), align=ALIGN)
    rowsets = take(torch.uint8, (int(head["n_rowsets"]), int(head["rowset_bytes"])))
    entries = {}
    for layer, site, expert, rowset, rows, k_start, k_width, k_full, n_gs in head["entries"]:
        bits = take(torch.uint8, (rows, k_width // 8))
        scales = take(torch.uint8, (rows, k_width // BLOCK))
        gs_table = take(torch.float32, (n_gs,))
        gs_index = take(torch.uint8, (packed_index_bytes(rows, index_width(n_gs)),))
        entries[EntryKey(int(layer), str(site), int(expert))] = TraceEntry(
            int(rowset), bits, scales, gs_table, gs_index, int(k_start), int(k_full))
    if reader.at != reader.blob.numel():
        raise CorruptCacheError(f"TRACE cache layout ends at byte {reader.at} but the buffer holds "
                                f"{reader.blob.numel()}")
    return TraceCache(weight_version=int(head["weight_version"]), step=int(head["step"]),
                      fingerprint=str(head["fingerprint"]), token_runs=token_runs.cpu(), rowsets=rowsets.cpu(),
                      entries=entries)
