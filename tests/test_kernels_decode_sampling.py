"""Decode sampling kernels (kernels/decode_sampling.py) against the torch references in rollout/rng.py and
rollout/sampling.py, and the dispatch of sampling.sample_and_logprob.

Uniforms: bit for bit. Greedy: the same token (first index on ties). Log-probs: within float32 round-off
of the float64 log_softmax and of policy_logprobs (whose float32 sum drifts by ~1e-5 over a 152K
vocabulary on the CPU).
Sampled: for the same uniform the same token as sample_rows except where u lies within round-off of a CDF
boundary (checked on uniforms placed between boundaries, on boundaries and at the ends), never a token of
zero probability, and token frequencies over many counter-based uniforms pass a chi-square test against
softmax(logits / T). Small VOCAB_BLOCK values make small vocabularies span several blocks (and keep the
interpreter's per-program cost low: sizes here are chosen for two shared CPU cores).
QRL_KERNEL_TESTS_DEVICE=cuda runs the same tests on a GPU.
"""
import os

DEVICE = "cuda" if os.environ.get("QRL_KERNEL_TESTS_DEVICE") == "cuda" else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from megatron_qrl.kernels import decode_sampling  # noqa: E402
from megatron_qrl.kernels.decode_sampling import (greedy_token_logprob, sample_token_logprob,  # noqa: E402
                                                  token_logprob, uniforms_kernel)
from megatron_qrl.rollout import sampling  # noqa: E402
from megatron_qrl.rollout.protocol import SamplingParams  # noqa: E402
from megatron_qrl.rollout.rng import stream_keys, uniforms_reference  # noqa: E402
from megatron_qrl.rollout.sampling import policy_logprobs, sample_rows  # noqa: E402

LOGP_ATOL = 1e-5


def assert_logprobs(logp, logits, tokens):
    """Close to the float64 log_softmax, and to the torch reference."""
    exact = torch.log_softmax(logits.double(), -1).gather(-1, tokens[:, None]).squeeze(-1)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp.double(), exact, atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(logp, policy_logprobs(logits, tokens), atol=5e-5 if logits.shape[-1] > 10000
                               else LOGP_ATOL, rtol=0)


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(decode_sampling, "VOCAB_BLOCK", 32)


def row_keys(n, seed=0):
    return stream_keys(seed, torch.arange(n)).to(DEVICE)


def test_uniforms_are_bit_identical():
    g = torch.Generator().manual_seed(0)
    keys = torch.cat([stream_keys(5, torch.arange(3000)), torch.tensor([0, 2 ** 32 - 1])])
    counters = torch.cat([torch.randint(0, 2 ** 40, (1500,), generator=g), torch.arange(1500),
                          torch.tensor([0, 2 ** 31 + 7])])
    u = uniforms_kernel(keys.to(DEVICE), counters.to(DEVICE))
    assert u.dtype == torch.float64
    assert torch.equal(u.cpu(), uniforms_reference(keys, counters))
    assert uniforms_kernel(keys[:0], counters[:0]).numel() == 0


@pytest.mark.parametrize("b, v, dtype", [(1, 50, torch.float32), (5, 3001, torch.bfloat16),
                                         (2, 151936, torch.float32), (64, 257, torch.float32)], ids=str)
def test_greedy_token_and_logprob(b, v, dtype):
    g = torch.Generator().manual_seed(b + v)
    logits = (torch.randn(b, v, generator=g) * 4).to(dtype)
    # ties: row 0's max appears twice (in different blocks for large V), the last row's max at its end too
    logits[0, v // 3] = logits[0, v - 1] = logits[0].max() + 1
    logits[-1, -1] = logits[-1].max()
    logits = logits.to(DEVICE)
    token, logp = greedy_token_logprob(logits)
    assert token.dtype == torch.int64 and logp.dtype == torch.float32
    assert torch.equal(token, torch.argmax(logits, -1))
    assert int(token[0]) == v // 3
    assert_logprobs(logp, logits, token)


def test_token_logprob_matches_policy_logprobs(small_blocks):
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(9, 200, generator=g) * 3).to(DEVICE)
    logits[2, 30:] = float("-inf")
    tokens = torch.randint(0, 30, (9,), generator=g).to(DEVICE)
    assert_logprobs(token_logprob(logits, tokens), logits, tokens)


def reference_cdf(logits, temperature):
    """sample_rows' float64 CDF (unnormalised by its last entry)."""
    return torch.softmax(logits.float() / temperature, -1).double().cumsum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sampled_token_equals_reference_away_from_boundaries(small_blocks, temperature):
    """Uniforms halfway between two CDF boundaries pick the reference's token; uniforms on a boundary pick
    one of the two tokens it separates; u = 0 and the largest u pick the first / last non-zero token."""
    g = torch.Generator().manual_seed(2)
    v = 90
    row = torch.randn(v, generator=g) * 2
    row[::7] = float("-inf")                                  # zero-probability tokens, one whole block too
    row[32:64] = float("-inf")
    cdf = reference_cdf(row[None], temperature)[0]
    cdf = cdf / cdf[-1]
    nz = torch.nonzero(torch.isfinite(row)).flatten()
    mids = ((cdf[nz] + torch.cat([torch.zeros(1, dtype=cdf.dtype), cdf[nz[:-1]]])) / 2)
    edges = cdf[nz[:-1]]
    u = torch.cat([mids, edges, torch.tensor([0.0, 1 - 2.0 ** -53], dtype=torch.float64)])
    logits = row.expand(u.numel(), v).contiguous().to(DEVICE)
    token, logp = sample_token_logprob(logits, u.to(DEVICE), temperature)
    token = token.cpu()
    m = mids.numel()
    assert torch.equal(token[:m], nz)
    for e, t in zip(range(m, m + edges.numel()), token[m:m + edges.numel()].tolist()):
        j = e - m
        assert t in (int(nz[j]), int(nz[j + 1]))
    assert int(token[-2]) == int(nz[0]) and int(token[-1]) == int(nz[-1])
    assert bool(torch.isfinite(row[token]).all())
    assert_logprobs(logp, logits, token.to(DEVICE))


@pytest.mark.parametrize("v, block", [(151936, None), (3001, 512)], ids=["qwen-vocab", "blocks"])
def test_sampled_token_equals_reference_for_random_uniforms(monkeypatch, v, block):
    """Random rows and counter-based uniforms: the reference's token unless u is within 1e-6 of a boundary."""
    if block:
        monkeypatch.setattr(decode_sampling, "VOCAB_BLOCK", block)
    b = 4 if v > 100000 else 16
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(b, v, generator=g) * 3).to(DEVICE)
    keys, counters = row_keys(b, seed=9), torch.arange(b, device=DEVICE)
    u = uniforms_reference(keys.cpu(), counters.cpu()).to(DEVICE)
    token, logp = sample_token_logprob(logits, temperature=0.8, keys=keys, counters=counters)
    ref = sample_rows(logits, SamplingParams(temperature=0.8), u)
    cdf = reference_cdf(logits, 0.8)
    target = u.double() * cdf[:, -1]
    for i in torch.nonzero(token != ref).flatten().tolist():
        lo = int(min(token[i], ref[i]))
        assert abs(float(cdf[i, lo] - target[i])) < 1e-6 * float(cdf[i, -1]), (i, int(token[i]), int(ref[i]))
    assert torch.equal(token, sample_token_logprob(logits, u, 0.8)[0])      # keyed == given uniforms
    assert_logprobs(logp, logits, token)


def test_sampled_frequencies_follow_the_distribution(monkeypatch):
    """Chi-square over 800 counter-based draws of one 8-token row spread over two blocks (p > 0.001)."""
    monkeypatch.setattr(decode_sampling, "VOCAB_BLOCK", 4)
    g = torch.Generator().manual_seed(4)
    v, n, temperature = 8, 800, 1.3
    row = torch.randn(v, generator=g)
    row[5] = float("-inf")
    logits = row.expand(n, v).contiguous().to(DEVICE)
    keys = row_keys(1, seed=11).expand(n).contiguous()
    token, _ = sample_token_logprob(logits, temperature=temperature, keys=keys,
                                    counters=torch.arange(n, device=DEVICE))
    counts = torch.bincount(token.cpu(), minlength=v).double()
    expected = torch.softmax(row.double() / temperature, -1) * n
    assert counts[5] == 0
    keep = expected > 0
    chi2 = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    assert float(expected[keep].min()) > 5                     # where the chi-square approximation holds
    assert chi2 < 22.46, chi2                                   # chi-square(6 dof) at p = 0.001


def test_sampling_refuses_bad_arguments():
    logits = torch.randn(2, 10, device=DEVICE)
    u = torch.rand(2, dtype=torch.float64, device=DEVICE)
    with pytest.raises(ValueError, match="temperature"):
        sample_token_logprob(logits, u, 0.0)
    with pytest.raises(ValueError, match="either u or keys"):
        sample_token_logprob(logits, u, 1.0, keys=row_keys(2), counters=torch.zeros(2, dtype=torch.long))


# ------------------------------------------------------------------------------ sample_and_logprob dispatch
PARAMS = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9),
          SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=1.1, top_p=0.8)]


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "plain", "top_k", "top_p"])
def test_sample_and_logprob_kernels_match_the_torch_path(monkeypatch, params):
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(6, 300, generator=g) * 3).to(DEVICE)
    keys, counters = row_keys(6, seed=2), torch.arange(6, device=DEVICE) * 3
    monkeypatch.setenv("QRL_KERNELS", "torch")
    ref_tokens, ref_logp = sampling.sample_and_logprob(logits, params, keys, counters)
    assert torch.equal(ref_tokens, sample_rows(logits, params, uniforms_reference(keys.cpu(), counters.cpu())
                                               .to(DEVICE)))
    monkeypatch.setenv("QRL_KERNELS", "triton")
    tokens, logp = sampling.sample_and_logprob(logits, params, keys, counters)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logp, ref_logp, atol=LOGP_ATOL, rtol=0)


def test_greedy_draws_no_uniforms(monkeypatch):
    def no_draws(*_):
        raise AssertionError("greedy decoding drew uniforms")

    monkeypatch.setattr("megatron_qrl.rollout.rng.uniforms", no_draws)
    logits = torch.randn(3, 20, device=DEVICE)
    for mode in ("torch", "triton"):
        monkeypatch.setenv("QRL_KERNELS", mode)
        tokens, logp = sampling.sample_and_logprob(logits, SamplingParams(temperature=0.0), row_keys(3),
                                                   torch.zeros(3, dtype=torch.long, device=DEVICE))
        assert torch.equal(tokens, logits.argmax(-1))
