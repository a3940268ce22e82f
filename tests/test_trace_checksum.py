"""The TRACE checksum (format 2): blake2b-32 over the header bytes and each section's qh128, checked here
against a recomputation from the serialized bytes that shares no code with serialize.py.

QRL_KERNEL_TESTS_DEVICE=cuda also runs the CUDA case (qh128's Triton kernel hashes a GPU cache where it
lives); on a GPU machine: TESTS="tests/test_trace_checksum.py tests/one_thread.py" bash tools/gpu_kernels.sh.
"""
import hashlib
import json
import os
import struct

import pytest
import torch

from megatron_qrl.quant.digest import reference_qh128
from megatron_qrl.trace import CorruptCacheError, EntryCut, TraceCache
from megatron_qrl.trace import serialize
from megatron_qrl.trace.synthetic import make_rollout

from one_thread import one_intra_op_thread  # noqa: F401 (an autouse fixture)

DEVICE = "cuda" if os.environ.get("QRL_KERNEL_TESTS_DEVICE") == "cuda" else "cpu"


@pytest.fixture(scope="module")
def ro():
    return make_rollout(num_samples=4, seq_len=10, prompt_len=4, layers=(1, 2),
                        routed_sites={"fc1": 64, "fc2": 32}, dense_sites={"qkv": 32}, num_experts=4, seed=7)


@pytest.fixture(scope="module")
def cache(ro):
    return ro.build(weight_version=3, step=5, fingerprint="fp")


def _layout(raw: bytes) -> tuple[bytes, list[tuple[int, int]], list[tuple[int, int]]]:
    """(bytes [16, 24+H), section spans, padding spans) read from the header as docs/trace.md lays it out."""
    (h,) = struct.unpack_from("<Q", raw, 16)
    head = json.loads(raw[24:24 + h])
    at, sections, padding = 24 + h, [], []

    def span(nbytes: int, align: int) -> None:
        nonlocal at
        start = -(-at // align) * align
        if start > at:
            padding.append((at, start))
        sections.append((start, start + nbytes))
        at = start + nbytes

    span(12 * head["n_token_runs"], 8)
    span(head["n_rowsets"] * head["rowset_bytes"], 1)
    for _layer, _site, _expert, _rowset, rows, _k0, k_width, _k_full, n_gs in head["entries"]:
        width = (n_gs - 1).bit_length() if n_gs > 1 else 0
        span(rows * k_width // 8, 1)
        span(rows * k_width // 16, 1)
        span(4 * n_gs, 4)
        span(-(-rows * width // 8), 1)
    assert at == len(raw)
    return raw[16:24 + h], sections, padding


def _reference_checksum(raw: bytes) -> int:
    head, sections, _ = _layout(raw)
    h = hashlib.blake2b(head, digest_size=4)
    for a, b in sections:
        h.update(reference_qh128(torch.tensor(bytearray(raw[a:b]), dtype=torch.uint8)).encode())
    return int.from_bytes(h.digest(), "little")


def _flipped(blob: torch.Tensor, pos: int, bit: int = 0x20) -> torch.Tensor:
    bad = blob.clone()
    bad[pos] ^= bit
    return bad


def test_checksum_equals_an_independent_recomputation(cache):
    raw = bytes(cache.to_bytes().numpy())
    assert raw[8:12] == struct.pack("<I", 2)
    (stored,) = struct.unpack_from("<I", raw, 12)
    assert stored == cache.checksum == _reference_checksum(raw) == cache.compute_checksum()


def test_a_flipped_byte_in_any_section_or_the_header_is_caught(cache):
    blob = cache.to_bytes()
    raw = bytes(blob.numpy())
    _, sections, _ = _layout(raw)
    for a, b in sections:
        for pos in {a, (a + b) // 2, b - 1} if b > a else ():
            with pytest.raises(CorruptCacheError, match="checksum mismatch"):
                TraceCache.from_bytes(_flipped(blob, pos))
    # header edits that keep the JSON valid and the layout intact: only the checksum sees them
    for old, new in ((b'"fingerprint":"fp"', b'"fingerprint":"fq"'), (b'"step":5', b'"step":4')):
        i = next(i for i, (x, y) in enumerate(zip(old, new)) if x != y)
        bad = _flipped(blob, raw.index(old) + i, old[i] ^ new[i])
        decoded = TraceCache.from_bytes(bad, verify=False)
        assert (decoded.fingerprint, decoded.step) != (cache.fingerprint, cache.step)
        with pytest.raises(CorruptCacheError, match="checksum mismatch"):
            TraceCache.from_bytes(bad)
    with pytest.raises(CorruptCacheError, match="checksum mismatch"):
        TraceCache.from_bytes(_flipped(blob, 12))


def test_padding_must_be_zero(cache):
    """Padding carries nothing, but to_bytes writes zeros there: a verified buffer is byte for byte what was
    sent, so a flipped padding byte is refused; unverified decoding still yields the intact content."""
    blob = cache.to_bytes()
    _, _, padding = _layout(bytes(blob.numpy()))
    assert padding
    for a, b in padding:
        bad = _flipped(blob, b - 1)
        with pytest.raises(CorruptCacheError, match="padding"):
            TraceCache.from_bytes(bad)
        assert TraceCache.from_bytes(bad, verify=False).same_content(cache)


def test_a_version_1_blob_names_the_problem(cache):
    blob = cache.to_bytes()
    old = blob.clone()
    old[8:12] = torch.tensor(list(struct.pack("<I", 1)), dtype=torch.uint8)
    with pytest.raises(CorruptCacheError, match=r"version 1 was written by an older build .*re-record"):
        TraceCache.from_bytes(old, verify=False)
    old[8:12] = torch.tensor(list(struct.pack("<I", 7)), dtype=torch.uint8)
    with pytest.raises(CorruptCacheError, match="format version 7; this build reads version 2"):
        TraceCache.from_bytes(old)


def test_cpu_checksum_is_deterministic(ro, cache):
    again = ro.build(weight_version=3, step=5, fingerprint="fp")
    assert again.checksum == cache.checksum == cache.compute_checksum()
    assert torch.equal(again.to_bytes(), cache.to_bytes())
    # a rebuild through subset (what select does) lays out the same bytes, so the same checksum
    assert cache.subset(lambda key, entry: EntryCut()).checksum == cache.checksum
    torch.set_num_threads(2)                    # the one_intra_op_thread fixture restores the count
    assert cache.compute_checksum() == cache.checksum


def test_one_batched_digest_call_per_checksum(cache, monkeypatch):
    calls = []

    def counting(tensors, algorithm):
        calls.append(len(tensors))
        return digests(tensors, algorithm)

    digests = serialize.tensor_digests
    monkeypatch.setattr(serialize, "tensor_digests", counting)
    n_sections = 2 + 4 * len(cache)
    cache.compute_checksum()
    blob = cache.to_bytes()
    TraceCache.from_bytes(blob, verify=True)
    assert calls == [n_sections, n_sections]
    TraceCache.from_bytes(blob, verify=False)
    assert len(calls) == 2


@pytest.mark.skipif(DEVICE != "cuda", reason="QRL_KERNEL_TESTS_DEVICE=cuda runs it on a GPU")
def test_a_cuda_cache_has_the_cpu_checksum(cache):
    on_gpu = cache.to("cuda")
    assert on_gpu.compute_checksum() == cache.checksum
    sealed = on_gpu.subset(lambda key, entry: EntryCut())      # built and sealed from CUDA tensors
    assert sealed.device.type == "cuda" and sealed.checksum == cache.checksum
    blob = sealed.to_bytes(device="cuda")
    back = TraceCache.from_bytes(blob, verify=True)
    assert back.device.type == "cuda" and back.checksum == cache.checksum and back.same_content(cache)
    assert torch.equal(blob.cpu(), cache.to_bytes())
    with pytest.raises(CorruptCacheError, match="checksum mismatch"):
        TraceCache.from_bytes(_flipped(blob, blob.numel() - 1))
