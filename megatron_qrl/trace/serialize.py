"""Byte layout of a TRACE cache (one contiguous uint8 buffer; docs/trace.md has the table).

    offset  size  field
    0       8     magic b"QRLTRACE"
    8       4     format version, u32 little-endian
    12      4     CRC32 of bytes [16, end), u32 LE
    16      8     header length H, u64 LE
    24      H     header, UTF-8 JSON (sorted keys, no spaces)
    ...           zero padding to a multiple of 8, then the sections, each preceded by zero padding to a
                  multiple of its element size (4 for int32/fp32, none for bytes):
                  token_runs int32 [R, 3]; rowsets uint8 [S, ceil(n_tokens/8)];
                  per entry (header order): bits uint8 [rows, Kw/8], scales uint8 [rows, Kw/16],
                  gs_table fp32 [U], gs_index uint8 [ceil(rows * index_width(U) / 8)]

All multi-byte numbers are little-endian. Alignment lets a decoded cache be zero-copy dtype views into
the received buffer on any device.
"""
from __future__ import annotations

import json
import struct
import zlib
from typing import Iterator

import torch

from .cache import BLOCK, FORMAT, EntryKey, TraceCache, TraceEntry
from .errors import CorruptCacheError
from .packing import index_width, packed_index_bytes

MAGIC = b"QRLTRACE"
FORMAT_VERSION = 1
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


def compute_checksum(cache: TraceCache) -> int:
    """CRC32 of the serialized bytes [16, end) without building them (header + padding + sections)."""
    crc = 0
    for pad, piece in _pieces(cache):
        if pad:
            crc = zlib.crc32(bytes(pad), crc)
        crc = zlib.crc32(piece.cpu().numpy() if torch.is_tensor(piece) else piece, crc)
    return crc


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
        raise CorruptCacheError(f"TRACE cache format version {version}; this build reads {FORMAT_VERSION}")
    (header_len,) = struct.unpack("<Q", prefix[16:24])
    return checksum, header_len


def from_bytes(blob, verify: bool = True) -> TraceCache:
    """Decode a buffer from to_bytes (any device); the payload stays as views into it.

    verify=True checks the CRC32 over the buffer and raises CorruptCacheError on a mismatch.
    """
    blob = _blob_tensor(blob)
    checksum, header_len = read_prefix(blob)
    if PREFIX_BYTES + header_len > blob.numel():
        raise CorruptCacheError(f"TRACE cache truncated or corrupt: header of {header_len} bytes in a "
                                f"{blob.numel()}-byte buffer")
    if verify:
        actual = zlib.crc32(blob[16:].cpu().numpy())
        if actual != checksum:
            raise CorruptCacheError(f"TRACE cache checksum mismatch: stored {checksum:08x}, content {actual:08x} "
                                    "(corrupted in transit or on disk)")
    try:
        head = json.loads(bytes(blob[PREFIX_BYTES:PREFIX_BYTES + header_len].cpu().numpy()).decode())
        cache = _decode(blob, head, _align(PREFIX_BYTES + header_len))
    except CorruptCacheError:
        raise
    except (ValueError, KeyError, TypeError, IndexError, RuntimeError) as err:
        raise CorruptCacheError(f"TRACE cache header or layout is corrupt: {err}") from None
    cache.checksum = checksum
    cache.verified = verify
    return cache


def _decode(blob: torch.Tensor, head: dict, at: int) -> TraceCache:
    if head["format"] != FORMAT or head["block"] != BLOCK:
        raise CorruptCacheError(f"TRACE cache format {head['format']}/{head['block']}, expected {FORMAT}/{BLOCK}")

    def take(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        nonlocal at
        size = torch.empty(0, dtype=dtype).element_size()
        at = _align(at, size)
        n = torch.Size(shape).numel() * size
        if min(shape, default=0) < 0 or at + n > blob.numel():
            raise CorruptCacheError(f"TRACE cache truncated: a section of {n} bytes at offset {at} overruns the "
                                    f"{blob.numel()}-byte buffer")
        view = blob[at:at + n]
        at += n
        return view.view(dtype).reshape(shape) if n else torch.zeros(shape, dtype=dtype, device=blob.device)

    token_runs = take(torch.int32, (int(head["n_token_runs"]), 3))
    rowsets = take(torch.uint8, (int(head["n_rowsets"]), int(head["rowset_bytes"])))
    entries = {}
    for layer, site, expert, rowset, rows, k_start, k_width, k_full, n_gs in head["entries"]:
        bits = take(torch.uint8, (rows, k_width // 8))
        scales = take(torch.uint8, (rows, k_width // BLOCK))
        gs_table = take(torch.float32, (n_gs,))
        gs_index = take(torch.uint8, (packed_index_bytes(rows, index_width(n_gs)),))
        entries[EntryKey(int(layer), str(site), int(expert))] = TraceEntry(
            int(rowset), bits, scales, gs_table, gs_index, int(k_start), int(k_full))
    if at != blob.numel():
        raise CorruptCacheError(f"TRACE cache layout ends at byte {at} but the buffer holds {blob.numel()}")
    return TraceCache(weight_version=int(head["weight_version"]), step=int(head["step"]),
                      fingerprint=str(head["fingerprint"]), token_runs=token_runs.cpu(), rowsets=rowsets.cpu(),
                      entries=entries)
