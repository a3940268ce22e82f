"""Decode routing kernels (kernels/decode_routing.py) against torch.topk, Megatron's routing function and
moe_align.

Ids: the kernel's canonical order (descending score, ties -> lower expert index) equals a stable descending
sort; against Megatron's own top-k the sets agree wherever the k-th and (k+1)-th scores differ (on a tie
at the boundary either expert is a valid choice; then the selected values agree). Probabilities: Megatron's
function evaluated at the kernel's ids (precomputed_indices); float32 agrees to round-off of exp (the
interpreter's numpy exp, torch's vectorised one), half types bit for bit except for a rare 1-ulp flip.
Alignment: identical to moe_align. QRL_KERNEL_TESTS_DEVICE=cuda runs the same tests on a GPU.
"""
import os

DEVICE = "cuda" if os.environ.get("QRL_KERNEL_TESTS_DEVICE") == "cuda" else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function  # noqa: E402

from megatron_qrl.kernels import decode_routing  # noqa: E402
from megatron_qrl.kernels.decode_routing import align_only, route_and_align  # noqa: E402
from megatron_qrl.kernels.moe_grouped_gemm import max_blocks, moe_align  # noqa: E402

ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


def assert_same_routing(a, b):
    assert a.num_blocks == b.num_blocks and a.block_m == b.block_m
    assert (a.n_tokens, a.top_k) == (b.n_tokens, b.top_k)
    assert torch.equal(a.sorted_ids, b.sorted_ids)
    assert torch.equal(a.block_expert, b.block_expert)


def check_route(logits, k, block_m, pre_softmax=False, scaling=None):
    probs, ids, routing = route_and_align(logits, k, block_m, pre_softmax=pre_softmax, scaling_factor=scaling)
    t, e = logits.shape
    assert probs.dtype == logits.dtype and ids.dtype == torch.int64
    assert probs.shape == ids.shape == (t, k)
    # canonical order: stable descending sort of the scores (softmax is monotone: same order as the logits)
    canon = torch.sort(logits.float(), dim=1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(ids, canon)
    with torch.no_grad():
        ref_probs, _ = topk_routing_with_score_function(logits, k, use_pre_softmax=pre_softmax,
                                                        scaling_factor=scaling, dense_output=True,
                                                        precomputed_indices=ids)
        own_probs, own_ids = topk_routing_with_score_function(logits, k, use_pre_softmax=pre_softmax,
                                                              scaling_factor=scaling, dense_output=True)
    if logits.dtype == torch.float32:
        torch.testing.assert_close(probs, ref_probs, rtol=1e-6, atol=0)
    else:
        diff = (probs.float() - ref_probs.float()).abs()
        assert bool((diff <= ULP[logits.dtype] * ref_probs.float().abs()).all())
        assert float((diff == 0).float().mean()) >= 0.995
    # Megatron's own top-k: same sets unless the k-th and (k+1)-th scores tie; same selected values always
    srt = torch.sort(logits.float(), dim=1, descending=True).values
    no_tie = srt[:, k - 1] > srt[:, k] if k < e else torch.ones(t, dtype=torch.bool, device=logits.device)
    assert torch.equal(ids.sort(1).values[no_tie], own_ids.sort(1).values[no_tie])
    assert torch.equal(logits.gather(1, ids), torch.sort(logits.gather(1, own_ids), dim=1, descending=True).values)
    assert_same_routing(routing, moe_align(ids, e, block_m))
    assert routing.num_blocks == max_blocks(t * k, e, block_m)
    return probs, ids, routing


@pytest.mark.parametrize("t, e, k, block_m, dtype, pre_softmax, scaling", [
    (1, 4, 2, 16, torch.float32, False, None),
    (3, 128, 8, 1, torch.bfloat16, False, None),
    (64, 128, 8, 16, torch.bfloat16, False, None),
    (64, 128, 8, 16, torch.bfloat16, True, 2.5),
    (37, 60, 4, 32, torch.float16, True, None),          # E not a power of two
    (200, 256, 8, 16, torch.float32, False, 1.5),
    (257, 128, 8, 16, torch.bfloat16, False, None),      # a partial last row block
    (2048, 128, 8, 64, torch.bfloat16, False, None),
    (2048, 256, 8, 16, torch.bfloat16, True, None),
    (16, 8, 8, 16, torch.bfloat16, False, None),         # k = E
], ids=str)
def test_route_and_align_matches_megatron_and_moe_align(t, e, k, block_m, dtype, pre_softmax, scaling):
    g = torch.Generator().manual_seed(t * 1000 + e + k)
    logits = (torch.randn(t, e, generator=g) * 2).to(dtype).to(DEVICE)
    check_route(logits, k, block_m, pre_softmax, scaling)


@pytest.mark.parametrize("t", [1, 40, 300])
def test_ties_go_to_the_lower_expert(t):
    """Logits on a coarse grid: most rows tie inside and at the boundary of their top-k."""
    g = torch.Generator().manual_seed(t)
    logits = torch.randint(-3, 4, (t, 32), generator=g).to(torch.bfloat16).to(DEVICE)
    for pre in (False, True):
        check_route(logits, 6, 16, pre_softmax=pre)


def test_strided_logits_and_one_expert_per_row():
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(50, 200, generator=g).to(DEVICE)
    logits = wide[:, 8:136]                              # row stride 200
    check_route(logits, 1, 16)
    check_route(logits, 3, 4)


@pytest.mark.parametrize("t, k, e, block_m", [(1, 1, 4, 16), (1, 8, 128, 16), (64, 8, 128, 16), (96, 1, 128, 1),
                                              (512, 1, 128, 16), (2048, 8, 128, 64), (300, 2, 256, 32)], ids=str)
def test_align_only_equals_moe_align(t, k, e, block_m):
    g = torch.Generator().manual_seed(t + k + e)
    # skewed draws leave experts empty and give some long runs
    ids = torch.multinomial(torch.rand(e, generator=g) ** 4, t * k, replacement=True, generator=g).view(t, k)
    for dtype in (torch.int64, torch.int32):
        x = ids.to(dtype).to(DEVICE)
        assert_same_routing(align_only(x, e, block_m), moe_align(x, e, block_m))


def test_the_wide_top1_alignment_equals_the_topk_one():
    """The W4A4 path aligns the T*k assignments as top-1 rows: same sorted ids as the [T, k] alignment."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(24, 16, generator=g).to(DEVICE)
    _, ids, routing = route_and_align(logits, 4, 16)
    flat = align_only(ids.reshape(-1, 1), 16, 16)
    assert torch.equal(flat.sorted_ids, routing.sorted_ids) and torch.equal(flat.block_expert, routing.block_expert)


def test_any_split_over_programs_gives_the_same_routing(monkeypatch):
    """One program for all rows, one per row block, and several row blocks per program (prefill-sized
    batches) give identical outputs: the sort's offsets across programs come from the counts alone."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(100, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    results = []
    tile = decode_routing._TILE
    # (programs at most, tile): 1 program of 100 rows; 7 programs of a 16-row block; 3 programs of 3 blocks
    for programs, tile in ((1, tile), (128, 16 * 64), (3, 16 * 64)):
        monkeypatch.setattr(decode_routing, "MAX_PROGRAMS", programs)
        monkeypatch.setattr(decode_routing, "_TILE", tile)
        results.append(check_route(logits, 4, 16))
        flat = align_only(results[-1][1], 64, 16)
        assert_same_routing(flat, results[-1][2])
    for other in results[1:]:
        assert torch.equal(results[0][0], other[0]) and torch.equal(results[0][1], other[1])
        assert_same_routing(results[0][2], other[2])


@pytest.mark.parametrize("t, e, k", [(1, 4, 2), (64, 128, 8), (257, 128, 8), (2048, 128, 8)], ids=str)
def test_route_writes_the_r3_record_column(t, e, k):
    """routed=: the second launch also writes the ids as int16 into one MoE layer's column of a decode step's
    [T, layers, k] R3 record -- what `ids.to(torch.int16)` and a stack over the layers gave -- and every other
    output is unchanged."""
    g = torch.Generator().manual_seed(t + e)
    logits = (torch.randn(t, e, generator=g) * 2).to(torch.bfloat16).to(DEVICE)
    probs, ids, routing = route_and_align(logits, k, 16)
    record = torch.full((t, 3, k), -7, dtype=torch.int16, device=DEVICE)
    p2, i2, r2 = route_and_align(logits, k, 16, routed=record[:, 1])
    assert torch.equal(record[:, 1], ids.to(torch.int16))
    assert bool((record[:, 0] == -7).all()) and bool((record[:, 2] == -7).all())
    assert torch.equal(p2, probs) and torch.equal(i2, ids)
    assert_same_routing(r2, routing)
    for bad in (record[:, 1].to(torch.int32), record[:, 1, :k - 1] if k > 1 else record[:1, 1], record[:, :, 0]):
        with pytest.raises(ValueError, match="routed"):
            route_and_align(logits, k, 16, routed=bad)


def test_refuses_what_it_does_not_implement():
    logits = torch.randn(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="softmax"):
        route_and_align(logits, 2, 16, score="sigmoid")
    with pytest.raises(ValueError, match="top_k"):
        route_and_align(logits, 9, 16)
    with pytest.raises(ValueError, match="power of two"):
        route_and_align(logits, 2, 12)
