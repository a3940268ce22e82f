"""2-rank gloo checks of TRACE transport (launched by tests/test_trace_transport.py through torchrun).

(a) disaggregated: rank 0 is the engine, rank 1 the trainer; the received cache equals the sent one.
(b) EP=2 (and DP=2): each rank's engine produced its own samples; after the exchange each rank holds
    only its experts (for all samples of its EP group) and the dense sites of its own samples; the union
    of what the ranks hold is the full cache.
(c) TP=2: a row-parallel site arrives as each rank's K-slice, and guided rounding on the shard equals
    the matching slice of the full guided rounding.
"""
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

from megatron_qrl.trace import (GuideProvider, ShardSpec, TraceCache, TraceCacheBuilder, TraceMetrics,
                                exchange, gather_specs, guided_quant_dequant, lookup, recv_cache, select,
                                send_cache)
from megatron_qrl.trace.synthetic import make_rollout

NUM_SAMPLES = 6


def rollout():
    return make_rollout(num_samples=NUM_SAMPLES, seq_len=12, prompt_len=5, layers=(1, 2),
                        routed_sites={"fc1": 64, "fc2": 64}, dense_sites={"qkv": 32, "proj": 64},
                        num_experts=4, topk=2, seed=11)


def case_disaggregated(rank, ro, full):
    metrics = TraceMetrics()
    got = exchange(full if rank == 0 else None, {1: ShardSpec()}, metrics=metrics)
    if rank == 0:
        assert got is None
        assert metrics.counters["bytes_sent"] == full.nbytes
    else:
        assert got is not None and got.same_content(full), "received cache differs from the sent one"
        assert got.checksum == full.checksum
        m = metrics.as_dict()
        assert m["trace/cache_bytes"] == full.nbytes and m["trace/transfer_s"] > 0


def case_expert_parallel(rank, ro, full):
    # each rank's engine generated the samples of its data-parallel rank
    spec = ShardSpec.for_rank(NUM_SAMPLES, dp_rank=rank, dp_size=2, num_experts=ro.num_experts, ep_size=2)
    specs = gather_specs(spec)
    assert specs == {0: ShardSpec.for_rank(NUM_SAMPLES, dp_rank=0, dp_size=2, num_experts=4, ep_size=2),
                     1: ShardSpec.for_rank(NUM_SAMPLES, dp_rank=1, dp_size=2, num_experts=4, ep_size=2)}
    own = set(spec.samples)
    engine = TraceCacheBuilder(0, 0, "synthetic")
    for s in sorted(own):
        engine.add_sample(s, ro.captures[s], routed_experts=ro.routed[s])
    got = exchange(engine.build(), specs)
    assert got.same_content(select(full, spec))
    owned = {0: {0, 1}, 1: {2, 3}}[rank]
    routed = [k for k in got.keys() if k.routed]
    assert routed and {k.expert for k in routed} == owned, f"rank {rank} got experts {sorted({k.expert for k in routed})}"
    samples, _ = got.tokens()
    for key in got.keys():
        rows = samples[got.rowset_tokens(got.entry(key).rowset)]
        expect = set(range(NUM_SAMPLES)) if key.routed else own
        assert set(rows.tolist()) <= expect
    # union over ranks == full cache
    if rank == 1:
        send_cache(got, 0)
    else:
        union = TraceCache.merge([got, recv_cache(1)])
        assert union.same_content(full), "the union of the EP shards is not the full cache"


def case_tensor_parallel(rank, ro, full):
    # rank 0 is the engine and both ranks train; row-parallel sites (fc2, proj) are K-sharded by TP/ETP
    specs = {r: ShardSpec(tp_rank=r, tp_size=2, etp_rank=r, etp_size=2) for r in (0, 1)}
    got = exchange(full if rank == 0 else None, specs)
    g = torch.Generator().manual_seed(5)
    checked = 0
    for key in full.keys():
        e_full, e_got = full.entry(key), got.entry(key)
        sliced = key.site in ("fc2", "proj")
        K = e_full.k_full
        k0, k1 = (rank * K // 2, (rank + 1) * K // 2) if sliced else (0, K)
        assert (e_got.k_start, e_got.k_width) == (k0, k1 - k0), (key, e_got.k_start, e_got.k_width)
        if not sliced or checked >= 6:
            continue
        # rows in a shuffled order; trainer activations = rollout activations + 1% noise
        x_all = ro.x[(key.layer, key.site)]
        if key.routed:
            idx = torch.nonzero(ro.routed[:, :, key.layer, :] == key.expert)
            x = x_all[idx[:, 0], idx[:, 1], idx[:, 2]]
        else:
            idx = torch.nonzero(torch.ones(x_all.shape[:2]))
            x = x_all[idx[:, 0], idx[:, 1]]
        perm = torch.randperm(idx.shape[0], generator=g)
        idx, x = idx[perm], x[perm] * (1 + 0.01 * torch.randn(x.shape, generator=g))
        full_deq = guided_quant_dequant(x, lookup(full, key, idx[:, 0], idx[:, 1]))
        shard_guide = lookup(got, key, idx[:, 0], idx[:, 1], k_range=(k0, k1))
        shard_deq = guided_quant_dequant(x[:, k0:k1], shard_guide)
        assert torch.equal(shard_deq, full_deq[:, k0:k1]), f"{key.site_name}: shard replay != slice of full replay"
        # the same through the model's provider hook (site.k_offset = this rank's K offset)
        site = SimpleNamespace(layer=key.layer, role=key.site, expert=key.expert if key.routed else None,
                               k_offset=k0)
        provider = GuideProvider(got, lambda s, xx: (idx[:, 0], idx[:, 1]))
        via_provider = guided_quant_dequant(x[:, k0:k1], provider(site, x[:, k0:k1]))
        assert torch.equal(via_provider, shard_deq)
        checked += 1
    assert checked >= 4


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ro = rollout()
    full = ro.build()
    for case in (case_disaggregated, case_expert_parallel, case_tensor_parallel):
        case(rank, ro, full)
        dist.barrier()
        print(f"rank {rank}: {case.__name__} ok", flush=True)
    dist.destroy_process_group()
    print(f"TRACE DIST OK rank {rank}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
