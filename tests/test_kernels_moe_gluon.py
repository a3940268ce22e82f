"""The Gluon grouped MoE kernel (kernels/moe_gluon.py) against the per-expert reference and the Triton kernel.

On CPU (the default): the kernel's index algebra (`emulate`: the lanes' decode of each 128-wide trip and the
logical K order shared by A and B) against x @ dequant(W)^T, its block-level contract (`emulate_launch`: sorted
rows, silu(gate) * up, router weights, pad rows untouched) against the pipeline reference, the config switch (GLUON_DEFAULT, the fallback of
a Gluon config to the Triton kernel where Gluon cannot run, here the interpreter). With
QRL_KERNEL_TESTS_DEVICE=cuda (an sm_90 GPU) the kernel itself: gate/up and down projections at block_m 16 and
32, several rows per program, fp16 and bf16 operands, uneven expert loads with empty experts and one expert
with more than a block of rows, pad rows of the intermediate left untouched (NaN poison), and a CUDA-graph
replay with a new routing. Tolerances as tests/test_kernels_gemm.py (2e-2 for the MoE pipeline; the Gluon and
Triton kernels differ only in fp32 summation order: 1e-2 of the output's norm is generous).
"""
import os
from dataclasses import replace

DEVICE = "cuda" if os.environ.get("QRL_KERNEL_TESTS_DEVICE") == "cuda" else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

import megatron_qrl.kernels.moe_grouped_gemm as mg  # noqa: E402
from megatron_qrl.kernels import moe_gluon  # noqa: E402
from megatron_qrl.kernels.layouts import dequantize_prepared, prepare_nvfp4_weight  # noqa: E402
from megatron_qrl.kernels.moe_grouped_gemm import (MoEConfig, gluon_moe_config, moe_align, moe_down,  # noqa: E402
                                                   moe_gate_up, moe_w4a16, moe_w4a16_reference, to_fp16_operand)
from megatron_qrl.quant import nvfp4_quantize  # noqa: E402

GPU = DEVICE == "cuda"
MOE_TOL = 2e-2
gpu_only = pytest.mark.skipif(not GPU, reason="Gluon kernels run on sm_90 only (QRL_KERNEL_TESTS_DEVICE=cuda)")


def _seed():
    return int.from_bytes(os.urandom(4), "little")


def _experts(e, n, k, gen):
    w = torch.randn(e, n, k, generator=gen) * 0.05
    w[0, 0, :16] *= 40                                   # an outlier block next to small ones
    q = [nvfp4_quantize(w[i].to(DEVICE)) for i in range(e)]
    return prepare_nvfp4_weight(torch.stack([a[0] for a in q]), torch.stack([a[1] for a in q]),
                                torch.stack([a[2] for a in q]))


def _routing_ids(t, e, k, gen, heavy=0, empty=()):
    """[t, k] expert ids, distinct per token: expert `heavy` in every token (more than a block of rows at t > 32),
    the `empty` experts in none, the rest random."""
    others = [i for i in range(e) if i != heavy and i not in empty]
    rows = []
    for _ in range(t):
        pick = torch.randperm(len(others), generator=gen)[:k - 1].tolist()
        rows.append([heavy] + [others[i] for i in pick])
    return torch.tensor(rows, dtype=torch.long)


def _rel(y, ref):
    assert torch.isfinite(y).all(), "output holds NaN/Inf (unwritten or overflowed elements)"
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


# ------------------------------------------------------------------------------------------------
# CPU: index algebra and dispatch
# ------------------------------------------------------------------------------------------------
def test_k_order_is_a_permutation_and_the_kv_kernels_q_order():
    from megatron_qrl.kernels.kv_decode_gluon import q_order
    order = moe_gluon.k_order()
    assert sorted(order.tolist()) == list(range(moe_gluon.TRIP_K))
    assert torch.equal(order, q_order())
    # lane t (K bits 1-2 of the logical order) owns the contiguous packing group t in every k16 slice
    k = torch.arange(moe_gluon.TRIP_K)
    assert torch.equal(order // 32, (k >> 1) & 3)


@pytest.mark.parametrize("k", [128, 384])
def test_emulate_equals_dequantized_matmul(k):
    """The kernel's decode of each trip (bytes j -> elements j, 16 + j of group t, times their block scales) and
    the logical K order of A and B give x @ dequant(W_e)^T (fp32 summation order apart)."""
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    w = _experts(3, 48, k, gen)
    w = replace(w, qweight=w.qweight.cpu(), scales=w.scales.cpu(), global_scale=w.global_scale.cpu())
    x = torch.randn(5, k, generator=gen).to(torch.bfloat16)
    wd = dequantize_prepared(w, torch.float32)
    for e in range(3):
        ref = x.float() @ wd[e].t()
        got = moe_gluon.emulate(x, w, e)
        assert ((got - ref).norm() / ref.norm()).item() < 1e-5, (seed, e)


@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("x_pre", [True, False])
def test_emulated_launches_match_the_reference_and_leave_pad_rows(block_m, x_pre):
    """The kernel's contract, block by block (moe_gluon.emulate_launch): gate/up into sorted rows (fp16 * 2^-8 or
    bf16), down scaled by the router weight into assignment rows, pad rows never written; the two chained give
    moe_w4a16_reference."""
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    e, h, f, k, t = 6, 256, 128, 3, 24
    w13, w2 = _experts(e, 2 * f, h, gen), _experts(e, h, f, gen)
    w13, w2 = (replace(w, qweight=w.qweight.cpu(), scales=w.scales.cpu(), global_scale=w.global_scale.cpu())
               for w in (w13, w2))
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    ids = _routing_ids(t, e, k, gen, heavy=0, empty=(5,))
    tw = torch.softmax(torch.randn(t, k, generator=gen), -1)
    routing = moe_align(ids, e, block_m)
    pad = routing.sorted_ids >= routing.n_assign
    hd = torch.float16 if x_pre else torch.bfloat16
    hs = torch.full((routing.sorted_ids.numel(), f), float("nan"), dtype=hd)
    xin = (x.float() * 2.0 ** -8).to(torch.float16) if x_pre else x
    moe_gluon.emulate_launch(xin, w13, hs, routing, None, True)
    assert torch.isnan(hs[pad]).all() and torch.isfinite(hs[~pad]).all()
    y = torch.full((routing.n_assign, h), float("nan"), dtype=torch.bfloat16)
    moe_gluon.emulate_launch(hs, w2, y, routing, tw.reshape(-1).float(), False)
    assert _rel(y.view(t, k, h).float().sum(1), moe_w4a16_reference(x, w13, w2, ids, tw)) < MOE_TOL, seed


def test_heuristic_keeps_triton_until_the_switch_is_flipped(monkeypatch):
    assert not mg.GLUON_DEFAULT
    for n_assign in (128, 256, 1024, 2048, 4096):
        assert not mg.heuristic_moe_config(n_assign, 128, 768, 2048, True).gluon
    monkeypatch.setattr(mg, "GLUON_DEFAULT", True)
    cfg = mg.heuristic_moe_config(1024, 128, 768, 2048, True)          # batch 128, top-8: 8 per expert
    assert cfg.gluon and cfg.block_m == 16 and cfg.block_k == 128 and cfg.x_pre
    assert cfg.block_n == moe_gluon.default_rows(True, 16)
    dn = mg.heuristic_moe_config(4096, 128, 2048, 768, False)           # 32 per expert
    assert dn.gluon and dn.block_m == 32 and dn.block_n == moe_gluon.default_rows(False, 32)
    assert mg.heuristic_moe_config(4096, 128, 768, 2048, True).x_pre      # fp16 operand at block_m 32 too
    assert not mg.heuristic_moe_config(2048, 128, 768, 2048, True, "mxfp4").gluon
    assert mg.heuristic_moe_config(64, 128, 768, 2048, True).gemv       # <= 1 per expert: still the GEMV
    assert not mg.heuristic_moe_config(16384, 128, 768, 2048, True).gluon   # block_m 64: Triton
    assert not mg.heuristic_moe_config(2048, 128, 768, 2000, True).gluon    # K % 128 != 0


def test_supported_needs_nvfp4_a_block_of_8_to_32_rows_and_k_multiple_of_128():
    ok = dict(fmt="nvfp4", block_m=16, k=2048, rows=32, on_gpu=True, warps=1)
    if not moe_gluon.HAVE_GLUON or os.environ.get("TRITON_INTERPRET") == "1":
        assert not moe_gluon.supported(**ok)
        return
    assert moe_gluon.supported(**ok)
    assert moe_gluon.supported(**{**ok, "rows": 128, "warps": 4})
    for bad in (dict(fmt="mxfp4"), dict(block_m=64), dict(k=2000), dict(rows=48), dict(on_gpu=False),
                dict(warps=3), dict(rows=32, warps=4)):
        assert not moe_gluon.supported(**{**ok, **bad}), bad


@pytest.mark.skipif(GPU, reason="the CPU's fallback of a Gluon config")
def test_gluon_config_off_gpu_runs_the_triton_kernel():
    """A Gluon config where Gluon cannot run (the interpreter) takes the Triton kernel: same results."""
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    e, h, f, k, t = 4, 128, 64, 2, 12
    w13, w2 = _experts(e, 2 * f, h, gen), _experts(e, h, f, gen)
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    ids = _routing_ids(t, e, k, gen)
    tw = torch.softmax(torch.randn(t, k, generator=gen), -1)
    for bm in (8, 16):
        y = moe_w4a16(x, w13, w2, ids, tw, gate_up_config=gluon_moe_config(bm, True))
        assert _rel(y, moe_w4a16_reference(x, w13, w2, ids, tw)) < MOE_TOL, (seed, bm)


# ------------------------------------------------------------------------------------------------
# GPU: the kernel
# ------------------------------------------------------------------------------------------------
def _case(gen, t=40, e=8, h=512, f=384, k=4):
    """Expert 0 in every token (t rows: more than a block), experts 6 and 7 in none, the rest uneven."""
    w13, w2 = _experts(e, 2 * f, h, gen), _experts(e, h, f, gen)
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16).to(DEVICE)
    ids = _routing_ids(t, e, k, gen, heavy=0, empty=(6, 7)).to(DEVICE)
    tw = torch.softmax(torch.randn(t, k, generator=gen), -1).to(DEVICE)
    return w13, w2, x, ids, tw


@gpu_only
@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("x_pre", [True, False])
def test_gate_up_matches_triton_and_leaves_pad_rows(block_m, x_pre):
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    w13, w2, x, ids, tw = _case(gen, f=352)                 # F = 352: the last 64-row tile is half past N
    routing = moe_align(ids, w13.num_experts, block_m)
    tri = MoEConfig(block_m, 64, 128, 4, 3, x_pre=x_pre)
    ref = moe_gate_up(x, w13, routing, tri)
    pad = routing.sorted_ids >= routing.n_assign
    assert pad.any()
    # (rows, warps, ring stages): 16, 32 and 64 rows per warp (bench_kernels --configs gluon's gate/up variants)
    for rows, warps, st in ((32, 1, 3), (64, 1, 3), (32, 2, 3), (64, 2, 3), (64, 4, 3), (128, 4, 3)):
        cfg = gluon_moe_config(block_m, True, x_pre, rows=rows, warps=warps, stages=st)
        xin = to_fp16_operand(x) if x_pre else x
        h = torch.full_like(ref, float("nan"))
        mg._launch(xin, w13, h, routing, None, True, cfg)
        assert torch.isnan(h[pad]).all(), (seed, rows, warps, st, "pad rows written")
        assert _rel(h[~pad], ref[~pad]) < 1e-2, (seed, rows, warps, st, _rel(h[~pad], ref[~pad]))


@gpu_only
@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("h_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_down_matches_triton(block_m, h_dtype):
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    w13, w2, x, ids, tw = _case(gen, h=544)                 # H = 544: the last 64-row tile is partial
    routing = moe_align(ids, w13.num_experts, block_m)
    hs = torch.randn(routing.sorted_ids.numel(), w2.k, generator=gen).to(DEVICE)
    hs = (hs * 2.0 ** -8).to(torch.float16) if h_dtype == torch.float16 else hs.to(torch.bfloat16)
    hs[routing.sorted_ids >= routing.n_assign] = float("nan")        # pad rows: garbage the kernel must not use
    twf = tw.reshape(-1).float().contiguous()
    ref = moe_down(hs, w2, routing, tw, MoEConfig(block_m, 128, 128, 4, 3))
    # 16, 32 and 64 rows per warp, the scale pairs through rings of 3 and 2 slots
    for rows, warps, st in ((64, 1, 3), (32, 2, 3), (64, 4, 3), (128, 2, 3), (256, 4, 3), (64, 4, 2)):
        y = torch.full_like(ref, float("nan"))
        mg._launch(hs, w2, y, routing, twf, False,
                   gluon_moe_config(block_m, False, rows=rows, warps=warps, stages=st))
        assert _rel(y, ref) < 1e-2, (seed, rows, warps, st, _rel(y, ref))


@gpu_only
@pytest.mark.parametrize("block_m", [16, 32])
def test_pipeline_matches_reference(block_m):
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    w13, w2, x, ids, tw = _case(gen, t=70)
    ref = moe_w4a16_reference(x, w13, w2, ids, tw)
    for x_pre, warps in ((True, 1), (False, 1), (True, 2)):
        y = moe_w4a16(x, w13, w2, ids, tw, gate_up_config=gluon_moe_config(block_m, True, x_pre, warps=warps))
        assert _rel(y, ref) < MOE_TOL, (seed, x_pre, warps)


@gpu_only
def test_block_m_8_variants_match_reference():
    """bench_kernels --configs gluon's block_m 8 pairs (T <= 64): 16 rows per warp at 4 warps, the 1-warp defaults."""
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    w13, w2, x, ids, tw = _case(gen, t=70)
    ref = moe_w4a16_reference(x, w13, w2, ids, tw)
    for gu_rows, dn_rows, warps in ((64, 64, 4), (32, 64, 1)):
        y = moe_w4a16(x, w13, w2, ids, tw, gate_up_config=gluon_moe_config(8, True, True, rows=gu_rows, warps=warps),
                      down_config=gluon_moe_config(8, False, rows=dn_rows, warps=warps))
        assert _rel(y, ref) < MOE_TOL, (seed, gu_rows, dn_rows, warps)


@gpu_only
def test_replays_in_a_cuda_graph_with_a_new_routing():
    """The decode step's use: routing buffers updated in place, the captured gate/up + down launches replayed."""
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    w13, w2, x, ids, tw = _case(gen, t=64, e=16, h=512, f=256)
    bm = 16
    routing = moe_align(ids, w13.num_experts, bm)
    gu, dn = gluon_moe_config(bm, True, True), gluon_moe_config(bm, False)
    x_s, tw_s = x.clone(), tw.clone()

    def step():
        return moe_w4a16(x_s, w13, w2, None, tw_s, routing=routing, gate_up_config=gu, down_config=dn)

    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        step()                                          # warm-up: compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(2):
        ids2 = _routing_ids(64, 16, 4, gen, heavy=int(torch.randint(16, (1,), generator=gen)), empty=(3,)).to(DEVICE)
        x2 = torch.randn(64, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
        tw2 = torch.softmax(torch.randn(64, 4, generator=gen), -1).to(DEVICE)
        new = moe_align(ids2, w13.num_experts, bm)
        assert new.num_blocks == routing.num_blocks       # the bound depends on shapes only
        routing.sorted_ids.copy_(new.sorted_ids)
        routing.block_expert.copy_(new.block_expert)
        x_s.copy_(x2)
        tw_s.copy_(tw2)
        graph.replay()
        torch.cuda.synchronize()
        assert _rel(out, moe_w4a16_reference(x2, w13, w2, ids2, tw2)) < MOE_TOL, seed
