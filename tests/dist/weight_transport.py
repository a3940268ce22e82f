"""3-rank gloo check of the bucketed weight broadcast (launched by tests/test_weight_transport.py).

Rank 0 sends a payload dict of FP4 and plain tensors (0-dim, empty, odd sizes, a part larger than a bucket)
to ranks 1 and 2; every receiver must rebuild exactly the sent bytes, dtypes and shapes, and the payloads
must pass the engine's digest check. Then all_gather_tensors (expert shards of different sizes per rank,
one rank with none): every rank ends with every rank's tensors, bit for bit.
"""
import torch
import torch.distributed as dist

from megatron_qrl.pipeline.wire import broadcast_object
from megatron_qrl.pipeline.weight_transport import all_gather_tensors, manifest, receive_weights, send_weights
from megatron_qrl.quant import FP4Tensor, pack_weight, payload_digest
from megatron_qrl.rollout.weights import digest_problem


def payload():
    g = torch.Generator().manual_seed(5)
    return {
        "a.fp4": pack_weight(torch.randn(48, 64, generator=g), "nvfp4"),
        "b.mx": pack_weight(torch.randn(8, 96, generator=g), "mxfp4"),
        "c.norm": torch.randn(13, generator=g),
        "d.bf16": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "e.scalar": torch.tensor(3.25),
        "f.empty": torch.zeros(0, 4),
        "g.big": torch.randn(600, generator=g),         # 2400 B: larger than the 1 KiB buckets below
        "h.int": torch.arange(9, dtype=torch.int16),
    }


def same(a, b) -> bool:
    if isinstance(a, FP4Tensor):
        return (isinstance(b, FP4Tensor) and a.format == b.format and len(a.parts()) == len(b.parts())
                and all(same(x, y) for x, y in zip(a.parts(), b.parts())))
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    sent = payload()
    hashes = {n: payload_digest(w) for n, w in sent.items()}
    spec = manifest(sent, bucket_bytes=1024) if rank == 0 else None
    spec = broadcast_object(spec, src=0)
    assert len({p[2] for e in spec for p in e["parts"]}) > 2, "the test must span several buckets"
    if rank == 0:
        nbytes = send_weights(sent, spec, 0, None, torch.device("cpu"))
        assert nbytes >= sum(w.nbytes() if isinstance(w, FP4Tensor) else w.numel() * w.element_size()
                             for w in sent.values())
    else:
        got = receive_weights(spec, 0, None, torch.device("cpu"))
        assert list(got) == list(sent)
        for name in sent:
            assert same(sent[name], got[name]), name
            assert digest_problem(name, got[name], hashes[name]) is None, name
    def shard_of(r):
        g = torch.Generator().manual_seed(100 + r)
        if r == 2:
            return {}
        return {f"experts.{r}.w": torch.randn(3 + r, 8, generator=g).to(torch.bfloat16),
                f"experts.{r}.b": torch.arange(5 * (r + 1), dtype=torch.float32)}
    merged = all_gather_tensors(shard_of(rank), None, torch.device("cpu"))
    expected = {k: v for r in range(dist.get_world_size()) for k, v in shard_of(r).items()}
    assert sorted(merged) == sorted(expected)
    for name in expected:
        assert same(expected[name], merged[name]), name
    dist.barrier()
    print(f"WEIGHT TRANSPORT OK rank {rank}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
