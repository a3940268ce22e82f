"""TRACE cache: format, size, checksum, integrity, lookup alignment and guided replay."""
import random
from types import SimpleNamespace

import pytest
import torch

from megatron_qrl.quant import fake_quant, nvfp4_dequantize, nvfp4_quantize, quant_dequant
from megatron_qrl.quant.nvfp4 import nvfp4_global_scale
from megatron_qrl.trace import (CorruptCacheError, EntryCut, EntryKey, GuideProvider, MicroBatchGuides,
                                MisshapenCacheError, StaleCacheError, TraceCache, TraceCacheBuilder, TraceCacheError,
                                TraceLookupError, TraceMetrics, accept, guided_codes, guided_fake_quant,
                                guided_quant_dequant, lookup, mismatch_counts, routed_rows, sequence_major_rows,
                                validate)
from megatron_qrl.trace.synthetic import make_rollout

from one_thread import one_intra_op_thread  # noqa: F401 (an autouse fixture)


@pytest.fixture(scope="module")
def ro():
    return make_rollout(num_samples=8, seq_len=16, prompt_len=6, layers=(2, 3),
                        routed_sites={"fc1": 64, "fc2": 32}, dense_sites={"qkv": 32}, seed=0)


@pytest.fixture(scope="module")
def cache(ro):
    return ro.build(weight_version=4, step=9, fingerprint="fp")


def _rows_of(ro, key):
    """(index [rows, 2 or 3], x rows, engine codes) of every token that reached `key` in the rollout."""
    x, codes = ro.x[(key.layer, key.site)], ro.codes[(key.layer, key.site)]
    if key.routed:
        idx = torch.nonzero(ro.routed[:, :, key.layer, :] == key.expert)
        return idx, x[idx[:, 0], idx[:, 1], idx[:, 2]], codes[idx[:, 0], idx[:, 1], idx[:, 2]]
    idx = torch.nonzero(torch.ones(x.shape[:2]))
    return idx, x[idx[:, 0], idx[:, 1]], codes[idx[:, 0], idx[:, 1]]


def test_entry_key_names_match_the_model_sites():
    assert EntryKey(3, "fc1", 17).site_name == "L3.fc1.E17" and EntryKey(0, "qkv").site_name == "L0.qkv"
    for name in ("L3.fc1.E17", "L0.qkv", "L12.shared_fc2"):
        assert EntryKey.from_site_name(name).site_name == name
    assert EntryKey.from_site(SimpleNamespace(layer=2, role="fc2", expert=None)) == EntryKey(2, "fc2", -1)
    assert EntryKey(1, "fc1", 0).shape_key == "expert.fc1" and EntryKey(1, "qkv").shape_key == "qkv"


def test_cache_holds_every_captured_row(ro, cache):
    routed = [k for k in cache.keys() if k.routed]
    assert {k.expert for k in routed} == set(range(ro.num_experts))
    assert cache.n_tokens == ro.num_samples * ro.seq_len
    expected = sum(x.numel() for x in ro.x.values())
    assert cache.elements == expected
    # fc1 and fc2 of one expert share one row set
    assert cache.entry(EntryKey(2, "fc1", 3)).rowset == cache.entry(EntryKey(2, "fc2", 3)).rowset
    # global scales: one per engine call (prefill + one per decode step) that routed rows there
    e = cache.entry(EntryKey(2, "fc1", 3))
    assert 1 < e.gs_table.numel() <= 1 + ro.seq_len - ro.prompt_len + 1


def test_round_trip_serialization(cache):
    blob = cache.to_bytes()
    assert blob.dtype == torch.uint8 and blob.numel() == cache.nbytes
    back = TraceCache.from_bytes(blob)
    assert back.same_content(cache) and back.checksum == cache.checksum
    assert back.compute_checksum() == cache.checksum
    assert torch.equal(back.to_bytes(), blob)
    # payload tensors are zero-copy views into the buffer
    e = back.entry(EntryKey(3, "fc2", 1))
    assert blob.data_ptr() <= e.bits.data_ptr() < blob.data_ptr() + blob.numel()
    assert TraceCache.from_bytes(bytes(blob.numpy())).same_content(cache)


def test_checksum_detects_any_flipped_byte(cache):
    blob = cache.to_bytes()
    rng = random.Random(0)
    positions = [0, 9, 13, 17, 30, blob.numel() // 2, blob.numel() - 1] + rng.sample(range(blob.numel()), 40)
    for pos in positions:
        bad = blob.clone()
        bad[pos] ^= 1 << rng.randrange(8)
        with pytest.raises(CorruptCacheError):
            TraceCache.from_bytes(bad)
    # decoded without verification, validate() still catches it from the content
    bad = blob.clone()
    bad[-1] ^= 0x10
    decoded = TraceCache.from_bytes(bad, verify=False)
    with pytest.raises(CorruptCacheError, match="checksum"):
        validate(decoded, 4, 9)
    with pytest.raises(CorruptCacheError, match="truncated"):
        TraceCache.from_bytes(blob[:-3], verify=False)


def test_stale_caches_are_rejected(cache):
    assert validate(cache, 4, 9, expected_fingerprint="fp") is cache
    with pytest.raises(StaleCacheError, match="version 4"):
        validate(cache, 5, 9)
    with pytest.raises(StaleCacheError, match="step 9"):
        validate(cache, 4, 10)
    with pytest.raises(StaleCacheError, match="fingerprint"):
        validate(cache, 4, 9, expected_fingerprint="other")
    metrics = TraceMetrics()
    assert accept(cache, 5, 9, metrics) is None and accept(None, 4, 9, metrics) is None
    assert accept(cache, 4, 9, metrics) is cache
    assert metrics.as_dict()["trace/rejected"] == 1


def test_misshapen_caches_are_rejected(cache):
    widths = {"expert.fc1": 64, "expert.fc2": 32, "qkv": 32}
    assert validate(cache, 4, 9, expected_shapes=widths, expected_layers=[2, 3]) is cache
    with pytest.raises(MisshapenCacheError, match="K=32"):
        validate(cache, 4, 9, expected_shapes={**widths, "expert.fc2": 48})
    with pytest.raises(MisshapenCacheError, match="qkv"):
        validate(cache, 4, 9, expected_shapes={"expert.fc1": 64, "expert.fc2": 32})
    with pytest.raises(MisshapenCacheError, match="layer 2"):
        validate(cache, 4, 9, expected_layers=[3])
    # an internally inconsistent cache (a row dropped from one entry), correctly checksummed
    key = EntryKey(2, "fc1", 0)
    e = cache.entry(key)
    broken = TraceCache(weight_version=4, step=9, fingerprint="fp", token_runs=cache.token_runs,
                        rowsets=cache.rowsets, entries={**cache.entries, key: type(e)(
                            e.rowset, e.bits[1:], e.scales[1:], e.gs_table, e.gs_index, e.k_start, e.k_full)})
    broken.seal()
    with pytest.raises(MisshapenCacheError, match="rows"):
        validate(broken, 4, 9)
    assert issubclass(MisshapenCacheError, TraceCacheError) and issubclass(CorruptCacheError, TraceCacheError)


@pytest.mark.parametrize("K", [128, 512, 2048])
def test_bits_per_element_near_one_and_a_half(K):
    ro = make_rollout(num_samples=16, seq_len=48, prompt_len=16, layers=(1,), routed_sites={"fc1": K, "fc2": K},
                      num_experts=8, topk=2, seed=K)
    cache = ro.build()
    bpe = cache.bits_per_element()
    assert 1.5 <= bpe <= 1.5 * 1.10, bpe
    payload = sum(e.rows * e.k_width * 1.5 / 8 for e in cache.entries.values())
    assert cache.nbytes >= payload


def test_lookup_in_shuffled_order_replays_the_engine_codes(ro, cache):
    g = torch.Generator().manual_seed(1)
    for key in cache.keys():
        idx, x, codes = _rows_of(ro, key)
        perm = torch.randperm(idx.shape[0], generator=g)
        guide = lookup(cache, key, idx[perm, 0], idx[perm, 1])
        assert guide.all_found and guide.bits.shape == (idx.shape[0], x.shape[-1] // 8)
        got, fallback = guided_codes(x[perm], guide)
        assert torch.equal(got, codes[perm]), key.site_name
        assert not fallback.any()


def test_trainer_noise_one_codeword_mismatches_removed(ro, cache):
    key = EntryKey(3, "fc1", 2)
    idx, x, codes = _rows_of(ro, key)
    g = torch.Generator().manual_seed(2)
    noisy = x * (1 + 0.01 * torch.randn(x.shape, generator=g))
    guide = lookup(cache, key, idx[:, 0], idx[:, 1])
    counts = mismatch_counts(noisy, guide)
    assert counts["elements"] == x.numel() and counts["before"] > 0 and counts["after"] == 0
    metrics = TraceMetrics()
    metrics.add_mismatch(noisy, guide)
    m = metrics.as_dict()
    assert m["trace/code_mismatch_before"] > 0.01 and m["trace/code_mismatch_after"] == 0
    # guided codes equal the engine's codes on every element the noise kept within one codeword
    got, _ = guided_codes(noisy, guide)
    assert (got != codes).float().mean() < 1e-3


def test_per_row_replay_matches_the_codec(ro, cache):
    key = EntryKey(2, "fc2", 5)
    idx, x, _ = _rows_of(ro, key)
    guide = lookup(cache, key, idx[:, 0], idx[:, 1])
    assert guide.global_scale.shape == (idx.shape[0], 1)  # rows from several engine calls
    out = guided_quant_dequant(x, guide)
    for r in range(x.shape[0]):
        one = type(guide)(guide.bits[r:r + 1], guide.scales[r:r + 1], guide.row_global_scales[r])
        assert torch.equal(out[r:r + 1], quant_dequant(x[r:r + 1], guide=one))
    # one shared scale: identical to the codec's fake_quant
    prefill = (idx[:, 1] < ro.prompt_len).nonzero().reshape(-1)
    g1 = lookup(cache, key, idx[prefill, 0], idx[prefill, 1])
    assert g1.global_scale.dim() == 0
    xr = x[prefill].clone().requires_grad_(True)
    y = guided_fake_quant(xr, g1)
    assert torch.equal(y, fake_quant(x[prefill], guide=g1))
    y.sum().backward()
    assert torch.equal(xr.grad, torch.ones_like(xr))


def test_missing_rows_get_the_trainers_nearest_rounding(ro, cache):
    key = EntryKey(2, "qkv")
    idx, x, codes = _rows_of(ro, key)
    samples = torch.cat([idx[:5, 0], torch.tensor([0, -1, 3])])
    positions = torch.cat([idx[:5, 1], torch.tensor([ro.seq_len, 0, 10 ** 6])])
    xq = torch.cat([x[:5], torch.randn(3, x.shape[-1])])
    guide = lookup(cache, key, samples, positions)
    assert guide.found.tolist() == [True] * 5 + [False] * 3 and guide.global_scale is None
    done = guide.complete_with_nearest(xq)
    assert done.all_found
    with pytest.raises(ValueError, match="complete_with_nearest"):
        guided_quant_dequant(xq, guide)
    out = guided_quant_dequant(xq, done)
    assert torch.equal(guided_codes(xq[:5], lookup(cache, key, samples[:5], positions[:5]))[0], codes[:5])
    assert torch.equal(out[:5], guided_quant_dequant(xq[:5], lookup(cache, key, samples[:5], positions[:5])))
    gs = nvfp4_global_scale(xq)
    packed, sc, _ = nvfp4_quantize(xq[5:], gs)
    assert torch.equal(out[5:], nvfp4_dequantize(packed, sc, gs, dtype=xq.dtype))


def test_lookup_errors_are_typed(cache):
    with pytest.raises(TraceLookupError, match="L0.fc1.E0"):
        lookup(cache, EntryKey(0, "fc1", 0), [0], [0])
    with pytest.raises(TraceLookupError, match="columns"):
        lookup(cache, EntryKey(2, "fc1", 0), [0], [0], k_range=(8, 24))


def test_megatron_row_orders():
    samples, positions = sequence_major_rows(torch.tensor([7, 3]), seq_len=3, seq_offset=4)
    assert samples.tolist() == [7, 3, 7, 3, 7, 3] and positions.tolist() == [4, 4, 5, 5, 6, 6]
    topk = torch.tensor([[0, 1], [2, 0], [1, 2], [0, 2], [1, 0], [2, 1]])
    s, p = routed_rows(samples, positions, topk, expert=0)
    assert list(zip(s.tolist(), p.tolist())) == [(7, 4), (3, 4), (3, 5), (7, 6)]


def test_guide_provider_aligns_a_dense_site(ro, cache):
    key = EntryKey(3, "qkv")
    x_all, codes_all = ro.x[(3, "qkv")], ro.codes[(3, "qkv")]       # [S, N, K]
    mb = torch.tensor([5, 1, 6])
    x = x_all[mb].transpose(0, 1).contiguous()                      # Megatron's [s, b, K]
    metrics = TraceMetrics()
    provider = GuideProvider(cache, lambda site, xx: sequence_major_rows(mb, xx.shape[0]), metrics)
    site = SimpleNamespace(layer=3, role="qkv", expert=None, k_offset=0)
    guide = provider(site, x)
    assert guide.bits.shape == (*x.shape[:2], x.shape[-1] // 8)
    codes, _ = guided_codes(x, guide)
    assert torch.equal(codes, codes_all[mb].transpose(0, 1))
    assert provider(SimpleNamespace(layer=0, role="qkv", expert=None, k_offset=0), x) is None
    assert metrics.counters["guided_rows"] == x.shape[0] * x.shape[1]
    # a row count that disagrees with x is refused, not misaligned
    bad = GuideProvider(cache, lambda site, xx: sequence_major_rows(mb[:2], xx.shape[0]), metrics)
    assert bad(site, x) is None and metrics.counters["misaligned_sites"] == 1


def test_subset_and_merge_round_trip(ro, cache):
    samples, _ = cache.tokens()
    first = samples < 3
    a = cache.subset(lambda k, e: EntryCut(first))
    b = cache.subset(lambda k, e: EntryCut(~first))
    assert set(a.tokens()[0].tolist()) == {0, 1, 2}
    assert TraceCache.merge([b, a]).same_content(cache)
    sliced = cache.subset(lambda k, e: EntryCut(None, (16, 32)) if k.site == "fc2" else None)
    key = EntryKey(2, "fc2", 1)
    assert torch.equal(sliced.entry(key).bits, cache.entry(key).bits[:, 2:4])
    assert torch.equal(sliced.entry(key).scales, cache.entry(key).scales[:, 1:2])
    assert (sliced.entry(key).k_start, sliced.entry(key).k_full) == (16, 32)
    with pytest.raises(StaleCacheError):
        TraceCache.merge([a, ro.build(weight_version=5, step=9, fingerprint="fp")])


def test_builder_rejects_bad_rows():
    b = TraceCacheBuilder(0, 0)
    x = torch.randn(4, 32)
    packed, scales, gs, bits = nvfp4_quantize(x, capture=True)
    b.add_rows(0, "fc1", 2, 0, torch.arange(4), bits, scales, gs)
    b.add_rows(0, "fc1", 2, 0, torch.tensor([3]), bits[:1], scales[:1], gs)
    with pytest.raises(MisshapenCacheError, match="recorded twice"):
        b.build()
    with pytest.raises(MisshapenCacheError, match="scales"):
        b.add_rows(0, "fc1", 2, 0, torch.arange(4), bits, scales[:, :1], gs)
    nan = TraceCacheBuilder(0, 0)     # global scales are checked once per site at build (no sync per row set)
    nan.add_rows(0, "fc1", 2, 0, torch.arange(4), bits, scales, torch.tensor(float("nan")))
    with pytest.raises(MisshapenCacheError, match="global scales"):
        nan.build()
    with pytest.raises(MisshapenCacheError, match="routed_experts"):
        TraceCacheBuilder(0, 0).add_sample(0, {1: {"fc1": SimpleNamespace(
            format="nvfp4", bits=bits.reshape(2, 2, -1), scales=scales.reshape(2, 2, -1), global_scale=gs)}})


@pytest.mark.parametrize("tp_rank,sequence_parallel", [(0, False), (1, True)])
def test_micro_batch_guides_follow_megatron_row_order(ro, cache, tp_rank, sequence_parallel):
    mb = torch.tensor([5, 1, 6, -1])                 # -1: a padding sample (reuses sample 0's routing)
    T = ro.seq_len + 2                               # trainer-padded length: positions past N are not cached
    guides = MicroBatchGuides(cache, T, ro.routed, tp_rank=tp_rank, tp_size=2, sequence_parallel=sequence_parallel)
    provider = guides(mb)
    s_local = T // 2 if sequence_parallel else T
    off = tp_rank * s_local if sequence_parallel else 0
    safe = mb.clamp(min=0)
    pos = torch.arange(off, off + s_local).clamp(max=ro.seq_len - 1)
    # dense (column-parallel) site: x [s_local, b, K]
    xd = ro.x[(3, "qkv")][safe][:, pos].transpose(0, 1).contiguous()
    cd = ro.codes[(3, "qkv")][safe][:, pos].transpose(0, 1)
    metrics = TraceMetrics()
    provider.metrics = metrics
    guide = provider(SimpleNamespace(layer=3, role="qkv", expert=None, k_offset=0), xd)
    real = (torch.arange(off, off + s_local) < ro.seq_len).view(-1, 1) & (mb >= 0).view(1, -1)
    assert metrics.counters["guided_rows"] == int(real.sum())
    assert metrics.counters["missing_rows"] == int((~real).sum())
    codes, _ = guided_codes(xd, guide)
    assert torch.equal(codes[real], cd[real])
    # routed expert: the tokens of this shard routed to it, ascending in [s, b] order
    layer, expert = 2, 1
    ids = ro.routed[safe][:, pos, layer].transpose(0, 1)            # [s, b, k]
    tok_s, tok_b, slot = torch.nonzero(ids == expert, as_tuple=True)
    xe = ro.x[(layer, "fc1")][safe[tok_b], pos[tok_s], slot]
    ce = ro.codes[(layer, "fc1")][safe[tok_b], pos[tok_s], slot]
    guide = provider(SimpleNamespace(layer=layer, role="fc1", expert=expert, k_offset=0), xe)
    ok = real[tok_s, tok_b]
    assert metrics.counters["guided_rows"] == int(real.sum()) + int(ok.sum())
    codes, _ = guided_codes(xe, guide)
    assert torch.equal(codes[ok], ce[ok])


def test_build_orders_rows_and_tables_global_scales_per_entry():
    """Rows of several steps per expert, each step with its own global scale: every entry holds its rows in
    token order, its distinct scales ascending, and each row maps back to the scale it was added with."""
    g = torch.Generator().manual_seed(3)
    b = TraceCacheBuilder(0, 0)
    added = {}                       # (expert, sample, position) -> (bits row, global scale)
    for step in range(5):
        experts = torch.randint(0, 4, (6,), generator=g)
        x = torch.randn(6, 32, generator=g) * (step + 1)
        _, scales, _, bits = nvfp4_quantize(x, capture=True)
        gs = torch.rand(6, generator=g) + 0.5
        gs[::2] = gs[0]                                      # repeats inside an entry
        samples = torch.randperm(6, generator=g)               # one row per (sample, step)
        b.add_rows(1, "fc1", experts, samples, torch.full((6,), step), bits, scales, gs)
        for i in range(6):
            added[(int(experts[i]), int(samples[i]), step)] = (bits[i], float(gs[i]))
    cache = b.build()
    samples, positions = cache.tokens()
    for key, e in cache.entries.items():
        toks = cache.rowset_tokens(e.rowset)
        want = sorted(k for k in added if k[0] == key.expert)
        assert [(key.expert, int(samples[t]), int(positions[t])) for t in toks] == want
        assert torch.equal(e.bits, torch.stack([added[k][0] for k in want]))
        assert torch.equal(e.gs_table, torch.unique(torch.tensor([added[k][1] for k in want])))
        assert torch.equal(e.row_global_scales(), torch.tensor([added[k][1] for k in want]))


def test_adding_samples_together_builds_the_cache_of_adding_them_one_by_one(ro):
    """The recorder's batched add (one add_rows per site) and the per-sample add give the same cache bytes,
    routed and dense sites alike, also for sample ids that skip (a batch position without a kept sample)."""
    positions = [0, 2, 3, 5, 6, 7, 9, 12]
    one = TraceCacheBuilder(4, 9, "fp")
    for p, s in zip(positions, range(ro.num_samples)):
        one.add_sample(p, ro.captures[s], routed_experts=ro.routed[s])
    together = TraceCacheBuilder(4, 9, "fp")
    together.add_samples(positions, [ro.captures[s] for s in range(ro.num_samples)], list(ro.routed))
    a, b = one.build(), together.build()
    assert a.checksum == b.checksum and torch.equal(a.to_bytes(), b.to_bytes())
    assert {k.site for k in a.entries} == {"fc1", "fc2", "qkv"}
