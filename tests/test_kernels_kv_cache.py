"""The packed KV cache's kernels (kernels/kv_quant_write.py, kernels/kv_decode_attention.py) against torch.

- quantize-write: the bytes of kv_layout.store (the torch codec), bit for bit, for bf16 / fp32 rows with
  zeros, -0.0, tiny and huge rows, strided inputs (views of the QKV output), slots out of order;
- decode attention: against a float64 softmax over the dequantized cache; the output is poisoned (NaN) before
  the call and stale positions past each row's length are poisoned (NaN row scales), rows have lengths 1, block multiples and non-multiples, slots come out
  of order and include the scratch slot, GQA groups 4 and 8, the tunables (block_s, num_splits) vary. A bf16
  query runs the float16 path (q scaled to float16 exactly, p in float16): ~1e-3 of the output's norm,
  dominated by the bf16 output rounding; a float32 query runs float32 dots (1e-5);
- the storage: a packed KVCache reads back exactly what the dequantized one holds, in far fewer bytes.
QRL_KERNEL_TESTS_DEVICE=cuda runs the same tests on a GPU (real float16 tensor-core dots, inline-PTX decode,
native fp8 conversion, CUDA-graph replay), with larger shapes.
"""
import os

DEVICE = "cuda" if os.environ.get("QRL_KERNEL_TESTS_DEVICE") == "cuda" else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from megatron_qrl.kernels import kv_layout  # noqa: E402
from megatron_qrl.kernels.kv_decode_attention import (packed_decode_attention,  # noqa: E402
                                                      packed_decode_attention_reference, split_count)
from megatron_qrl.kernels.kv_quant_write import quantize_write  # noqa: E402

GPU = DEVICE == "cuda"
HEAD_DIM = 128 if GPU else 64
MAX_LEN = 1100 if GPU else 200


def _gen(seed=None):
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little") if seed is None else seed)


def _rows(n, heads, dim, g, dtype):
    """n rows of varied magnitude (1e-4 .. 1e3) with an all-zero row, -0.0 entries and a 40x outlier."""
    x = torch.randn(n, heads, dim, generator=g) * torch.logspace(-4, 3, n)[torch.randperm(n, generator=g)][:, None, None]
    x[0, 0] = 0.0
    x[-1, -1, ::5] = -0.0
    x[n // 2, 0, 3] *= 40
    return x.to(dtype).to(DEVICE)


def _cache(fmt, slots, heads, length, dim):
    return kv_layout.PackedKV.zeros(fmt, slots, heads, length, dim, DEVICE)


def _same(a, b):
    return all(torch.equal(x.view(torch.uint8) if x.dtype != torch.float32 else x,
                           y.view(torch.uint8) if y.dtype != torch.float32 else y)
               for x, y in zip(a.tensors(), b.tensors()))


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("dim", [32, 128])
def test_quantize_write_equals_torch_store(fmt, dtype, dim):
    g = _gen()
    B, H, S, L = 6, 2, 5, 9
    mixed = _rows(B, 3 * H, dim, g, dtype)                  # key / value as strided views, like the QKV output
    key, value = mixed[:, 0:H], mixed[:, H:2 * H]
    slots = torch.tensor([4, 0, 2, 3, 1, 4], device=DEVICE)   # out of order; slot 4 twice (the scratch slot)
    positions = torch.tensor([8, 0, 3, 3, 7, 8], device=DEVICE)
    ref = [_cache(fmt, S, H, L, dim) for _ in "kv"]
    out = [_cache(fmt, S, H, L, dim) for _ in "kv"]
    keep = slice(0, 5)   # two writes to (4, 8) race in index_put; compare the single writes
    kv_layout.store(ref[0], slots[keep], positions[keep], key[keep])
    kv_layout.store(ref[1], slots[keep], positions[keep], value[keep])
    quantize_write(key[keep], value[keep], slots[keep], positions[keep], out[0], out[1])
    assert _same(ref[0], out[0]) and _same(ref[1], out[1])
    quantize_write(key, value, slots, positions, out[0], out[1])     # the scratch slot may take several rows
    assert torch.isfinite(out[0].row_scale).all()


def _filled_caches(fmt, heads, g, dtype=torch.float32):
    """K and V of 5 slots (slot 4: the scratch slot) written at every position, with per-row magnitudes."""
    S, L = 5, MAX_LEN
    caches = [_cache(fmt, S, heads, L, HEAD_DIM) for _ in "kv"]
    every_slot, every_pos = torch.arange(S).repeat_interleave(L).to(DEVICE), torch.arange(L).repeat(S).to(DEVICE)
    for c in caches:
        x = torch.randn(S * L, heads, HEAD_DIM, generator=g) * (0.1 + 3 * torch.rand(S * L, heads, 1, generator=g))
        kv_layout.store(c, every_slot, every_pos, x.to(dtype).to(DEVICE))
    return caches


def _poison_past(caches, slots, lens):
    """NaN row scales at every position past each row's length in its slot: read once and the output is NaN."""
    for c in caches:
        for s, n in zip(slots.tolist(), lens.tolist()):
            others = [n2 for s2, n2 in zip(slots.tolist(), lens.tolist()) if s2 == s]
            c.row_scale[s, :, max(others):] = float("nan")


LENS_CPU = [1, 200, 129, 64, 17]
LENS_GPU = [1, 1100, 513, 64, 1000, 255, 2, 777]


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("heads", [(8, 2), (16, 2)] if not GPU else [(32, 8), (32, 4)], ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_packed_attention_matches_reference(fmt, dtype, heads):
    g = _gen()
    hq, hkv = heads
    k, v = _filled_caches(fmt, hkv, g)
    lens_list = LENS_GPU if GPU else LENS_CPU
    slots = torch.tensor([4, 0, 2, 3, 1, 2, 0, 3][:len(lens_list)], device=DEVICE)   # out of order, 4 = scratch
    lens = torch.tensor(lens_list, device=DEVICE)
    _poison_past((k, v), slots, lens)
    q = (torch.randn(len(lens_list), hq, HEAD_DIM, generator=g) * 3).to(dtype).to(DEVICE)
    ref = packed_decode_attention_reference(q, k, v, slots, lens, 0.11, torch.float64)
    tol = 5e-3 if dtype == torch.bfloat16 else 1e-5
    configs = [{}, dict(block_s=16, num_splits=1), dict(block_s=32, num_splits=8)]
    if GPU:
        configs += [dict(block_s=128, num_warps=8, kernel="triton"), dict(block_s=64, num_stages=3, decode="bits",
                    kernel="triton"), dict(decode="pair", kernel="triton"), dict(decode="word", kernel="triton"),
                    dict(decode="word_early", num_warps=8, kernel="triton")]
        if fmt == "fp4" and dtype == torch.bfloat16:     # the Gluon kernel (also the default {} here)
            configs += [dict(kernel="gluon"), dict(kernel="gluon", num_splits=1), dict(kernel="gluon", num_splits=64),
                        dict(kernel="gluon", prefetch=0), dict(kernel="gluon", prefetch=2),
                        dict(kernel="gluon", prefetch=2, num_splits=1), dict(kernel="gluon", block_s=64),
                        dict(kernel="gluon", prefetch=3), dict(kernel="gluon", prefetch=3, num_splits=1),
                        dict(kernel="gluon", prefetch=3, num_splits=64),
                        dict(kernel="gluon", prefetch=3, block_s=64, num_splits=4),
                        dict(kernel="gluon", fused_merge=False), dict(kernel="gluon", num_splits=16),
                        dict(kernel="gluon", num_splits=32), dict(kernel="gluon", num_splits=32, fused_merge=True),
                        dict(kernel="gluon", num_splits=2, prefetch=2), dict(kernel="gluon", num_splits=1, prefetch=3)]
        if fmt == "fp8" and dtype == torch.bfloat16:     # the Gluon kernel's FP8 path (auto picks it from FP8_MIN_PAIRS)
            configs += [dict(kernel="gluon"), dict(kernel="gluon", num_splits=1), dict(kernel="gluon", num_splits=64),
                        dict(kernel="gluon", num_splits=4), dict(kernel="gluon", num_splits=8, fused_merge=True),
                        dict(kernel="gluon", fused_merge=False), dict(kernel="triton")]
    for cfg in configs:
        out = torch.full_like(q, float("nan"))                   # poisoned: every element must be written
        assert packed_decode_attention(q, k, v, slots, lens, 0.11, out=out, **cfg) is out
        assert torch.isfinite(out).all(), cfg
        err = float((out.double() - ref).norm() / ref.norm())
        assert err < tol, (cfg, err)


def _poisoned_case(fmt: str, seed: int):
    """Caches of 4 slots with every position past a row's length poisoned, the GPU lengths (ending mid-trip,
    shorter than the ring's look-ahead), and the float64 reference."""
    g = _gen(seed)
    k, v = _filled_caches(fmt, 4, g)
    slots = torch.tensor([4, 0, 2, 3, 1, 2, 0, 3][:len(LENS_GPU)], device=DEVICE)
    lens = torch.tensor(LENS_GPU, device=DEVICE)
    _poison_past((k, v), slots, lens)
    q = (torch.randn(len(LENS_GPU), 32, HEAD_DIM, generator=g) * 3).to(torch.bfloat16).to(DEVICE)
    return q, k, v, slots, lens, packed_decode_attention_reference(q, k, v, slots, lens, 0.11, torch.float64)


KNOB_VARIANTS = [dict(VECTOR_STORES=False), dict(RING_MASKS=False), dict(VECTOR_STORES=False, RING_MASKS=False),
                 dict(Q_VECTOR_LOADS=False), dict(Q_VECTOR_LOADS=False, VECTOR_STORES=False)]


@pytest.mark.skipif(not GPU, reason="the Gluon kernel runs on a GPU only")
@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
@pytest.mark.parametrize("knobs", KNOB_VARIANTS, ids=lambda k: ",".join(f"{n.lower()}={int(v)}" for n, v in k.items()))
def test_gluon_module_knobs_equal_the_default_kernel(fmt, knobs, monkeypatch):
    """kv_decode_gluon's module knobs change how bytes move, not the arithmetic: VECTOR_STORES (the partials as
    16-byte stores), Q_VECTOR_LOADS (q as 16-byte loads, reordered in registers) and RING_MASKS (the ring
    zero-fills rows past a split's end instead of rereading its last row; they must add nothing, not NaN, beside
    poisoned stale positions), all on by default: each turned off equals the default kernel bit for bit and the
    reference within the kernel's tolerance, at split counts whose splits end mid-trip, are shorter than the
    ring's look-ahead, or hold no position at all, merged in the kernel or by the combine launch. Repeated calls:
    a race between the ring's last copies and the epilogue's shared memory showed once in four variants."""
    from megatron_qrl.kernels import kv_decode_gluon as kg
    q, k, v, slots, lens, ref = _poisoned_case(fmt, 11)
    for cfg in (dict(), dict(num_splits=1), dict(num_splits=4), dict(num_splits=64), dict(fused_merge=False)):
        base = torch.full_like(q, float("nan"))
        packed_decode_attention(q, k, v, slots, lens, 0.11, out=base, kernel="gluon", **cfg)
        with monkeypatch.context() as m:
            for name, value in knobs.items():
                m.setattr(kg, name, value)
            outs = []
            for _ in range(4):
                outs.append(torch.full_like(q, float("nan")))
                packed_decode_attention(q, k, v, slots, lens, 0.11, out=outs[-1], kernel="gluon", **cfg)
        for out in outs:
            assert torch.isfinite(out).all(), cfg
            torch.testing.assert_close(out.float(), base.float(), rtol=0, atol=0, msg=lambda m: f"{cfg}: {m}")
        assert float((outs[0].double() - ref).norm() / ref.norm()) < 5e-3, cfg


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
def test_gluon_orders_are_permutations_that_q_k_v_and_the_store_agree_on(fmt):
    """kv_decode_gluon's logical head_dim orders (the MMA fragments' K of the scores, the rows of O^T): each is a
    permutation, and attention through them (q, K gathered in one, V in the other, the output stored back) is
    plain attention. The GPU test above checks the kernel's own index arithmetic against the reference."""
    from megatron_qrl.kernels import kv_decode_gluon as kg
    for order in (kg.q_order(fmt), kg.o_order(fmt)):
        assert sorted(order.tolist()) == list(range(kg.HEAD_DIM))
        assert not torch.equal(order, torch.arange(kg.HEAD_DIM))          # a real reordering, not identity
    g = _gen(3)
    q, k, v = (torch.randn(n, kg.HEAD_DIM, generator=g, dtype=torch.float64) for n in (8, 77, 77))
    ref = torch.softmax(q @ k.T, -1) @ v
    assert torch.allclose(kg.emulate_orders(q, k, v, fmt), ref, rtol=0, atol=1e-12)
    if fmt == "fp4":   # q_order groups each lane's 16 code bytes: logical k = 64 h + 32 j3 + 16 j2 + 8 j1 + 2 gr + j0
        assert kg.q_order()[2].item() == 32 and kg.q_order()[8].item() == 2 and kg.q_order()[64].item() == 16
        assert kg.o_order()[1].item() == 8 and kg.o_order()[2].item() == 32 and kg.o_order()[8].item() == 1
    else:              # lane t's 32 K bytes, a word per k16 slice; lane g's 16 V bytes, a byte per register pair
        assert kg.q_order("fp8")[2].item() == 32 and kg.q_order("fp8")[8].item() == 2
        assert kg.q_order("fp8")[16].item() == 4
        assert kg.o_order("fp8")[1].item() == 16 and kg.o_order("fp8")[8].item() == 1
        assert kg.o_order("fp8")[32].item() == 4


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
def test_gluon_q_vector_loads_reorder_into_q_order(fmt):
    """Q_VECTOR_LOADS: a lane loads head g's 32 contiguous values of group t and the kernel reshapes [heads, 4, 32]
    to [heads, 4, 2, 2, 2, 2, 2] and permutes (2, 3, 4, 5, 1, 6, 0) into Q^T [128, heads]; for both formats that is
    q gathered in q_order (the compiler's assert_trivial checks that no data moves; this checks the values)."""
    from megatron_qrl.kernels import kv_decode_gluon as kg
    q = torch.randn(8, kg.HEAD_DIM, generator=_gen(4))
    q_t = q.reshape(8, 4, 2, 2, 2, 2, 2).permute(2, 3, 4, 5, 1, 6, 0).reshape(kg.HEAD_DIM, 8)
    assert torch.equal(q_t, q[:, kg.q_order(fmt)].T)


@pytest.mark.skipif(GPU, reason="the CPU's answer to a Gluon request")
def test_gluon_kernel_request_off_gpu_is_a_clear_error():
    k, v = _filled_caches("fp4", 2, _gen(5))
    q = torch.randn(2, 8, HEAD_DIM).to(torch.bfloat16)
    with pytest.raises(ValueError, match="kernel='triton'"):
        packed_decode_attention(q, k, v, torch.tensor([0, 1]), torch.tensor([3, 5]), 0.1, kernel="gluon")


@pytest.mark.skipif(not GPU, reason="the Gluon kernel runs on a GPU only")
def test_gluon_fp8_runs_with_its_ring_only():
    k, v = _filled_caches("fp8", 2, _gen(6))
    q = torch.randn(2, 8, HEAD_DIM).to(torch.bfloat16).to(DEVICE)
    slots, lens = torch.tensor([0, 1], device=DEVICE), torch.tensor([3, 5], device=DEVICE)
    with pytest.raises(ValueError, match="prefetch 3"):
        packed_decode_attention(q, k, v, slots, lens, 0.1, kernel="gluon", prefetch=2)
    with pytest.raises(ValueError, match="kernel='triton'"):
        packed_decode_attention(q, k, v, slots, lens, 0.1, kernel="gluon", block_s=64)


def test_gluon_splits_take_16_trips_unless_the_grid_would_leave_sms_idle():
    from megatron_qrl.kernels import kv_decode_gluon as kg
    assert kg.default_min_tiles(16, 4, 4096, 132) == 16       # 64 (row, head) pairs x 8 splits: 512 programs
    assert kg.default_min_tiles(1, 8, 8192, 132) == 2         # 8 pairs x 16 splits = 128 < 2 per SM
    assert split_count(16, 4, 4096, 32, 132, kg.PROGRAMS_PER_SM, kg.default_min_tiles(16, 4, 4096, 132)) == 8
    assert split_count(128, 8, 4096, 32, 132, kg.PROGRAMS_PER_SM, kg.default_min_tiles(128, 8, 4096, 132)) == 1
    # small grids: ~4 programs per SM rounded down (512 on 132 SMs), >= 2 trips of 32 positions each
    assert kg.small_grid_splits(16, 4, 4096, 132) is None                 # a full grid: split_count's rule
    for (b, hkv, s), want in {(1, 4, 4096): 64, (1, 4, 8192): 128, (1, 4, 16384): 128, (1, 8, 4096): 64,
                              (1, 8, 16384): 64, (2, 4, 8192): 64, (1, 4, 100): 2}.items():
        assert kg.small_grid_splits(b, hkv, s, 132) == want, (b, hkv, s)


def test_gluon_small_grid_rule_is_one_switch(monkeypatch):
    from megatron_qrl.kernels import kv_decode_gluon as kg
    monkeypatch.setattr(kg, "SMALL_GRID_ROUND_DOWN", False)
    assert kg.small_grid_splits(1, 4, 8192, 132) is None                  # the round-up rule of split_count


def test_split_count_fills_the_gpu_and_stays_static():
    four = dict(programs_per_sm=4)
    assert split_count(1, 4, 8192, 64, 132, **four) == 64      # 4 programs alone would leave 128 SMs idle
    assert split_count(1, 4, 8192, 64, 132, min_blocks=1, **four) == 128
    assert split_count(64, 8, 2048, 64, 132, **four) == 2
    assert split_count(128, 8, 4096, 64, 132, **four) == 1
    assert split_count(1, 4, 100, 64, 132, **four) == 1        # a short cache: no split below 2 blocks
    assert split_count(16, 4, 4096, 128, 132) == 16            # the default: 4 programs per SM, 128-position blocks


@pytest.mark.skipif(not GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("fmt,extra", [("fp4", {}), ("fp8", {}),
                                       ("fp4", dict(kernel="gluon", num_splits=8, fused_merge=True)),
                                       ("fp8", dict(kernel="gluon")), ("fp8", dict(kernel="gluon", num_splits=2))],
                         ids=["fp4", "fp8", "fp4-merge-in-kernel", "fp8-gluon", "fp8-gluon-merge-in-kernel"])
def test_packed_attention_replays_in_a_cuda_graph(fmt, extra):
    """Captured once, replayed with other slots and lengths (device tensors): equal to eager calls (the
    in-kernel merge's counters are back at zero after every call, so replays merge too)."""
    g = _gen()
    k, v = _filled_caches(fmt, 4, g)
    q = torch.randn(3, 32, HEAD_DIM, generator=g).to(torch.bfloat16).to(DEVICE)
    slots = torch.tensor([0, 1, 2], device=DEVICE)
    lens = torch.tensor([5, 6, 7], device=DEVICE)
    packed_decode_attention(q, k, v, slots, lens, 0.1, **extra)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = packed_decode_attention(q, k, v, slots, lens, 0.1, **extra)
    for new_slots, new_lens in (([3, 0, 4], [MAX_LEN, 1, 300]), ([2, 2, 1], [64, 65, 1000]),
                                ([1, 3, 0], [2, MAX_LEN, 33])):
        slots.copy_(torch.tensor(new_slots))
        lens.copy_(torch.tensor(new_lens))
        out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(out, packed_decode_attention(q, k, v, slots, lens, 0.1, **extra))


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_packed_cache_reads_the_dequantized_values_in_fewer_bytes(fmt, dtype):
    KVCache = pytest.importorskip("megatron_qrl.rollout.kv_cache").KVCache   # the engine package (GPU shims may lack it)
    g = _gen()
    args = dict(num_layers=2, max_slots=3, max_len=12, num_kv_heads=2, head_dim=HEAD_DIM, dtype=dtype, device=DEVICE,
                kv_format=fmt, scratch=True)
    plain, packed = KVCache(**args), KVCache(**args, packed=True)
    bf16 = KVCache(**dict(args, kv_format="bf16", dtype=torch.bfloat16))
    for step in range(3):
        slots = torch.tensor([2, 0, 3], device=DEVICE)
        pos = torch.tensor([step, 11 - step, 5], device=DEVICE)
        k, v = _rows(3, 2, HEAD_DIM, g, dtype), _rows(3, 2, HEAD_DIM, g, dtype)
        for c in (plain, packed):
            c.write(1, slots, pos, k, v)
    every = torch.tensor([3, 1, 0, 2], device=DEVICE)
    for a, b in zip(plain.read(1, every, 12), packed.read(1, every, 12)):
        assert a.dtype == b.dtype == dtype and torch.equal(a, b)
    ratio = bf16.nbytes() / packed.nbytes()
    row = HEAD_DIM // 2 + HEAD_DIM // 16 + 4 if fmt == "fp4" else HEAD_DIM + 4     # codes, block scales, row scale
    assert ratio == 2 * HEAD_DIM / row                        # d = 128: 256 bytes -> 76 (3.4x) / 132 (1.9x)
    packed.release()
    assert packed.nbytes() == 0
    packed.allocate()
    assert packed.nbytes() == bf16.nbytes() / ratio and not packed.read(1, every, 12)[0].any()


def test_split_counters_start_at_zero_grow_and_keep_the_old_buffer():
    """The in-kernel merge's counters: zero, at least n, reused while they suffice; an outgrown buffer stays
    referenced (a graph captured with it still points at it)."""
    from megatron_qrl.kernels import kv_decode_gluon as kg
    dev = torch.device("cpu")
    kg._COUNTERS.pop(dev, None)
    a = kg.split_counters(dev, 10)
    assert a.dtype == torch.int32 and a.numel() >= 10 and not a.any()
    assert kg.split_counters(dev, a.numel()) is a
    b = kg.split_counters(dev, a.numel() + 1)
    assert b.numel() > a.numel() and not b.any() and any(o is a for o in kg._OLD_COUNTERS)
    kg._COUNTERS.pop(dev, None)
