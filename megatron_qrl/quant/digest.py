"""Digests of weight payloads: what the trainer sends and the engine re-checks at every sync (DESIGN.md).

Algorithms (the name travels in the digest, '<algorithm>:<hex>', so the verifier recomputes with the
sender's choice):
- qh128 (the sync default): a 128-bit non-cryptographic hash computed where the bytes live, so a GPU
  payload is hashed on the GPU without a host copy, many tensors at once (`tensor_digests`): one Triton
  launch per batch on CUDA (kernels/qh128.py), torch integer ops elsewhere; both give the same sums. Against accidental corruption, not against an adversary.
- sha256 (export files, and available for syncs), xxh3_128 (needs the xxhash package): over host bytes.

qh128, exactly (`reference_qh128` is a pure-Python transcription that the tests compare with):
the tensor's raw bytes (native layout, contiguous, zero-padded to a multiple of 4) are read as little-
endian uint32 words w_i, i = 0..m-1. For each of two lanes L with constants (C_L, S_L):
    H_L = sum_i fmix64(((i * C_L) mod 2^64) xor w_i xor S_L)   mod 2^64
(fmix64 is MurmurHash3's 64-bit finaliser, a bijection). A changed word at position i changes exactly one
term to a different value, so any single-word corruption changes H_L; other changes are missed with
probability ~2^-64 per lane. The digest is blake2b-128 over "dtype|shape|nbytes|" and the two lanes
(16 bytes, on the host): dtype and shape are part of it, device and strides are not.
The wrapping int64 multiply and sum are the same on CPU and CUDA, and the sum is order-free, so the digest
does not depend on the device or on the reduction order.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Iterable, Optional, Sequence

import torch

DEVICE_DIGEST = "qh128"
DIGEST_ALGORITHMS = ("qh128", "sha256", "xxh3_128")
DEFAULT_DIGEST = DEVICE_DIGEST

_MASK64 = (1 << 64) - 1
_FMIX = (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53)
_LANES = ((0x9E3779B97F4A7C15, 0x243F6A8885A308D3), (0xC2B2AE3D27D4EB4F, 0x13198A2E03707344))
CHUNK_WORDS = 1 << 24          # words hashed per pass: bounds the int64 temporaries (~128 MiB each)


class UnknownDigestError(ValueError):
    """A digest string or algorithm this side cannot compute."""


def _signed(c: int) -> int:
    """A 64-bit constant as the int64 torch multiplies with (same bits, two's complement)."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _lsr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _fmix64(k: torch.Tensor) -> torch.Tensor:
    k = k ^ _lsr(k, 33)
    k = k * _signed(_FMIX[0])
    k = k ^ _lsr(k, 33)
    k = k * _signed(_FMIX[1])
    return k ^ _lsr(k, 33)


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _header(t: torch.Tensor) -> bytes:
    return f"{t.dtype}|{tuple(t.shape)}|{t.numel() * t.element_size()}|".encode()


def _finish(header: bytes, lanes: Sequence[int]) -> str:
    h = hashlib.blake2b(header, digest_size=16)
    h.update(struct.pack("<QQ", *(v & _MASK64 for v in lanes)))
    return f"{DEVICE_DIGEST}:{h.hexdigest()}"


BATCH_BYTES = 1 << 28   # bytes hashed per batch of tensors (the flat copy + int64 segment ids: ~3x this)


def _lane_sums(words: torch.Tensor, segment: torch.Tensor, local: torch.Tensor, n_segments: int) -> torch.Tensor:
    """int64 [n_segments, 2]: per segment and lane, the wrapped sum of fmix64 terms of these words."""
    out = torch.zeros(n_segments, 2, dtype=torch.int64, device=words.device)
    for lane, (c, s) in enumerate(_LANES):
        terms = _fmix64((local * _signed(c)) ^ words ^ _signed(s))
        out[:, lane].index_add_(0, segment, terms)
    return out


def _qh128_many(tensors: Sequence[torch.Tensor]) -> list[str]:
    """qh128 of tensors that share a device, in batches of about BATCH_BYTES (so the flat buffer and its
    per-word segment ids stay small next to a model: a 48-layer payload is tens of GB)."""
    out: list[str] = []
    batch: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        batch.append(t)
        size += t.numel() * t.element_size()
        if size >= BATCH_BYTES:
            out += _qh128_batch(batch)
            batch, size = [], 0
    return out + (_qh128_batch(batch) if batch else [])


def _qh128_batch(tensors: Sequence[torch.Tensor]) -> list[str]:
    """qh128 of one batch: one flat word buffer, per-segment sums, one host read."""
    if not tensors:
        return []
    device = tensors[0].device
    raw, words_per = [], []
    for t in tensors:
        b = _byte_view(t)
        pad = -b.numel() % 4
        raw.append(b)
        if pad:
            raw.append(torch.zeros(pad, dtype=torch.uint8, device=device))
        words_per.append((b.numel() + pad) // 4)
    flat = torch.cat(raw) if len(raw) > 1 else raw[0]
    if flat.storage_offset() % 4:            # a byte view must start on a word to be read as int32
        flat = flat.clone()
    words_all = flat.view(torch.int32)
    if device.type == "cuda":                # one Triton launch (kernels/qh128.py), the same sums
        from megatron_qrl.kernels.qh128 import qh128_lane_sums

        lanes = qh128_lane_sums(words_all, words_per, _LANES).cpu().tolist()
        return [_finish(_header(t), lane) for t, lane in zip(tensors, lanes)]
    total = sum(words_per)
    counts = torch.tensor(words_per, dtype=torch.int64).to(device, non_blocking=True)
    starts_dev = torch.cumsum(counts, 0) - counts
    # segment of every word, built where the words are (output_size: no device->host read)
    seg_of = torch.repeat_interleave(torch.arange(len(tensors), device=device), counts, output_size=total)
    sums = torch.zeros(len(tensors), 2, dtype=torch.int64, device=device)
    for w0 in range(0, total, CHUNK_WORDS):
        w1 = min(total, w0 + CHUNK_WORDS)
        words = words_all[w0:w1].to(torch.int64) & 0xFFFFFFFF
        seg = seg_of[w0:w1]
        local = torch.arange(w0, w1, dtype=torch.int64, device=device) - starts_dev[seg]
        sums += _lane_sums(words, seg, local, len(tensors))
    lanes = sums.cpu().tolist()
    return [_finish(_header(t), lane) for t, lane in zip(tensors, lanes)]


def _host_digest(t: torch.Tensor, algorithm: str) -> str:
    header = f"{t.dtype}|{tuple(t.shape)}|".encode()
    if algorithm == "sha256":
        h = hashlib.sha256(header)
    elif algorithm == "xxh3_128":
        try:
            import xxhash
        except ImportError as e:
            raise UnknownDigestError("digest algorithm xxh3_128 needs the xxhash package on this side "
                                     "(pip install xxhash) or use qh128 / sha256 on the sender") from e
        h = xxhash.xxh3_128(header)
    else:
        raise UnknownDigestError(f"unknown digest algorithm '{algorithm}'; use one of {DIGEST_ALGORITHMS}")
    h.update(_byte_view(t).cpu().numpy().tobytes())
    return f"{algorithm}:{h.hexdigest()}"


def tensor_digests(tensors: Sequence[torch.Tensor], algorithm: str = DEFAULT_DIGEST) -> list[str]:
    """Digests of many tensors; qh128 hashes all tensors of one device together (a few launches)."""
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensor_digest expects a torch.Tensor, got {type(t).__name__}")
    if algorithm != DEVICE_DIGEST:
        return [_host_digest(t, algorithm) for t in tensors]
    out: list[Optional[str]] = [None] * len(tensors)
    by_device: dict = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    for idx in by_device.values():
        for i, d in zip(idx, _qh128_many([tensors[i] for i in idx])):
            out[i] = d
    return out  # type: ignore[return-value]


def tensor_digest(t: torch.Tensor, algorithm: str = DEFAULT_DIGEST) -> str:
    """'<algorithm>:<hex>' over dtype, shape and the raw bytes of `t` (device and strides do not matter)."""
    return tensor_digests([t], algorithm)[0]


def digest_algorithm(digest: str) -> str:
    """The algorithm a digest string names; UnknownDigestError when it names none."""
    algo = digest.split(":", 1)[0] if ":" in digest else ""
    if algo not in DIGEST_ALGORITHMS:
        raise UnknownDigestError(f"digest '{digest[:24]}...' does not start with a known algorithm "
                                 f"({', '.join(DIGEST_ALGORITHMS)}); compute it with quant.digest.tensor_digest")
    return algo


def combine(label: str, part_digests: Iterable[str], algorithm: str) -> str:
    """One digest over a labelled sequence of part digests (an FP4 payload: format + its parts)."""
    h = hashlib.sha256(f"{label}|{'|'.join(part_digests)}".encode()).hexdigest()
    return f"{algorithm}:{h}"


def reference_qh128(t: torch.Tensor) -> str:
    """qh128 in pure Python over host bytes (slow): the definition the torch implementation must equal."""
    b = _byte_view(t).cpu().numpy().tobytes()
    b += b"\0" * (-len(b) % 4)
    words = struct.unpack(f"<{len(b) // 4}I", b)

    def fmix(k):
        k ^= k >> 33
        k = (k * _FMIX[0]) & _MASK64
        k ^= k >> 33
        k = (k * _FMIX[1]) & _MASK64
        return k ^ (k >> 33)

    lanes = [sum(fmix(((i * c) & _MASK64) ^ w ^ s) for i, w in enumerate(words)) & _MASK64 for c, s in _LANES]
    return _finish(_header(t), lanes)


__all__ = ["DEFAULT_DIGEST", "DEVICE_DIGEST", "DIGEST_ALGORITHMS", "UnknownDigestError", "combine",
           "digest_algorithm", "reference_qh128", "tensor_digest", "tensor_digests"]
