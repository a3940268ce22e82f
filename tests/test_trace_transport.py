"""TRACE transport: shard specs (DP/EP/TP/PP) locally, and two gloo ranks through torchrun."""
from pathlib import Path

import pytest
import torch

from megatron_qrl.trace import (EntryKey, ShardSpec, TraceCache, TraceMetrics, dp_samples, local_shard,
                                megatron_ep_group, select)
from megatron_qrl.trace.synthetic import make_rollout

from launch_ranks import run_ranks
from one_thread import one_intra_op_thread  # noqa: F401 (an autouse fixture)

SCRIPT = Path(__file__).parent / "dist" / "trace_transport.py"


@pytest.fixture(scope="module")
def ro():
    return make_rollout(num_samples=6, seq_len=10, prompt_len=4, layers=(0, 1, 2, 3),
                        routed_sites={"fc1": 32, "fc2": 64}, dense_sites={"proj": 32}, num_experts=4, topk=2, seed=3)


@pytest.fixture(scope="module")
def cache(ro):
    return ro.build()


def test_data_parallel_split_matches_the_trainer():
    # trainer.batch.shard_batch: B padded to dp*mbs multiples, rank r takes the contiguous slice r
    assert [list(dp_samples(10, r, 4, 2)) for r in range(4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], []]
    assert [list(dp_samples(6, r, 2)) for r in range(2)] == [[0, 1, 2], [3, 4, 5]]


def test_expert_sources_follow_the_padded_micro_batches():
    """B=10, DP=2, micro-batch 4: rank 1's second micro-batch is all padding, yet its experts still see the
    tokens of rank 0's second micro-batch (samples 4-7), which run at the same time."""
    from megatron_qrl.trace import ExpertSources, rows_per_dp_rank

    assert rows_per_dp_rank(10, 2, 4) == 8
    src = ExpertSources(num_samples=10, rows_per_rank=8, dp_rank=1, group_dp_ranks=(0, 1))
    own = torch.arange(12, 16)                                   # rank 1, micro-batch 1: padded rows 12-15
    assert [t.tolist() for t in src.sample_ids(own)] == [[4, 5, 6, 7], [-1, -1, -1, -1]]
    assert [t.tolist() for t in src.sample_ids(torch.arange(8, 12))] == [[0, 1, 2, 3], [8, 9, -1, -1]]
    rank0 = ExpertSources(num_samples=10, rows_per_rank=8, dp_rank=0, group_dp_ranks=(0, 1))
    assert [t.tolist() for t in rank0.sample_ids(torch.arange(4, 8))] == [[4, 5, 6, 7], [-1, -1, -1, -1]]


def test_megatron_expert_group_order():
    # TP=1: the EP group is ep consecutive DP ranks
    assert megatron_ep_group(dp_rank=3, tp_rank=0, tp_size=1, ep_size=2) == (1, [2, 3])
    # TP=2, ETP=1, EP=4 on 8 ranks (dp=4): ranks 0-3 form one EP group -> DP ranks 0 and 1
    assert megatron_ep_group(dp_rank=1, tp_rank=1, tp_size=2, ep_size=4) == (3, [0, 1])
    # TP=2, ETP=2, EP=2 (dp=2): EP group = ranks {0, 2} -> DP ranks 0 and 1
    assert megatron_ep_group(dp_rank=1, tp_rank=0, tp_size=2, ep_size=2, etp_size=2) == (1, [0, 1])


def test_shard_specs_partition_the_cache(cache):
    specs = [ShardSpec.for_rank(6, dp_rank=r, dp_size=2, num_experts=4, ep_size=2, layers=(0, 2) if r else (2, 4))
             for r in range(2)]
    assert specs[0].experts == (0, 1) and specs[1].experts == (2, 3) and specs[0].expert_samples == tuple(range(6))
    parts = [select(cache, s) for s in specs]
    assert {k.layer for k in parts[0].keys()} == {2, 3} and {k.layer for k in parts[1].keys()} == {0, 1}
    assert {k.expert for k in parts[0].keys() if k.routed} == {0, 1}
    assert set(parts[0].tokens()[0][parts[0].rowset_tokens(parts[0].entry(EntryKey(2, "proj")).rowset)].tolist()) \
        == {0, 1, 2}
    assert ShardSpec.from_json(specs[0].to_json()) == specs[0]
    # the four (dp, pp) quarters of a 2x2 layout cover the full cache exactly once
    quarters = [select(cache, ShardSpec(samples=s, expert_samples=s, layers=l))
                for s in ((0, 1, 2), (3, 4, 5)) for l in ((0, 2), (2, 4))]
    assert TraceCache.merge(quarters).same_content(cache)


def test_tensor_parallel_slices_only_row_parallel_sites(cache):
    spec = ShardSpec(tp_rank=1, tp_size=2, etp_rank=1, etp_size=2)
    part = select(cache, spec)
    for key in cache.keys():
        e = part.entry(key)
        if key.site in ("fc2", "proj"):
            K = e.k_full
            assert (e.k_start, e.k_width) == (K // 2, K // 2)
            full = cache.entry(key)
            assert torch.equal(e.bits, full.bits[:, K // 16:]) and torch.equal(e.scales, full.scales[:, K // 32:])
        else:
            assert (e.k_start, e.k_width) == (0, e.k_full)


def test_colocated_mode_slices_locally(cache):
    metrics = TraceMetrics()
    spec = ShardSpec(samples=[1, 2], expert_samples=[1, 2])
    part = local_shard(cache, spec, metrics)
    assert part.same_content(select(cache, spec)) and set(part.tokens()[0].tolist()) == {1, 2}
    assert metrics.as_dict()["trace/cache_bytes"] == part.nbytes


def test_select_returns_the_cache_itself_when_the_spec_keeps_everything(cache):
    """One trainer rank (the single-GPU case) needs the whole cache: no rebuild, no re-hash."""
    covering = dict(samples=range(10), expert_samples=range(6), experts=range(4), layers=(0, 4))
    whole = [ShardSpec(), ShardSpec.for_rank(6), ShardSpec.for_rank(6, micro_batch_size=4, num_experts=4),
             ShardSpec(**covering)]
    for spec in whole:
        assert spec.keeps_whole(cache) and select(cache, spec) is cache
        assert local_shard(cache, spec) is cache
    partial = [ShardSpec(**covering, tp_rank=1, tp_size=2),      # the row-parallel proj is K-sliced
               ShardSpec(samples=[0, 1, 2]), ShardSpec(expert_samples=[5]), ShardSpec(layers=(0, 2)),
               ShardSpec(experts=[1]), ShardSpec(etp_rank=0, etp_size=2)]
    for spec in partial:
        part = select(cache, spec)
        assert not spec.keeps_whole(cache) and part is not cache and part.elements < cache.elements, spec
        assert part.checksum == part.compute_checksum()


def test_two_gloo_ranks_disaggregated_ep_and_tp():
    out = run_ranks(2, SCRIPT, timeout=180)
    for rank in (0, 1):
        for case in ("case_disaggregated", "case_expert_parallel", "case_tensor_parallel"):
            assert f"rank {rank}: {case} ok" in out
        assert f"TRACE DIST OK rank {rank}" in out
