"""Token selection of a decode step on the device: counter-based uniforms, greedy / sampled token and its
policy log-prob, in two launches over the vocabulary.

Why: the torch path (rollout/rng.py `uniforms`: ~100 tiny integer ops; sampling.py `sample_rows`: softmax,
a float64 cumsum over the whole vocabulary, searchsorted; then log_softmax + gather for the log-prob) costs
more launches and passes over [B, V] than the rest of a small decode step.

- `uniforms_kernel(keys, counters)`: rng.uniforms bit for bit (the same lowbias32 integer hashing, one
  launch); `_uniform` is also inlined into the sampling search, so sampling needs no separate RNG launch.
- Pass 1 (`_vocab_partials_kernel`, grid rows x vocabulary blocks): per block the max and the sum of
  exp(x - max) of the raw logits (the log-prob's normaliser) and, when sampling at temperature != 1, of
  logits / temperature; greedy also the block's first argmax.
- Pass 2 (`_vocab_select_kernel`, one program per row): combines the blocks' partials and
  - greedy: the first block holding the row max gives its first argmax (first index on ties);
  - sampled: inverse-CDF with the row's uniform u: target = u * total mass; the first block whose float64
    prefix of block masses exceeds it, then, in that block, the first index whose float64 cumulative mass
    exceeds the rest. Starting from a non-negative target, the first index that exceeds it has non-zero
    mass, so a zero-probability token is never chosen (round-off past a block's end clamps to its last
    non-zero token). Not bit-identical to sample_rows' float64 cumsum of float32 probabilities (the masses
    are unnormalised, partial sums in another order) but the same distribution: the tokens differ only
    where u lies within float32 round-off of a CDF boundary;
  - the log-prob of the chosen (or a given) token: (x_tok - max) - log(sum exp(x - max)) over the raw logits,
    log_softmax(logits.float())[token] to float32 round-off.
Top-k / top-p sampling keeps the torch path (rollout/sampling.py). References: rng.uniforms_reference,
sampling.sample_rows and sampling.policy_logprobs (tests/test_kernels_decode_sampling.py).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

# vocabulary elements per pass-1 program (151,936 tokens: 75 blocks per row)
VOCAB_BLOCK = 2048
GREEDY, SAMPLE, GIVEN = 0, 1, 2


# ------------------------------------------------------------------------------------------------ RNG
@triton.jit
def _mul32(x, c: tl.constexpr):
    """(x * c) mod 2^32 for int64 x in [0, 2^32) through 16-bit halves, as rng._mul32 (no int64 overflow)."""
    lo = x & 0xFFFF
    hi = x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & 0xFFFFFFFF


@triton.jit
def _mix32(x):
    """lowbias32 finalizer on int64 values, as rng.mix32."""
    x = x & 0xFFFFFFFF
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


@triton.jit
def _uniform(key, counter):
    """rng.uniforms for int64 key / counter: 53 random bits from two hashes, as float64 in [0, 1)."""
    c2 = counter.to(tl.int64) * 2
    key = key.to(tl.int64)
    a = _mix32(key ^ _mix32(c2))
    b = _mix32(key ^ _mix32(c2 + 1) ^ 0x5BD1E995)
    return ((a >> 5) * 67108864 + (b >> 6)).to(tl.float64) * 1.1102230246251565e-16      # * 2^-53, exact


@triton.jit
def _uniforms_kernel(keys_ptr, counters_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    key = tl.load(keys_ptr + i, mask=mask, other=0)
    counter = tl.load(counters_ptr + i, mask=mask, other=0)
    tl.store(out_ptr + i, _uniform(key, counter), mask=mask)


def uniforms_kernel(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """float64 [n] uniforms of (key, counter) pairs, bit-identical to rng.uniforms_reference; one launch."""
    keys = keys.reshape(-1).to(torch.int64).contiguous()
    counters = counters.reshape(-1).to(device=keys.device, dtype=torch.int64).contiguous()
    if keys.shape != counters.shape:
        raise ValueError(f"keys {tuple(keys.shape)} and counters {tuple(counters.shape)} differ")
    out = torch.empty(keys.shape, dtype=torch.float64, device=keys.device)
    n = keys.numel()
    if n:
        _uniforms_kernel[(triton.cdiv(n, 1024),)](keys, counters, out, n, BLOCK=1024, num_warps=4)
    return out


# ---------------------------------------------------------------------------------- vocabulary passes
@triton.jit
def _max_and_mass(x):
    """(max, sum exp(x - max)) of a block; an all -inf block has mass 0 (not NaN)."""
    m = tl.max(x, 0)
    safe = tl.where(m == float("-inf"), 0.0, m)
    return m, tl.sum(tl.exp(x - safe), 0)


@triton.jit
def _vocab_partials_kernel(logits_ptr, stride_l, V, temperature, part_ptr, arg_ptr, NB,
                           MODE: tl.constexpr, TEMP_ONE: tl.constexpr, BLOCK_V: tl.constexpr):
    """part[row, blk] = (max, mass) of the raw logits, then of logits / temperature; GREEDY: arg[row, blk]
    = the block's first argmax."""
    row = tl.program_id(0)
    blk = tl.program_id(1)
    offs = blk * BLOCK_V + tl.arange(0, BLOCK_V)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_l + offs, mask=offs < V,
                other=float("-inf")).to(tl.float32)
    m1, z1 = _max_and_mass(x)
    base = part_ptr + (row.to(tl.int64) * NB + blk) * 4
    tl.store(base, m1)
    tl.store(base + 1, z1)
    if MODE == 0:
        tl.store(arg_ptr + row.to(tl.int64) * NB + blk, tl.min(tl.where(x == m1, offs, 2147483647), 0))
    if MODE == 1:
        if TEMP_ONE:
            mt, zt = m1, z1
        else:
            mt, zt = _max_and_mass(x / temperature)
        tl.store(base + 2, mt)
        tl.store(base + 3, zt)


@triton.jit
def _vocab_select_kernel(logits_ptr, stride_l, V, temperature, part_ptr, arg_ptr, NB,
                         u_ptr, keys_ptr, counters_ptr, tokens_in_ptr, token_ptr, logp_ptr,
                         MODE: tl.constexpr, TEMP_ONE: tl.constexpr, KEYED: tl.constexpr,
                         NB_PAD: tl.constexpr, BLOCK_V: tl.constexpr):
    """One row: its token (GREEDY / SAMPLE, or GIVEN in tokens_in) and that token's policy log-prob.
    KEYED: the row's uniform is drawn here from keys / counters (else read from u)."""
    row = tl.program_id(0)
    r64 = row.to(tl.int64)
    blocks = tl.arange(0, NB_PAD)
    b_ok = blocks < NB
    base = part_ptr + (r64 * NB + blocks) * 4
    m1 = tl.load(base, mask=b_ok, other=float("-inf"))
    z1 = tl.load(base + 1, mask=b_ok, other=0.0)
    top = tl.max(m1, 0)
    mass = tl.sum(z1 * tl.exp(m1 - top), 0)                   # sum exp(x - top) over the row
    if MODE == 0:
        args = tl.load(arg_ptr + r64 * NB + blocks, mask=b_ok, other=2147483647)
        token = tl.min(tl.where(m1 == top, args, 2147483647), 0)
    elif MODE == 2:
        token = tl.load(tokens_in_ptr + row).to(tl.int32)
    else:
        if TEMP_ONE:
            mt, zt = m1, z1
        else:
            mt = tl.load(base + 2, mask=b_ok, other=float("-inf"))
            zt = tl.load(base + 3, mask=b_ok, other=0.0)
        top_t = tl.max(mt, 0)
        w = (zt * tl.exp(mt - top_t)).to(tl.float64)          # block masses relative to the row max
        prefix = tl.cumsum(w, 0)
        if KEYED:
            u = _uniform(tl.load(keys_ptr + row), tl.load(counters_ptr + row))
        else:
            u = tl.load(u_ptr + row).to(tl.float64)
        target = u * tl.sum(w, 0)
        last_b = tl.max(tl.where(w > 0, blocks, 0), 0)
        blk = tl.minimum(tl.sum((prefix <= target).to(tl.int32), 0), last_b)
        rest = tl.maximum(target - tl.sum(tl.where(blocks < blk, w, 0.0), 0), 0.0)
        offs = blk * BLOCK_V + tl.arange(0, BLOCK_V)
        x = tl.load(logits_ptr + r64 * stride_l + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        if not TEMP_ONE:
            x = x / temperature
        p = tl.exp(x - top_t)
        cum = tl.cumsum(p.to(tl.float64), 0)
        last = tl.max(tl.where(p > 0, tl.arange(0, BLOCK_V), 0), 0)
        token = blk * BLOCK_V + tl.minimum(tl.sum((cum <= rest).to(tl.int32), 0), last)
    x_tok = tl.load(logits_ptr + r64 * stride_l + token).to(tl.float32)
    tl.store(token_ptr + row, token.to(tl.int64))
    tl.store(logp_ptr + row, (x_tok - top) - tl.log(mass))


def _select(logits: torch.Tensor, mode: int, temperature: float = 1.0, u: Optional[torch.Tensor] = None,
            keys: Optional[torch.Tensor] = None, counters: Optional[torch.Tensor] = None,
            tokens: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got {tuple(logits.shape)}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    b, v = logits.shape
    dev = logits.device
    nb = triton.cdiv(v, VOCAB_BLOCK)
    part = torch.empty((b, nb, 4), dtype=torch.float32, device=dev)
    args = torch.empty((b, nb), dtype=torch.int32, device=dev)
    token = torch.empty(b, dtype=torch.int64, device=dev)
    logp = torch.empty(b, dtype=torch.float32, device=dev)
    if b == 0:
        return token, logp

    def vec(t: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """A per-row input on the device; `part` stands in for the pointers a mode never reads."""
        return part if t is None else t.reshape(-1).to(device=dev, dtype=dtype).contiguous()

    temp_one = temperature == 1.0
    _vocab_partials_kernel[(b, nb)](logits, logits.stride(0), v, float(temperature), part, args, nb,
                                    MODE=mode, TEMP_ONE=temp_one, BLOCK_V=VOCAB_BLOCK, num_warps=4)
    _vocab_select_kernel[(b,)](logits, logits.stride(0), v, float(temperature), part, args, nb,
                               vec(u, torch.float64), vec(keys, torch.int64), vec(counters, torch.int64),
                               vec(tokens, torch.int64), token, logp,
                               MODE=mode, TEMP_ONE=temp_one, KEYED=keys is not None, NB_PAD=triton.next_power_of_2(nb),
                               BLOCK_V=VOCAB_BLOCK, num_warps=4)
    return token, logp


def greedy_token_logprob(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of logits [B, V] -> (argmax, first index on ties: int64 [B], its log_softmax: float32 [B])."""
    return _select(logits, GREEDY)


def sample_token_logprob(logits: torch.Tensor, u: Optional[torch.Tensor] = None, temperature: float = 1.0, *,
                         keys: Optional[torch.Tensor] = None, counters: Optional[torch.Tensor] = None,
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF sample of softmax(logits / temperature) per row with the row's uniform u [B] (or the
    uniforms of keys / counters [B], drawn inside the kernel) -> (token int64 [B], its policy log-prob at
    temperature 1, unfiltered: float32 [B]). Temperature > 0, no top-k / top-p."""
    if not temperature > 0:
        raise ValueError(f"sampling needs temperature > 0, got {temperature} (greedy: greedy_token_logprob)")
    if (u is None) == (keys is None) or (keys is None) != (counters is None):
        raise ValueError("pass either u or keys and counters")
    return _select(logits, SAMPLE, temperature, u=u, keys=keys, counters=counters)


def token_logprob(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits [B, V] in float32)[b, tokens[b]]: float32 [B] (sampling.policy_logprobs)."""
    return _select(logits, GIVEN, tokens=tokens)[1]
