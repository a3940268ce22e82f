"""Rollout building blocks without a model: digests, FP4 weight store, sampling, KV quantization, scheduler."""
import math

import pytest
import torch

from megatron_qrl.quant import FP4Tensor, pack_weight, payload_digest, tensor_digest
from megatron_qrl.rollout import RolloutSample, SamplingParams, WeightUpdateError
from megatron_qrl.rollout.attention import StepBatch, attend
from megatron_qrl.rollout.kv_cache import KVCache, quantize_dequantize_kv
from megatron_qrl.rollout.sampling import filter_logits, policy_logprobs, sample_token, sequence_generator
from megatron_qrl.rollout.scheduler import ContinuousBatchScheduler, Sequence
from megatron_qrl.rollout.weights import WeightStore


# ------------------------------------------------------------------------------------------ digests
@pytest.mark.parametrize("algorithm", ["qh128", "sha256"])
def test_tensor_digest_covers_bytes_dtype_and_shape(algorithm):
    t = torch.arange(12, dtype=torch.float32)
    d = tensor_digest(t, algorithm)
    assert d.startswith(f"{algorithm}:") and d == tensor_digest(t.clone(), algorithm)
    assert d == tensor_digest(t.reshape(12)[::1].contiguous(), algorithm)
    assert d != tensor_digest(t.reshape(3, 4), algorithm)                  # shape is part of the digest
    assert d != tensor_digest(t.to(torch.float64), algorithm)              # dtype too
    u = t.clone()
    u[5] = u[5] + 1e-6
    assert d != tensor_digest(u, algorithm)                                # one changed bit changes it
    m = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert tensor_digest(m.t().contiguous().t(), algorithm) == tensor_digest(m, algorithm)  # strides do not matter
    assert tensor_digest(torch.tensor(3.0), algorithm).startswith(f"{algorithm}:")  # 0-dim works


def test_sync_digest_default_is_the_device_hash():
    # weight syncs hash on the payload's device (quant/digest.py); SHA-256 stays available for files
    assert tensor_digest(torch.arange(4.0)).startswith("qh128:")


def test_xxh3_digest_when_available():
    pytest.importorskip("xxhash")
    t = torch.randn(8, 16)
    assert tensor_digest(t, "xxh3_128").startswith("xxh3_128:")
    with pytest.raises(ValueError, match="unknown digest"):
        tensor_digest(t, "md5")


def test_fp4_tensor_roundtrip_and_digest():
    torch.manual_seed(0)
    w = torch.randn(32, 64)
    for fmt in ("nvfp4", "mxfp4"):
        q = pack_weight(w, fmt)
        assert q.shape == w.shape and q.packed.dtype == torch.uint8
        deq = q.dequantize(torch.float32)
        rel = float((deq - w).norm() / w.norm())
        assert rel < 0.15, f"{fmt} relative error {rel}"
        assert payload_digest(q) == payload_digest(pack_weight(w.clone(), fmt))
        bad = FP4Tensor(q.format, q.packed.clone(), q.scales, q.global_scale)
        bad.packed[0, 0] ^= 1
        assert payload_digest(bad) != payload_digest(q)


class _TinyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(32, 16, bias=False)
        self.norm = torch.nn.Parameter(torch.ones(32))


def _store():
    torch.manual_seed(0)
    m = _TinyModel()
    return m, WeightStore(dict(m.named_parameters()), ["lin.weight"], "nvfp4")


def test_weight_store_installs_fp4_bytes():
    m, store = _store()
    w = torch.randn(16, 32)
    payload = {"lin.weight": pack_weight(w, "nvfp4"), "norm": torch.full((32,), 2.0)}
    hashes = {n: payload_digest(p) for n, p in payload.items()}
    store.commit(store.stage(payload, hashes), hashes, version=3)
    store.materialize()
    assert torch.equal(m.lin.weight, payload["lin.weight"].dequantize(torch.float32))
    assert torch.equal(m.norm, torch.full((32,), 2.0)) and store.version == 3 and not store.missing()


@pytest.mark.parametrize("problem", ["wrong_hash", "tampered", "unknown", "no_hash", "shape", "fp4_for_norm",
                                     "extra_hash"])
def test_weight_store_refuses_bad_updates(problem):
    m, store = _store()
    payload = {"lin.weight": pack_weight(torch.randn(16, 32), "nvfp4"), "norm": torch.full((32,), 2.0)}
    hashes = {n: payload_digest(p) for n, p in payload.items()}
    if problem == "wrong_hash":
        hashes["norm"] = tensor_digest(torch.zeros(32))
    elif problem == "tampered":
        payload["lin.weight"].packed[0, 0] ^= 0x10      # bytes changed after the sender hashed them
    elif problem == "unknown":
        payload["nope"] = torch.zeros(1)
        hashes["nope"] = payload_digest(payload["nope"])
    elif problem == "no_hash":
        del hashes["norm"]
    elif problem == "shape":
        payload["norm"] = torch.ones(31)
        hashes["norm"] = payload_digest(payload["norm"])
    elif problem == "fp4_for_norm":
        payload["norm"] = pack_weight(torch.ones(1, 32), "nvfp4")
        hashes["norm"] = payload_digest(payload["norm"])
    elif problem == "extra_hash":
        hashes["ghost"] = "sha256:00"
    with pytest.raises(WeightUpdateError, match="weights unchanged"):
        store.stage(payload, hashes)
    assert store.entries == {} and store.version == -1


# ----------------------------------------------------------------------------------------- sampling
def test_sampling_params_validation():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


def test_top_k_and_top_p_restrict_support():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    k2 = filter_logits(logits, SamplingParams(top_k=2))
    assert torch.isfinite(k2).tolist() == [True, True, False, False, False]
    p = torch.softmax(logits, -1)                       # masses ~ .64 .23 .09 .03 .01
    nucleus = filter_logits(logits, SamplingParams(top_p=0.8))
    assert torch.isfinite(nucleus).tolist() == [True, True, False, False, False]
    assert float(p[0]) < 0.8 < float(p[:2].sum())
    only_top = filter_logits(logits, SamplingParams(top_p=0.1))
    assert torch.isfinite(only_top).sum() == 1
    draws = {sample_token(logits, SamplingParams(top_k=2), sequence_generator(0, i)) for i in range(200)}
    assert draws == {0, 1}


def test_sampling_matches_distribution_and_is_seeded():
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5])
    params = SamplingParams(temperature=0.7)
    draws = [sample_token(logits, params, sequence_generator(7, i)) for i in range(4000)]
    freq = torch.bincount(torch.tensor(draws), minlength=4).float() / len(draws)
    assert torch.allclose(freq, torch.softmax(logits / 0.7, -1), atol=0.03)
    g1, g2 = sequence_generator(5, 3), sequence_generator(5, 3)
    draws1 = [sample_token(logits, params, g1) for _ in range(20)]
    assert draws1 == [sample_token(logits, params, g2) for _ in range(20)]
    assert sample_token(logits, SamplingParams(temperature=0), sequence_generator(0, 0)) == 0


def test_policy_logprobs_ignore_temperature_and_filters():
    logits = torch.randn(3, 10)
    tokens = torch.tensor([1, 5, 9])
    expect = torch.log_softmax(logits, -1)[torch.arange(3), tokens]
    assert torch.allclose(policy_logprobs(logits, tokens), expect)
    assert math.isclose(float(policy_logprobs(logits[0], torch.tensor(1))), float(expect[0]), rel_tol=1e-6)


# ---------------------------------------------------------------------------------------- KV cache
def test_kv_quantization_error_bounds():
    torch.manual_seed(0)
    x = torch.randn(64, 2, 32)
    assert torch.equal(quantize_dequantize_kv(x, "bf16"), x)
    amax = x.abs().amax(-1, keepdim=True)
    fp8 = quantize_dequantize_kv(x, "fp8")
    assert float(((fp8 - x).abs() / amax).max()) <= 2 ** -4      # e4m3: 3 mantissa bits, relative to amax
    fp4 = quantize_dequantize_kv(x, "fp4")
    rel4 = float((fp4 - x).norm() / x.norm())
    assert 0.02 < rel4 < 0.15 and float(((fp4 - x).abs() / amax).max()) <= 1 / 6 + 1e-6
    with pytest.raises(ValueError, match="head_dim"):
        quantize_dequantize_kv(torch.randn(4, 24), "fp4")


def test_attend_is_causal_per_sequence():
    torch.manual_seed(0)
    cache = KVCache(num_layers=1, max_slots=2, max_len=8, num_kv_heads=1, head_dim=4, dtype=torch.float32,
                    device="cpu")
    # row 0: 3 prompt tokens at positions 0..2, row 1: one decode token at position 4 (0..3 already cached)
    batch = StepBatch.build([(1, [5, 6, 7], 0), (0, [9], 4)], "cpu")
    k = torch.randn(4, 1, 4)
    v = torch.randn(4, 1, 4)
    cache.keys[0][0, :4] = torch.randn(4, 1, 4)
    cache.values[0][0, :4] = torch.randn(4, 1, 4)
    cache.write(0, batch.slots[batch.token_row], batch.positions, k, v)
    q = torch.randn(4, 2, 4)                                          # 2 query heads share 1 KV head
    keys, values = cache.read(0, batch.slots, int(batch.kv_lens.max()))
    out = attend(q, keys, values, batch, 0.5)
    for t, (slot, pos) in enumerate([(1, 0), (1, 1), (1, 2), (0, 4)]):
        kk, vv = cache.keys[0][slot, :pos + 1, 0], cache.values[0][slot, :pos + 1, 0]
        for h in range(2):
            ref = torch.softmax(q[t, h] @ kk.T * 0.5, -1) @ vv
            assert torch.allclose(out[t, h * 4:(h + 1) * 4], ref, atol=1e-6)


def test_attend_in_query_chunks_is_the_same_attention(monkeypatch):
    """A long prefill goes through its query columns in chunks (SCORE_BYTES); the result is the one-shot one."""
    import megatron_qrl.rollout.attention as attention_mod
    g = torch.Generator().manual_seed(1)
    cache = KVCache(num_layers=1, max_slots=3, max_len=40, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                    device="cpu")
    batch = StepBatch.build([(2, list(range(23)), 0), (0, [1], 30), (1, list(range(9)), 5)], "cpu")
    cache.keys[0].copy_(torch.randn(cache.keys[0].shape, generator=g))
    cache.values[0].copy_(torch.randn(cache.values[0].shape, generator=g))
    q = torch.randn(batch.num_tokens, 4, 8, generator=g)
    keys, values = cache.read(0, batch.slots, int(batch.kv_lens.max()))
    whole = attend(q, keys, values, batch, 0.3)
    B, L, H = 3, keys.shape[1], 4
    monkeypatch.setattr(attention_mod, "SCORE_BYTES", B * H * L * 4 * 5)         # 5 query columns per chunk
    chunked = attend(q, keys, values, batch, 0.3)
    assert torch.allclose(chunked, whole, rtol=0, atol=1e-6) and torch.isfinite(chunked).all()
    monkeypatch.setattr(attention_mod, "SCORE_BYTES", 1)                         # one column at a time
    assert torch.allclose(attend(q, keys, values, batch, 0.3), whole, rtol=0, atol=1e-6)


def test_scheduler_admits_as_sequences_finish():
    cache = KVCache(num_layers=1, max_slots=2, max_len=16, num_kv_heads=1, head_dim=4, dtype=torch.float32,
                    device="cpu")
    sched = ContinuousBatchScheduler(cache, max_batch_size=2, max_tokens_per_step=3)
    params = [SamplingParams(max_new_tokens=n) for n in (1, 3, 2)]
    seqs = [Sequence(i, [1] * (4 + i), p, sequence_generator(0, i)) for i, p in enumerate(params)]
    for s in seqs:
        sched.submit(s)
    steps = []
    while sched.has_work():
        plan = sched.plan()
        assert len(plan.sequences) <= 2 and sum(len(f) for f in plan.feeds) <= 3
        steps.append([s.index for s in plan.sequences])
        for s, feed, samples in zip(plan.sequences, plan.feeds, plan.samples):
            s.num_cached += len(feed)
            if samples:
                s.accept(0, 0.0)
        sched.retire_finished()
    assert all(s.finished and s.finish_reason == "length" for s in seqs)
    assert [len(s.tokens) for s in seqs] == [1, 3, 2]
    assert 2 in steps[-1] and sorted(cache.free_slots) == [0, 1]   # seq 2 got a slot once seq 0 finished
    assert steps[0] == [0] and steps[1] == [0, 1]                  # chunked prefill under the 3-token budget


def test_rollout_sample_positions():
    ids = torch.arange(4 * 2 * 2, dtype=torch.int16).reshape(4, 2, 2)
    s = RolloutSample(prompt_ids=[1, 2, 3], tokens=[4, 5], logprobs=torch.zeros(2), finish_reason="length",
                      routed_experts=ids)
    assert s.num_forwarded == 4 and s.sequence == [1, 2, 3, 4, 5]
    padded = s.routed_experts_padded(7)
    assert padded.shape == (7, 2, 2) and padded.dtype == torch.long
    assert torch.equal(padded[:4], ids.long()) and torch.equal(padded[6], ids[3].long())
    with pytest.raises(ValueError, match="shorter"):
        s.routed_experts_padded(3)
