"""Counter-based random numbers for sampling: uniform(key of (seed, sequence index), token counter).

Why counter-based instead of a torch.Generator per sequence: a CUDA-graph decode step samples every row of
the batch in one launch, with no host state per sequence, so the draw for a sequence's n-th token must be a
pure function of (seed, the sequence's global index, n). That keeps the property the engine promises: a
sequence's tokens depend only on its own logits and seed, never on the batch it shares or the order of
admission, and the eager and the graph decode paths draw exactly the same uniforms.

The hash is 32-bit "lowbias32" mixing done in int64 tensors with every product kept below 2^63 (no signed
overflow), so the same bits come out on the CPU and on the GPU. Two hashes give the 53 bits of a double.
`uniforms` sends CUDA tensors (and, with QRL_KERNELS=triton under TRITON_INTERPRET=1, CPU ones) to one
Triton launch with the same bits (kernels/decode_sampling.py) instead of ~100 tiny integer ops;
`uniforms_reference` is the torch code.
"""
from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_SEED_STRIDE = 1_000_003  # a prime: (seed, index) pairs map to distinct stream keys


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32), without int64 overflow (16-bit halves)."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 finalizer on int64 tensors holding 32-bit values."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def stream_keys(seed: int, indices: torch.Tensor) -> torch.Tensor:
    """int64 key per sequence from the call's seed and each sequence's global index."""
    s = int(seed) * _SEED_STRIDE
    idx = indices.to(torch.int64)
    x = mix32(idx & _MASK32) ^ mix32((idx >> 32) + 0x68E31DA4)
    return mix32(x ^ mix32(torch.full_like(idx, s & _MASK32)) ^ ((s >> 32) & _MASK32))


def uniforms(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """float64 in [0, 1) for each (key, counter): the draw of a sequence's counter-th token."""
    from megatron_qrl.kernels import use_triton

    if use_triton(keys):
        from megatron_qrl.kernels.decode_sampling import uniforms_kernel

        return uniforms_kernel(keys, counters).view(keys.shape)
    return uniforms_reference(keys, counters)


def uniforms_reference(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """`uniforms` in torch integer ops (the reference of the kernel; the CPU path)."""
    c = counters.to(torch.int64)
    a = mix32(keys ^ mix32(2 * c))
    b = mix32(keys ^ mix32(2 * c + 1) ^ 0x5BD1E995)
    return ((a >> 5) * 67108864 + (b >> 6)).to(torch.float64) / 9007199254740992.0


class SequenceRandom:
    """One sequence's stream: `next()` returns the uniform of its next token (host side, eager tests)."""

    def __init__(self, seed: int, index: int):
        self.key = stream_keys(seed, torch.tensor([index]))
        self.counter = 0

    def next(self) -> torch.Tensor:
        u = uniforms(self.key, torch.tensor([self.counter]))[0]
        self.counter += 1
        return u
