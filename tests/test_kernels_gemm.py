"""W4A16 dense and grouped-MoE GEMM kernels against their torch references (dequantize, then matmul).

On CPU the kernels run in Triton's interpreter: this module sets TRITON_INTERPRET=1 before anything
imports the kernels (Triton reads it when a kernel is decorated, so the env must be set before
`megatron_qrl.kernels.*` is first imported in the process). On a GPU machine run it with
QRL_KERNEL_TESTS_DEVICE=cuda: then the real kernels (inline PTX decode, wgmma) run on the device.

Tolerance: relative Frobenius error against an fp32 reference over the exactly dequantized weights. The
kernels feed exact weights to the tensor cores (fp16 path) or bf16-rounded ones (bf16 path, like the
codec's bf16 dequant), accumulate in fp32 and round the output to bf16, so the error is ~2^-8 (bf16
output rounding, ~4e-3); we allow 1e-2 for the dense GEMM and 2e-2 for the MoE pipeline (two bf16 roundings
of intermediates: the SwiGLU activation and the per-slot partial outputs). Each test draws fresh inputs.
"""
import os
from dataclasses import replace

DEVICE = "cuda" if os.environ.get("QRL_KERNEL_TESTS_DEVICE") == "cuda" else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from megatron_qrl.kernels.layouts import (decode_nvfp4_scales, dequantize_prepared,  # noqa: E402
                                          encode_nvfp4_scales, permute_nibbles, prepare_mxfp4_weight,
                                          prepare_nvfp4_weight, unpermute_nibbles)
from megatron_qrl.kernels.moe_grouped_gemm import (MoEConfig, heuristic_moe_config, moe_align,  # noqa: E402
                                                   moe_w4a16, moe_w4a16_reference)
from megatron_qrl.kernels.w4a16_gemm import (GemmConfig, candidate_configs, dot_heuristic_config,  # noqa: E402
                                             heuristic_config, w4a16_gemm, w4a16_gemm_reference)
from megatron_qrl.kernels.w4a16_gemv import GemvConfig  # noqa: E402
from megatron_qrl.kernels.w4a16_gluon_gemm import GluonGemmConfig, gluon_candidates  # noqa: E402
from megatron_qrl.kernels.w4a16_mma_gemv import MmaGemvConfig, launch_mma_gemv  # noqa: E402
from megatron_qrl.quant import mxfp4_quantize, nvfp4_dequantize, nvfp4_quantize  # noqa: E402

DENSE_TOL = 1e-2
MOE_TOL = 2e-2


def _seed():
    return int.from_bytes(os.urandom(4), "little")  # fresh inputs for every test (printed on failure)


def _weight(fmt, n, k, gen, scale=0.05):
    w = torch.randn(n, k, generator=gen) * scale
    w[0, :16] *= 40  # an outlier block: large scale next to small ones
    w = w.to(DEVICE)
    if fmt == "nvfp4":
        return prepare_nvfp4_weight(*nvfp4_quantize(w))
    return prepare_mxfp4_weight(*mxfp4_quantize(w))


def _rel(y, ref):
    assert torch.isfinite(y).all(), "output holds NaN/Inf (unwritten or overflowed elements)"
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def _check_configs(m, n, k, configs, deterministic=False):
    """Each dense config on one fresh NVFP4 weight and input against the dequantize-then-matmul reference,
    into a NaN-poisoned output (every element must be written); deterministic: a second call is bit-equal."""
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    w = _weight("nvfp4", n, k, gen)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEVICE)
    ref = w4a16_gemm_reference(x, w)
    assert configs, "no config to check"
    for cfg in configs:
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        y = w4a16_gemm(x, w, out=out, config=cfg)
        assert _rel(y, ref) < DENSE_TOL, (seed, m, cfg.short(), _rel(y, ref))
        if deterministic:
            assert torch.equal(y, w4a16_gemm(x, w, config=cfg)), f"{cfg.short()}: split-K sums must be deterministic"


def _experts(fmt, e, n, k, gen):
    w = (torch.randn(e, n, k, generator=gen) * 0.05).to(DEVICE)
    if fmt == "nvfp4":
        q = [nvfp4_quantize(w[i]) for i in range(e)]
        return prepare_nvfp4_weight(torch.stack([a[0] for a in q]), torch.stack([a[1] for a in q]),
                                    torch.stack([a[2] for a in q]))
    q = [mxfp4_quantize(w[i]) for i in range(e)]
    return prepare_mxfp4_weight(torch.stack([a[0] for a in q]), torch.stack([a[1] for a in q]))


def _moe_case(fmt, e, h, f, k, t, gen, favour_expert0=False):
    """Expert stacks w13 [E, 2F, H] and w2 [E, H, F], activations [T, H] and a top-k softmax routing
    (favour_expert0: expert 0 takes most tokens)."""
    w13 = _experts(fmt, e, 2 * f, h, gen)
    w2 = _experts(fmt, e, h, f, gen)
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16).to(DEVICE)
    logits = torch.randn(t, e, generator=gen)
    if favour_expert0:
        logits[:, 0] += 4.0
    tw, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    return w13, w2, x, ids.to(DEVICE), tw.to(DEVICE)


# ------------------------------------------------------------------------------------------------
# Layouts
# ------------------------------------------------------------------------------------------------
def test_layout_roundtrip_and_scale_reencoding_exact():
    gen = torch.Generator().manual_seed(_seed())
    packed = torch.randint(0, 256, (7, 96), dtype=torch.uint8, generator=gen)
    assert torch.equal(unpermute_nibbles(permute_nibbles(packed)), packed)
    # every finite non-negative E4M3 value re-encodes exactly into the one-shift byte and back
    all_e4m3 = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert torch.equal(decode_nvfp4_scales(encode_nvfp4_scales(all_e4m3)).view(torch.uint8),
                       all_e4m3.view(torch.uint8))
    with pytest.raises(ValueError, match="multiple of 32"):
        permute_nibbles(torch.zeros(2, 24, dtype=torch.uint8))


def test_prepared_weight_dequantizes_like_the_codec():
    gen = torch.Generator().manual_seed(_seed())
    w = torch.randn(32, 128, generator=gen)
    p, s, g = nvfp4_quantize(w)
    prep = prepare_nvfp4_weight(p, s, g)
    assert torch.equal(dequantize_prepared(prep, torch.float32), nvfp4_dequantize(p, s, g, torch.float32))


# ------------------------------------------------------------------------------------------------
# Dense W4A16
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m", [1, 5, 32])
@pytest.mark.parametrize("n,k", [(64, 128), (128, 256)])
def test_dense_nvfp4_matches_reference(m, n, k):
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    w = _weight("nvfp4", n, k, gen)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEVICE)
    ref = w4a16_gemm_reference(x, w)
    for fp16 in (True, False):
        cfg = dot_heuristic_config("nvfp4", m, n, k)
        cfg = GemmConfig(**{**cfg.__dict__, "fp16_dot": fp16, "block_k": min(cfg.block_k, k)})
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)  # poison
        y = w4a16_gemm(x, w, out=out, config=cfg)
        assert y.shape == (m, n) and y.dtype == torch.bfloat16
        assert _rel(y, ref) < DENSE_TOL, (seed, cfg.short(), _rel(y, ref))


@pytest.mark.parametrize("cfg", [
    GemmConfig(16, 64, 64, split_k=2),                              # fused last-CTA split-K reduction
    GemmConfig(16, 64, 64, split_k=4, fused_reduce=False),          # two-kernel split-K reduction
    GemmConfig(32, 64, 128, swap=False, x_pre=True),                # large-M orientation, x converted once
    GemmConfig(64, 64, 64, swap=False, split_k=2, fp16_dot=False),  # bf16 path, non-swapped, split-K
    GemmConfig(16, 64, 64, split_k=2, tma=True),                    # TMA weight tiles, rows past N zero
    GemmConfig(32, 64, 128, swap=False, x_pre=True, tma=True),      # TMA, large-M orientation
], ids=lambda c: c.short())
def test_dense_config_variants(cfg):
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    m, n, k = 40, 96, 256  # N not a multiple of BLOCK_N, M not a multiple of BLOCK_M: masks exercised
    w = _weight("nvfp4", n, k, gen)
    x = torch.randn(2, m // 2, k, generator=gen).to(torch.bfloat16).to(DEVICE)  # 3-D input
    y = w4a16_gemm(x, w, config=cfg)
    assert y.shape == (2, m // 2, n)
    assert _rel(y, w4a16_gemm_reference(x, w)) < DENSE_TOL, (seed, cfg.short())
    y2 = w4a16_gemm(x, w, config=cfg)
    assert torch.equal(y, y2), "split-K reduction must be deterministic"


def test_tma_config_needs_aligned_codes():
    gen = torch.Generator().manual_seed(_seed())
    w = _weight("nvfp4", 64, 256, gen)
    x = torch.randn(4, 256, generator=gen).to(torch.bfloat16).to(DEVICE)
    with pytest.raises(ValueError, match="use a config with tma=False"):
        w4a16_gemm(x, w, config=GemmConfig(16, 64, 16, tma=True))     # 8-byte block rows: below TMA's 16


def test_dense_identity_reproduces_dequantized_weight():
    """x = I: y = W^T column by column, so the in-kernel dequant is checked element by element."""
    gen = torch.Generator().manual_seed(_seed())
    k, n = 64, 64
    w = _weight("nvfp4", n, k, gen, scale=0.3)
    eye = torch.eye(k, dtype=torch.bfloat16, device=DEVICE)
    wd = dequantize_prepared(w, torch.float32)  # exact fp32 values
    y16 = w4a16_gemm(eye, w, config=GemmConfig(64, 64, 64, fp16_dot=True))
    ybf = w4a16_gemm(eye, w, config=GemmConfig(64, 64, 64, fp16_dot=False))
    # bf16 path: bit-identical to the codec's bf16 dequant (same fp32 operation order). fp16 path: exact
    # code * s_block times s_global, one rounding in another order than the codec's code * (s_block *
    # s_global): within one bf16 ulp.
    ref = wd.t().to(torch.bfloat16)
    assert torch.equal(ybf, ref)
    assert torch.allclose(y16.float(), ref.float(), rtol=2.0 ** -7, atol=0)


# ------------------------------------------------------------------------------------------------
# Small-M CUDA-core GEMV (w4a16_gemv.py): interpreter = plain-integer decode path, GPU = inline PTX
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m,n,k,cfg", [
    (1, 64, 256, GemvConfig(block_n=32, groups=4, split_k=2)),                       # fused split-K
    (3, 96, 512, GemvConfig(block_n=32, groups=8, split_k=2, block_m=2, prefetch=True)),  # 2 M chunks
    (5, 40, 128, GemvConfig(block_n=32, groups=1, split_k=3, block_m=4)),  # N % BN, an empty K split
    (2, 48, 128, GemvConfig(block_n=16, groups=1, split_k=1, block_m=2)),  # no split: direct bf16 store
], ids=lambda v: v.short() if isinstance(v, GemvConfig) else str(v))
def test_gemv_matches_reference(m, n, k, cfg):
    _check_configs(m, n, k, [cfg], deterministic=True)


def test_gemv_is_the_default_for_small_m_and_exact_on_identity():
    """Dispatch: NVFP4 at M = 1 goes to the CUDA-core GEMV (GemvConfig), M = 2..8 to the MMA GEMV when
    K % 128 == 0, M = 9..32 (and MXFP4) to the wgmma kernel, M >= 33 on a GPU to the Gluon kernel where
    K % 256 == 0 (shared-A), else from M = 48 (the interpreter has no Gluon path: the wgmma kernel); x =
    rows of I reproduce the dequantized weight (fp16 products of exact codes, one bf16 rounding)."""
    assert isinstance(heuristic_config("nvfp4", 1, 14336, 4096), GemvConfig)
    for m in (2, 3, 8):
        assert isinstance(heuristic_config("nvfp4", m, 14336, 4096), MmaGemvConfig)
    assert isinstance(heuristic_config("nvfp4", 2, 64, 96), GemmConfig)          # K % 128 != 0
    assert isinstance(heuristic_config("nvfp4", 9, 14336, 4096), GemmConfig)
    assert isinstance(heuristic_config("nvfp4", 32, 14336, 4096), GemmConfig)
    big = GluonGemmConfig if DEVICE == "cuda" else GemmConfig
    assert isinstance(heuristic_config("nvfp4", 33, 14336, 4096), big)
    assert isinstance(heuristic_config("nvfp4", 47, 14336, 4224), GemmConfig)   # K % 256 != 0: from 48
    assert isinstance(heuristic_config("nvfp4", 48, 14336, 4224), big)
    assert isinstance(heuristic_config("nvfp4", 48, 14336, 4096), big)
    assert isinstance(heuristic_config("nvfp4", 128, 14336, 4096), big)
    assert isinstance(heuristic_config("mxfp4", 128, 14336, 4096), GemmConfig)
    assert isinstance(heuristic_config("mxfp4", 1, 14336, 4096), GemmConfig)
    assert any(isinstance(c, GemvConfig) for c in candidate_configs("nvfp4", 4, 4096, 7168))
    gen = torch.Generator().manual_seed(_seed())
    k, n = 64, 32
    w = _weight("nvfp4", n, k, gen, scale=0.3)
    wd = dequantize_prepared(w, torch.float32)
    eye = torch.eye(k, dtype=torch.bfloat16, device=DEVICE)[[0, 17, 40]]   # 3 rows: low and high elements
    y = w4a16_gemm(eye, w, config=GemvConfig(block_n=32, groups=2, block_m=3))
    ref = wd.t()[[0, 17, 40]].to(torch.bfloat16)
    assert torch.allclose(y.float(), ref.float(), rtol=2.0 ** -7, atol=0)
    y1 = w4a16_gemm(torch.randn(1, k, generator=gen).to(torch.bfloat16).to(DEVICE), w)   # default path runs
    assert y1.shape == (1, n) and torch.isfinite(y1).all()


# bench shapes on the GPU only (inline PTX, real sizes): defined only there, so a CPU run collects nothing
if DEVICE == "cuda":
    @pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
    @pytest.mark.parametrize("k,n", [(4096, 14336), (7168, 4096)])
    def test_gemv_bench_shapes_gpu(k, n, m):
        """Every GEMV variant the autotuner may pick, at the bench shapes and M = 1..16, fresh random inputs."""
        _check_configs(m, n, k, [heuristic_config("nvfp4", m, n, k)] + [
            c for c in candidate_configs("nvfp4", m, n, k) if isinstance(c, GemvConfig)])


# ------------------------------------------------------------------------------------------------
# Small-M register-fragment MMA GEMV (w4a16_mma_gemv.py): interpreter = per-lane dot products over the same
# step assignment and reductions, GPU = inline PTX decode + mma.sync
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m,n,k,cfg", [
    (1, 40, 256, MmaGemvConfig(row_tiles=1, num_warps=2)),                # N % 16, rows past N masked
    (3, 64, 512, MmaGemvConfig(row_tiles=2, num_warps=2, split_k=2)),     # fused split-K, 32-row blocks
    (11, 48, 384, MmaGemvConfig(row_tiles=1, num_warps=4, split_k=3)),    # two token tiles, idle warps
    (16, 33, 256, MmaGemvConfig(row_tiles=2, num_warps=1)),               # M = 16, a partial row block
    (8, 32, 1024, MmaGemvConfig(row_tiles=1, num_warps=8, split_k=2)),    # 8 warps, cross-warp sums
], ids=lambda v: v.short() if isinstance(v, MmaGemvConfig) else str(v))
def test_mma_gemv_matches_reference(m, n, k, cfg):
    _check_configs(m, n, k, [cfg], deterministic=True)


def test_mma_gemv_exact_on_identity_and_refuses_bad_shapes():
    """x = rows of I give the dequantized weight rows (exact fp16 products, fp32 sums, one bf16 rounding);
    M > 16 and K % 128 != 0 are refused with the alternative named."""
    gen = torch.Generator().manual_seed(_seed())
    k, n = 256, 48
    w = _weight("nvfp4", n, k, gen, scale=0.3)
    wd = dequantize_prepared(w, torch.float32)
    pick = [0, 17, 40, 127, 130, 255]                       # low and high elements of several groups and steps
    eye = torch.eye(k, dtype=torch.bfloat16, device=DEVICE)[pick]
    y = w4a16_gemm(eye, w, config=MmaGemvConfig(row_tiles=2, num_warps=2, split_k=2))
    ref = wd.t()[pick].to(torch.bfloat16)
    assert torch.allclose(y.float(), ref.float(), rtol=2.0 ** -7, atol=0)
    out = torch.empty(17, n, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="M = 1..16"):
        launch_mma_gemv(torch.zeros(17, k, dtype=torch.bfloat16, device=DEVICE), w, MmaGemvConfig(), out)
    w96 = _weight("nvfp4", n, 96, gen)
    with pytest.raises(ValueError, match="multiple of 128"):
        launch_mma_gemv(torch.zeros(1, 96, dtype=torch.bfloat16, device=DEVICE), w96, MmaGemvConfig(), out[:1])
    assert any(isinstance(c, MmaGemvConfig) for c in candidate_configs("nvfp4", 4, 4096, 7168))
    assert not any(isinstance(c, MmaGemvConfig) for c in candidate_configs("mxfp4", 4, 4096, 7168))


if DEVICE == "cuda":
    @pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 16])
    @pytest.mark.parametrize("k,n", [(4096, 14336), (7168, 4096)])
    def test_mma_gemv_bench_shapes_gpu(k, n, m):
        """Every MMA GEMV variant the autotuner may pick, at the bench shapes, fresh random inputs."""
        _check_configs(m, n, k, [c for c in candidate_configs("nvfp4", m, n, k) if isinstance(c, MmaGemvConfig)])


# ------------------------------------------------------------------------------------------------
# Mid-M Gluon register-A wgmma (w4a16_gluon_gemm.py): CPU = the index algebra (activation permutation,
# A-fragment reorder, scales) through `emulate`; GPU = the Gluon kernel itself
# ------------------------------------------------------------------------------------------------
def test_gluon_index_algebra_reproduces_the_reference():
    """The kernel's K reorder (A_PERM on the weights, permute_x on the activations) must pair every weight
    with its own activation: the emulation equals the dequantize-then-matmul reference, and the same
    emulation with the activations left in physical order does not (the check can fail)."""
    from megatron_qrl.kernels import w4a16_gluon_gemm as G

    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    m, n, k = 7, 48, 256
    w = _weight("nvfp4", n, k, gen)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEVICE)
    ref = w4a16_gemm_reference(x, w)
    assert _rel(G.emulate(x, w), ref) < DENSE_TOL, seed
    idx = G.logical_from_physical()
    assert sorted(idx.tolist()) == list(range(G.STEP_K)) and idx.tolist() != list(range(G.STEP_K))
    xp = G.permute_x(x)                                            # the Triton kernel (interpreter on CPU)
    want = (x.view(m, k // 64, 64)[:, :, idx.to(x.device)].reshape(m, k).float() / 256).to(torch.float16)
    assert torch.equal(xp, want)
    unpermuted = x.view(m, k // 64, 64)[:, :, torch.argsort(idx).to(x.device)].reshape(m, k)
    assert _rel(G.emulate(unpermuted, w), ref) > 0.5, "a wrong K pairing must show"


def test_gluon_shared_a_bf16_decode_is_exact():
    """The shared-A kernel's bf16 bit decode (codes into bf16 bits, scale bytes re-read as bf16 and times
    2^127) gives dequant(W) / s_global * 2^-106 bit for bit, subnormal codes and zero scales included; a
    wrong shift must show."""
    from megatron_qrl.kernels import w4a16_gluon_gemm as G
    from megatron_qrl.kernels.layouts import prepare_nvfp4_weight

    gen = torch.Generator().manual_seed(_seed())
    n, k = 32, 256
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)   # every code value
    scales = (torch.rand(n, k // 16, generator=gen) * 400).to(torch.float8_e4m3fn)
    scales[0, :3] = 0.0                                                  # zero blocks
    scales[1, :] = torch.tensor(2.0 ** -9).to(torch.float8_e4m3fn)      # the smallest E4M3 subnormal
    w = prepare_nvfp4_weight(packed, scales, torch.tensor(0.37))
    a = G.emulate_ss_weight(w)
    table = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    codes = torch.stack((packed & 15, packed >> 4), -1).view(n, k).long()
    exact = table[codes] * scales.float().repeat_interleave(16, 1)     # dequant(W) / s_global, exact
    assert torch.equal(a.float() * 2.0 ** 106, exact)
    got = a.float() * 2.0 ** 106 * float(w.global_scale) / G.NVFP4_GLOBAL_FOLD
    want = w4a16_gemm_reference(torch.eye(k, dtype=torch.bfloat16), w).float().t()   # dequant(W) [N, K]
    assert torch.equal(got.to(torch.bfloat16), want.to(torch.bfloat16))
    assert G.SS_ACC_FACTOR == 2.0 ** 84
    wrong = ((w.qweight.to(torch.int32) << 8) & 0x8E00) >> 2             # a shift of 2 instead of 3
    assert not torch.equal((((wrong | (wrong >> 2)) & 0x81C0).to(torch.int16)).view(torch.bfloat16),
                           a.view(n, k // 32, 2, 16)[:, :, 0, :].reshape(n, k // 2))


def _shared_a_protocol_faults(stages: int, a_stages: int, decoders: int, n_steps: int,
                              decoder_waits_empty: bool, seed: int) -> list:
    """One random interleaving of the shared-A kernel's protocol (_w4a16_gluon_ss_kernel): the producer,
    the decoders and the MMA warpgroup as sequences of mbarrier waits and arrives over the TMA ring
    (`stages`: ready, empty) and the A ring (`a_stages`: a_ready, a_empty), and TMA loads that land in any
    order. A parity wait passes as on the hardware (the barrier's count of completed phases has the other
    parity). Returns the faults: a wait that passed before the phase it meant had completed, or a
    deadlock."""
    import random
    rng = random.Random(seed)
    ring = {"ready": stages, "empty": stages, "a_ready": a_stages, "a_empty": a_stages}
    done = {(b, s): 0 for b, n in ring.items() for s in range(n)}   # completed phases per barrier

    def wait(bar, i, released=False):      # the release form (producer-style) or the consumers' form
        lap = i // ring[bar]
        return ("wait", bar, i % ring[bar], (lap & 1) ^ 1 if released else lap & 1,
                lap - 1 if released else lap)

    def producer():
        for i in range(n_steps):
            yield wait("empty", i, released=True)
            yield ("load", i % stages)                         # three TMA copies, landing later

    def decoder(d):
        for i in range(d, n_steps, decoders):
            if decoder_waits_empty:
                yield wait("empty", i, released=True)
            yield wait("ready", i)
            yield wait("a_empty", i, released=True)
            yield ("arrive", "a_ready", i % a_stages)

    def mma():
        for i in range(n_steps):
            yield wait("ready", i)
            yield wait("a_ready", i)
            if i > 0:                                          # wgmma i issued, i - 1 finished
                yield ("arrive", "empty", (i - 1) % stages)
                yield ("arrive", "a_empty", (i - 1) % a_stages)

    roles = {name: (gen, next(gen)) for name, gen in
             [("producer", producer()), ("mma", mma())] + [(f"decoder{d}", decoder(d)) for d in range(decoders)]}
    landing, faults = [], []
    while roles or landing:
        ready_roles = [n for n, (_, req) in roles.items()
                       if req[0] != "wait" or done[req[1], req[2]] % 2 != req[3]]
        if landing and (not ready_roles or rng.random() < 0.3):    # a pending load lands, in any order
            done["ready", landing.pop(rng.randrange(len(landing)))] += 1
            continue
        if not ready_roles:
            return faults + [f"deadlock: {sorted((n, r) for n, (_, r) in roles.items())}"]
        name = rng.choice(ready_roles)
        gen, req = roles[name]
        if req[0] == "wait" and done[req[1], req[2]] != req[4] + 1:
            faults.append(f"{name}: {req[1]}[{req[2]}] wait for phase {req[4]} passed after "
                          f"{done[req[1], req[2]]} completed phases")
        elif req[0] == "load":
            landing.append(req[1])
        elif req[0] == "arrive":
            done[req[1], req[2]] += 1
        try:
            roles[name] = (gen, next(gen))
        except StopIteration:
            del roles[name]
    return faults


@pytest.mark.parametrize("stages,a_stages,decoders", [(5, 5, 2), (5, 5, 3), (4, 4, 3), (6, 6, 2), (6, 6, 3),
                                                      (5, 5, 1), (7, 4, 3), (8, 3, 2), (6, 5, 3), (8, 4, 2)])
def test_gluon_shared_a_stage_protocol_has_no_early_wait(stages, a_stages, decoders):
    """The decoders wait on `empty` before `ready` (_ss_decoder). Without that wait a decoder that skips
    steps can reach a stage whose `ready` is still in the previous lap's phase, and its parity wait passes
    at once (stale codes; `a_ready` completed twice, the MMA's wait never returns: the hang measured on the
    H200, GS128x128/s5/sk4/d3, when A tiles shared the TMA stages). The model finds such interleavings of
    the unguarded protocol whenever the decoder count does not divide the stage count; with the wait, no
    run in the same sample passes a wait early or deadlocks, for the shared ring and the separate A ring."""
    seeds = range(200)
    old = [f for s in seeds for f in _shared_a_protocol_faults(stages, a_stages, decoders, 28, False, s)]
    new = [f for s in seeds for f in _shared_a_protocol_faults(stages, a_stages, decoders, 28, True, s)]
    assert new == []
    if a_stages < stages:   # a short A ring also bounds how far a decoder runs ahead: no negative control
        return
    if stages % decoders:
        assert any("ready" in f and "passed after" in f for f in old), "the model should find the early pass"
    else:   # each stage's laps all fall to one decoder, which waited on the previous lap itself
        assert old == []


def test_gluon_shared_a_ring_needs_a_tile_per_decoder():
    """Fewer A tiles than decoders: a decoder can wait on an A tile's release while that tile is two laps
    behind, and the parity wait passes early; _check_ss refuses such configs."""
    faults = [f for s in range(200) for f in _shared_a_protocol_faults(8, 2, 3, 28, True, s)]
    assert any("a_empty" in f for f in faults)


def test_gluon_config_choices_and_refusals():
    from megatron_qrl.kernels import w4a16_gluon_gemm as G

    for m in (17, 128, 300):
        cands = G.gluon_candidates(m, 4096, 7168)
        assert cands and all(c.block_m in (32, 128, 256) and c.block_m >= min(m, 128 if c.decoders else 256)
                             for c in cands)
    assert {c.block_n for c in G.gluon_candidates(128, 14336, 4096)} == {64, 128, 192, 256}
    assert not any(c.ws for c in G.gluon_candidates(128, 4096, 4160))           # odd step count: no pairs
    assert not G.default_gluon_config(128, 4096, 4160).ws
    assert any(c.ws for c in G.gluon_candidates(128, 14336, 4096))
    assert any(c.split_k > 1 for c in G.gluon_candidates(128, 4096, 7168))    # 16 wide row tiles: split K
    assert all(c.split_k == 1 for c in G.gluon_candidates(512, 14336, 4096) if c.block_n == 64)  # 448 tiles
    ws = dict(ws=True, ctas_per_sm=1)
    assert G.default_gluon_config(128, 14336, 4096) == GluonGemmConfig(128, 128, 6, 1, 4, decoders=3, a_stages=5)  # 112
    assert G.default_gluon_config(128, 4096, 7168) == GluonGemmConfig(128, 128, 6, 4, 4, decoders=3, a_stages=5)  # 128
    assert G.default_gluon_config(64, 4096, 7168) == GluonGemmConfig(128, 64, 6, 4, 4, decoders=3, a_stages=6)
    assert G.default_gluon_config(128, 4096, 4224) == GluonGemmConfig(128, 128, 6, 4, 4, **ws)  # K % 256
    # above 128 tokens: shared-A while its 128-token tiles fit in one wave (32 row tiles), else register-A
    assert G.default_gluon_config(256, 4096, 7168) == GluonGemmConfig(128, 128, 6, 2, 4, decoders=3, a_stages=5)
    assert G.default_gluon_config(512, 4096, 7168) == GluonGemmConfig(128, 128, 6, 1, 4, decoders=3, a_stages=5)
    assert G.default_gluon_config(1024, 4096, 7168) == GluonGemmConfig(128, 256, 6, 1, 4, **ws, pipelined=True)
    assert G.default_gluon_config(256, 14336, 4096) == GluonGemmConfig(128, 256, 6, 1, 4, **ws, pipelined=True)
    assert G.default_gluon_config(256, 4096, 4224) == GluonGemmConfig(128, 256, 6, 4, 4, **ws)  # K % 256
    assert G.ws_registers(2, 1) == (168, 240) and G.ws_registers(4, 1) == (96, 112)
    for m, n, k in ((128, 14336, 4096), (256, 4096, 7168), (512, 4096, 7168), (256, 14336, 4096)):
        assert G.default_gluon_config(m, n, k) in G.gluon_candidates(m, n, k)
    assert not G.supported("mxfp4", 128, 4096) and not G.supported("nvfp4", 128, 96)
    gen = torch.Generator().manual_seed(_seed())
    w4 = _weight("nvfp4", 256, 128, gen)
    if DEVICE == "cuda":
        with pytest.raises(ValueError, match="too few"):
            G.launch_gluon_gemm(torch.zeros(64, 128, dtype=torch.bfloat16, device=DEVICE), w4,
                                G.GluonGemmConfig(256, 64, 3, 1, 4, ws=True, ctas_per_sm=2),
                                torch.empty(64, 256, dtype=torch.bfloat16, device=DEVICE))
    ss = [c for c in G.gluon_candidates(128, 14336, 4096) if c.decoders]
    assert {(c.block_n, c.decoders) for c in ss} == {(128, 2), (128, 3), (64, 2)}
    assert all(c.block_m == 128 for c in ss)
    assert {(c.block_n, c.split_k) for c in G.gluon_candidates(128, 4096, 7168) if c.decoders} == {(128, 4), (64, 2)}
    assert all(G.ss_stages_fit(c.block_n, c.block_m, c.stages, G.ss_a_stages(c))
               for c in G.gluon_candidates(64, 4096, 7168) if c.decoders)
    assert all(c.block_m == 128 for c in G.gluon_candidates(512, 4096, 7168) if c.decoders)
    assert not any(c.decoders for c in G.gluon_candidates(128, 4096, 4160))    # TMA scale rows: K % 256
    assert G.ss_registers(2, 128) == (128, 128) and G.ss_registers(1, 64) == (168, 96)
    assert G.ss_registers(3, 128) == (96, 96)
    assert not G.ss_stages_fit(128, 128, 8, 4) and G.ss_stages_fit(128, 128, 7, 4)
    assert G._ss_rings(128, 128) == (6, 5) and G._ss_rings(128, 64) == (6, 6)
    if DEVICE == "cuda":
        for bad, k_bad in ((GluonGemmConfig(128, 64, 3, 1, 4, ws=True, pipelined=True), 256),
                           (GluonGemmConfig(128, 64, 6, 1, 4, ws=True, pipelined=True), 384)):
            with pytest.raises(ValueError, match="stages >= 4 and K % 256"):
                G.launch_gluon_gemm(torch.zeros(64, k_bad, dtype=torch.bfloat16, device=DEVICE),
                                    _weight("nvfp4", 128, k_bad, gen), bad,
                                    torch.empty(64, 128, dtype=torch.bfloat16, device=DEVICE))
    assert any(c.pipelined for c in G.gluon_candidates(128, 14336, 4096))
    for bad, why in ((GluonGemmConfig(256, 64, 4, 1, 4, decoders=2), "block_n = 64 or 128"),
                     (GluonGemmConfig(128, 64, 4, 1, 4, decoders=4), "1-3"),
                     (GluonGemmConfig(128, 256, 2, 1, 4, decoders=2), "accumulators"),
                     (GluonGemmConfig(128, 128, 8, 1, 4, decoders=2, a_stages=4), "shared memory"),
                     (GluonGemmConfig(128, 128, 6, 1, 4, decoders=3, a_stages=2), "one tile per decoder")):
        with pytest.raises(ValueError, match=why):
            G._check_ss(bad, 4096)
    with pytest.raises(ValueError, match="K % 256"):
        G._check_ss(GluonGemmConfig(128, 128, 4, 1, 4, decoders=2), 4160)
    w = _weight("mxfp4", 64, 128, gen)
    with pytest.raises(ValueError, match="NVFP4"):
        G.launch_gluon_gemm(torch.zeros(32, 128, dtype=torch.bfloat16, device=DEVICE), w, G.GluonGemmConfig(),
                            torch.empty(32, 64, dtype=torch.bfloat16, device=DEVICE))


def test_offline_compile_tool_reads_back_every_bench_name():
    """tools/compile_gluon_sm90.py takes the bench's config names: every shared-A and warp-specialized
    candidate's name parses back to the same config (so what is compiled offline is what the bench ran)."""
    import importlib.util
    from pathlib import Path

    from megatron_qrl.kernels import w4a16_gluon_gemm as G
    spec = importlib.util.spec_from_file_location(
        "compile_gluon_sm90", Path(__file__).resolve().parents[1] / "tools" / "compile_gluon_sm90.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    cands = [c for m, n, k in ((64, 14336, 4096), (128, 4096, 7168), (512, 14336, 4096))
             for c in G.gluon_candidates(m, n, k) if c.decoders or c.ws]
    assert any(c.pipelined for c in cands) and any(c.decoders for c in cands)
    for cfg in cands:
        assert tool.parse_cfg(cfg.short()) == cfg, cfg.short()
    with pytest.raises(SystemExit, match="expected GS"):
        tool.parse_cfg("G64x128/s2/sk1/w4")


def test_gluon_build_failure_falls_back_to_the_wgmma_kernel(monkeypatch):
    """A library-chosen Gluon config that does not build (another Triton) warns once, runs the Triton
    wgmma kernel with the right result, and takes Gluon out of the defaults; an explicit config still
    raises. Forced here by a launcher that raises Triton's compile error."""
    import triton

    from megatron_qrl.kernels import w4a16_gemm as D

    def broken(*a, **kw):
        raise triton.CompilationError("kernel.py", None, "unsupported Gluon op")

    monkeypatch.setattr(D, "launch_gluon_gemm", broken)
    monkeypatch.setattr(D, "_GLUON_BROKEN", False)
    gen = torch.Generator().manual_seed(_seed())
    m, n, k = 64, 64, 256
    w = _weight("nvfp4", n, k, gen)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEVICE)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    with pytest.warns(UserWarning, match="Gluon kernel does not build"):
        D._launch_default(x, w, GluonGemmConfig(128, 64, 6, 1, 4, ws=True), out)
    assert _rel(out, w4a16_gemm_reference(x, w)) < DENSE_TOL
    assert D._GLUON_BROKEN and isinstance(heuristic_config("nvfp4", 128, 14336, 4096), GemmConfig)
    with pytest.raises(triton.CompilationError):
        w4a16_gemm(x, w, config=GluonGemmConfig(128, 64, 6, 1, 4, ws=True))


if DEVICE == "cuda":
    @pytest.mark.parametrize("m,n,k,cfg", [
        (128, 192, 512, GluonGemmConfig(64, 128, 3, 1, 4)),
        (100, 200, 1024, GluonGemmConfig(64, 128, 4, 2, 4)),    # partial row and token tiles, split-K 2
        (33, 256, 768, GluonGemmConfig(256, 64, 3, 5, 16)),     # four warpgroups, uneven split-K 5
        (200, 136, 512, GluonGemmConfig(128, 128, 3, 1, 4)),    # 128 rows on one warpgroup, 2 token tiles
        (300, 64, 256, GluonGemmConfig(64, 128, 4, 1, 4)),      # three token tiles, fewer steps than stages
        (128, 256, 512, GluonGemmConfig(128, 128, 3, 1, 4, ws=True)),   # producer warp + 2 consumers
        (100, 200, 1024, GluonGemmConfig(192, 128, 6, 3, 4, ws=True)),  # 3 consumers, partial tiles, split 3
        (33, 256, 768, GluonGemmConfig(256, 64, 3, 5, 4, ws=True)),     # 4 consumers, uneven split-K 5
        (300, 128, 256, GluonGemmConfig(128, 256, 3, 1, 4, ws=True)),   # 256-token tiles, 4 steps
        (128, 256, 1024, GluonGemmConfig(128, 128, 6, 1, 4, ws=True, pipelined=True)),  # pipelined consumers
        (100, 200, 1024, GluonGemmConfig(128, 128, 4, 3, 4, ws=True, pipelined=True)),  # partial, an empty split
        (300, 128, 256, GluonGemmConfig(128, 256, 4, 1, 4, ws=True, pipelined=True)),   # 256 tokens, 4 steps
        (33, 192, 768, GluonGemmConfig(64, 64, 6, 1, 4, ws=True, pipelined=True)),      # one consumer, 12 steps
        (128, 256, 768, GluonGemmConfig(128, 128, 5, 1, 4, decoders=2)),  # shared A: 12 steps over 5 stages
        (100, 200, 1280, GluonGemmConfig(128, 128, 4, 3, 4, decoders=1)),  # partial tiles, 20 steps, split 3
        (33, 320, 768, GluonGemmConfig(128, 64, 3, 5, 4, decoders=2)),   # 64-token tiles, uneven split-K 5
        (130, 136, 1792, GluonGemmConfig(128, 128, 5, 1, 4, decoders=3)),  # 3 decoders: 28 steps, 2 partial groups
        (128, 512, 4096, GluonGemmConfig(128, 128, 7, 1, 4, decoders=3, a_stages=4)),  # separate A ring: 7 + 4
        (64, 384, 2048, GluonGemmConfig(128, 64, 8, 2, 4, decoders=2, a_stages=3)),   # 8 + 3, split-K 2
        (300, 64, 256, GluonGemmConfig(64, 128, 6, 1, 4, decoders=1)),   # 3 token tiles, 4 steps < 6 stages
    ], ids=lambda v: v.short() if isinstance(v, GluonGemmConfig) else str(v))
    def test_gluon_gemm_matches_reference_gpu(m, n, k, cfg):
        _check_configs(m, n, k, [cfg], deterministic=True)

    @pytest.mark.parametrize("m", [32, 128, 512])
    @pytest.mark.parametrize("k,n", [(4096, 14336), (7168, 4096)])
    def test_gluon_gemm_bench_shapes_gpu(k, n, m):
        """Every Gluon variant the autotuner may pick, at the bench shapes, fresh random inputs."""
        _check_configs(m, n, k, gluon_candidates(m, n, k))


@pytest.mark.parametrize("m", [1, 32])
def test_dense_mxfp4_matches_reference(m):
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    n, k = 64, 256
    w = _weight("mxfp4", n, k, gen)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEVICE)
    y = w4a16_gemm(x, w)
    assert _rel(y, w4a16_gemm_reference(x, w)) < DENSE_TOL, seed


def test_dense_rejects_bad_inputs():
    gen = torch.Generator().manual_seed(_seed())
    w = _weight("nvfp4", 64, 128, gen)
    with pytest.raises(ValueError, match="K = 96"):
        w4a16_gemm(torch.zeros(1, 96, dtype=torch.bfloat16, device=DEVICE), w)


# ------------------------------------------------------------------------------------------------
# Grouped MoE
# ------------------------------------------------------------------------------------------------
def test_moe_align_sorts_and_pads_by_expert():
    gen = torch.Generator().manual_seed(_seed())
    e, t, k, bm = 5, 9, 2, 4
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(DEVICE)
    r = moe_align(ids, e, bm)
    sid = r.sorted_ids.cpu()
    be = r.block_expert.cpu()
    flat = ids.reshape(-1).cpu()
    real = sid[sid < t * k]
    assert sorted(real.tolist()) == list(range(t * k))           # every assignment exactly once
    for b in range(r.num_blocks):
        rows = sid[b * bm:(b + 1) * bm]
        rows = rows[rows < t * k]
        if be[b] < 0:
            assert rows.numel() == 0
        else:
            assert (flat[rows] == be[b]).all()                      # blocks hold one expert's rows
    assert r.num_blocks >= int(((torch.bincount(flat, minlength=e) + bm - 1) // bm).sum())


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("t", [1, 5, 32])
def test_moe_matches_per_expert_reference(fmt, t):
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    e, h, f, k = 4, 128, 64, 2
    w13, w2, x, ids, tw = _moe_case(fmt, e, h, f, k, t, gen)
    y = moe_w4a16(x, w13, w2, ids, tw)
    assert y.shape == (t, h) and y.dtype == torch.bfloat16
    assert _rel(y, moe_w4a16_reference(x, w13, w2, ids, tw)) < MOE_TOL, seed


def test_moe_block_m_32_and_bf16_path():
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    w13, w2, x, ids, tw = _moe_case("nvfp4", 4, 64, 64, 2, 20, gen)
    cfg = MoEConfig(block_m=32, block_n=64, block_k=64, fp16_dot=False)
    y = moe_w4a16(x, w13, w2, ids, tw, gate_up_config=cfg, down_config=cfg)
    assert _rel(y, moe_w4a16_reference(x, w13, w2, ids, tw)) < MOE_TOL, seed


def test_moe_block32_narrow_k_heuristic(monkeypatch):
    """32-row gate/up blocks take 128-wide K steps on the fp16 operand (x_pre) from BLOCK16_MAX_PER_EXPERT up to
    BLOCK32_NARROW_K_MAX_PER_EXPERT assignments per expert, 256-wide steps on bf16 x above, and compute the
    per-expert reference's MLP."""
    from megatron_qrl.kernels import moe_grouped_gemm as mg

    for per_expert in (16, 32, 48):                                                   # batch 256 / 512 / 768, top-8
        narrow = heuristic_moe_config(per_expert * 128, 128, 768, 2048, True)
        assert (narrow.block_m, narrow.block_k, narrow.x_pre) == (32, 128, True), per_expert
    assert heuristic_moe_config(49 * 128, 128, 768, 2048, True).block_m == 64
    monkeypatch.setattr(mg, "BLOCK32_NARROW_K_MAX_PER_EXPERT", 32.0)
    wide = heuristic_moe_config(40 * 128, 128, 768, 2048, True)                       # above the bound
    assert (wide.block_m, wide.block_k, wide.x_pre) == (32, 256, False)
    assert heuristic_moe_config(12 * 128, 128, 768, 2048, True).block_m == 16
    monkeypatch.setattr(mg, "BLOCK32_NARROW_K_MAX_PER_EXPERT", 0.0)
    assert heuristic_moe_config(16 * 128, 128, 768, 2048, True).block_k == 256        # off: wide K steps
    monkeypatch.setattr(mg, "BLOCK32_NARROW_K_MAX_PER_EXPERT", 24.0)
    monkeypatch.setattr(mg, "BLOCK16_MAX_PER_EXPERT", 8.0)
    gu = heuristic_moe_config(16 * 128, 128, 768, 2048, True)
    assert (gu.block_m, gu.block_k, gu.x_pre) == (32, 128, True)
    assert heuristic_moe_config(8 * 128, 128, 768, 2048, True).block_m == 16
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    w13, w2, x, ids, tw = _moe_case("nvfp4", 4, 128, 96, 2, 20, gen)    # 10 assignments per expert: 32-row blocks
    assert heuristic_moe_config(40, 4, 96, 128, True).block_m == 32
    y = moe_w4a16(x, w13, w2, ids, tw)
    assert _rel(y, moe_w4a16_reference(x, w13, w2, ids, tw)) < MOE_TOL, seed


def test_moe_tma_weight_tiles():
    """TMA weight tiles: F not a multiple of block_n (gate tiles run into up rows, never stored)."""
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    w13, w2, x, ids, tw = _moe_case("nvfp4", 4, 128, 96, 2, 20, gen)
    gu = MoEConfig(block_m=16, block_n=64, block_k=64, x_pre=True, tma=True)
    dn = MoEConfig(block_m=16, block_n=64, block_k=32, tma=True)
    y = moe_w4a16(x, w13, w2, ids, tw, gate_up_config=gu, down_config=dn)
    assert _rel(y, moe_w4a16_reference(x, w13, w2, ids, tw)) < MOE_TOL, seed


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_moe_sync_dots(fmt, monkeypatch):
    """sync_dots (each projection's dots wait for the MMAs in flight) changes when the MMAs are issued, not what
    they sum: the same output bits as the default kernel, with and without TMA tiles and the fp16 operand, on
    both projections, and the per-expert reference's MLP; the GEMV refuses it; the heuristic's tensor-core
    configs take it on the projections SYNC_DOTS names (as measured: gate/up). Byte-wise scale decoding
    (packed_scales=False), unrolled K loops (unroll=2 and 3: 2 and 3 K steps here, a remainder included) and
    persistent programs (each walking several tiles, blocks past the routing's end never visited) and a register
    cap give the same bits too; the GEMV refuses unroll, persistent and max_regs."""
    from megatron_qrl.kernels import moe_grouped_gemm as mg

    assert mg.SYNC_DOTS == {"gate_up": True, "down": False}
    assert heuristic_moe_config(16 * 128, 128, 768, 2048, True).sync_dots
    assert not heuristic_moe_config(16 * 128, 128, 2048, 768, False).sync_dots
    assert not heuristic_moe_config(16, 128, 768, 2048, True).sync_dots          # the GEMV
    monkeypatch.setitem(mg.SYNC_DOTS, "gate_up", False)
    assert not heuristic_moe_config(16 * 128, 128, 768, 2048, True).sync_dots
    assert mg.PERSISTENT_GATE_UP_BLOCK16 == 0 and heuristic_moe_config(8 * 128, 128, 768, 2048, True).persistent == 0
    monkeypatch.setattr(mg, "PERSISTENT_GATE_UP_BLOCK16", 5)
    assert heuristic_moe_config(8 * 128, 128, 768, 2048, True).persistent == 5       # 16-row gate/up blocks
    assert heuristic_moe_config(8 * 128, 128, 2048, 768, False).persistent == 0      # down
    assert heuristic_moe_config(16 * 128, 128, 768, 2048, True).persistent == 0      # 32-row blocks
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    w13, w2, x, ids, tw = _moe_case(fmt, 4, 128, 96, 2, 20, gen)
    ref = moe_w4a16_reference(x, w13, w2, ids, tw)
    for tma, x_pre in ((False, False), (True, True)):
        gu = MoEConfig(block_m=16, block_n=32, block_k=64, x_pre=x_pre, tma=tma)
        dn = MoEConfig(block_m=16, block_n=32, block_k=32, tma=tma)
        base = moe_w4a16(x, w13, w2, ids, tw, gate_up_config=gu, down_config=dn)
        for change in (dict(sync_dots=True), dict(packed_scales=False), dict(unroll=2), dict(unroll=3),
                       dict(persistent=1), dict(persistent=2, unroll=2), dict(max_regs=96)):
            other = moe_w4a16(x, w13, w2, ids, tw, gate_up_config=replace(gu, **change),
                              down_config=replace(dn, **change))
            assert torch.equal(other, base), (seed, change)
        assert _rel(base, ref) < MOE_TOL, seed
    with pytest.raises(ValueError, match="sync_dots"):
        moe_w4a16(x, w13, w2, ids, tw, gate_up_config=MoEConfig(block_m=1, block_n=32, block_k=128, num_stages=1,
                                                                gemv=True, sync_dots=True))
    with pytest.raises(ValueError, match="unroll"):
        moe_w4a16(x, w13, w2, ids, tw, gate_up_config=MoEConfig(block_m=1, block_n=32, block_k=128, num_stages=1,
                                                                gemv=True, unroll=2))
    with pytest.raises(ValueError, match="max_regs"):
        moe_w4a16(x, w13, w2, ids, tw, gate_up_config=MoEConfig(block_m=1, block_n=32, block_k=128, num_stages=1,
                                                                gemv=True, max_regs=96))
    with pytest.raises(ValueError, match="persistent"):
        moe_w4a16(x, w13, w2, ids, tw, gate_up_config=MoEConfig(block_m=1, block_n=32, block_k=128, num_stages=1,
                                                                gemv=True, persistent=4))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_moe_tile_major_stacks(fmt):
    """Tile-major expert stacks (each loop trip's tile_n x block_k weight tile one contiguous run of codes and one
    of scales) hold the same weights in another order: the inverse restores the stacks, a tile is the slice it
    stands for, the dequantized weights agree, and the kernel over them (tile_major=True) gives the same output
    bits as over the row-major stacks -- pointer and TMA tiles, unrolled and persistent, weight tiles of one and of
    two row tiles, the heuristic's configs, and the GEMV's. Configs and stacks that do not match, and the Gluon
    kernel, are refused."""
    from megatron_qrl.kernels.layouts import row_major_experts, tile_major_experts

    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    w13, w2, x, ids, tw = _moe_case(fmt, 4, 128, 96, 2, 20, gen)
    t13 = tile_major_experts(w13, 32, 64)
    back = row_major_experts(t13)
    assert t13.tile == (32, 64) and back.tile is None and t13.nbytes() == w13.nbytes()
    assert torch.equal(back.qweight, w13.qweight) and torch.equal(back.scales, w13.scales)
    sb = 64 // w13.block
    # expert 2, row tile 3 (the second up tile: rows 96..127), K step 1 of 2
    assert torch.equal(t13.qweight[2, (3 * 2 + 1) * 32:(3 * 2 + 2) * 32], w13.qweight[2, 96:128, 32:64])
    assert torch.equal(t13.scales[2, (3 * 2 + 1) * 32:(3 * 2 + 2) * 32], w13.scales[2, 96:128, sb:2 * sb])
    assert torch.equal(dequantize_prepared(t13, torch.float32), dequantize_prepared(w13, torch.float32))
    t2 = tile_major_experts(w2, 32, 32)
    for tma, x_pre in ((False, False), (True, True)):
        gu = MoEConfig(block_m=16, block_n=32, block_k=64, x_pre=x_pre, tma=tma)
        dn = MoEConfig(block_m=16, block_n=32, block_k=32, tma=tma)
        base = moe_w4a16(x, w13, w2, ids, tw, gate_up_config=gu, down_config=dn)
        for change in (dict(), dict(unroll=2), dict(persistent=2, sync_dots=True)):
            tiled = moe_w4a16(x, t13, t2, ids, tw, gate_up_config=replace(gu, tile_major=True, **change),
                              down_config=replace(dn, tile_major=True, **change))
            assert torch.equal(tiled, base), (seed, tma, change)
        mixed = moe_w4a16(x, t13, w2, ids, tw, gate_up_config=replace(gu, tile_major=True), down_config=dn)
        assert torch.equal(mixed, base), (seed, tma)
        # weight tiles of two row tiles (down: 64 of 128 rows; gate/up: 64 rows of 96 gate rows, the second
        # program reading up rows it never stores)
        gu64, dn64 = replace(gu, block_n=64), replace(dn, block_n=64)
        base64 = moe_w4a16(x, w13, w2, ids, tw, gate_up_config=gu64, down_config=dn64)
        tiled64 = moe_w4a16(x, t13, t2, ids, tw, gate_up_config=replace(gu64, tile_major=True),
                            down_config=replace(dn64, tile_major=True))
        assert torch.equal(tiled64, base64), (seed, tma)
    # the heuristic over tile-major stacks: tensor-core configs of their K steps and whole row tiles, no GEMV
    cfg = heuristic_moe_config(16 * 128, 128, 768, 2048, True, tile=(64, 128))
    assert cfg.tile_major and (cfg.block_n, cfg.block_k) == (64, 128) and not cfg.gemv
    gemv = heuristic_moe_config(16, 128, 768, 2048, True, tile=(64, 128))
    assert gemv.gemv and gemv.tile_major and gemv == replace(heuristic_moe_config(16, 128, 768, 2048, True),
                                                             tile_major=True)
    auto = moe_w4a16(x, t13, t2, ids, tw)
    h_gu = heuristic_moe_config(ids.numel(), 4, 96, 128, True, fmt, tile=t13.tile)
    h_dn = heuristic_moe_config(ids.numel(), 4, 128, 96, False, fmt, tile=t2.tile)
    assert torch.equal(auto, moe_w4a16(x, w13, w2, ids, tw, gate_up_config=replace(h_gu, tile_major=False),
                                       down_config=replace(h_dn, tile_major=False))), seed
    gu = MoEConfig(block_m=16, block_n=32, block_k=64)
    dn = MoEConfig(block_m=16, block_n=32, block_k=32)
    with pytest.raises(ValueError, match="tile-major stacks"):        # tiled stacks, row-major config
        moe_w4a16(x, t13, w2, ids, tw, gate_up_config=gu, down_config=dn)
    with pytest.raises(ValueError, match="tile-major stacks"):        # row-major stacks, tile-major config
        moe_w4a16(x, w13, w2, ids, tw, gate_up_config=replace(gu, tile_major=True), down_config=dn)
    with pytest.raises(ValueError, match="tile-major stacks"):        # K steps other than the tile's
        moe_w4a16(x, t13, w2, ids, tw, gate_up_config=replace(gu, block_k=128, tile_major=True), down_config=dn)
    with pytest.raises(ValueError, match="tile-major stacks"):        # not whole row tiles
        moe_w4a16(x, t13, w2, ids, tw, gate_up_config=replace(gu, block_n=48, tile_major=True), down_config=dn)
    if fmt == "nvfp4":      # the GEMV over tile-major stacks: the same bits, a step over one or two K tiles
        xs, ids_s, tw_s = x[:3], ids[:3], tw[:3]      # (the interpreter runs the GEMV's programs slowly)
        for bk in (64, 128):
            g_gu = MoEConfig(block_m=1, block_n=32, block_k=bk, num_stages=1, gemv=True)
            g_dn = MoEConfig(block_m=1, block_n=32, block_k=32, num_stages=1, gemv=True)
            rm = moe_w4a16(xs, w13, w2, ids_s, tw_s, gate_up_config=g_gu, down_config=g_dn)
            tm = moe_w4a16(xs, t13, tile_major_experts(w2, 32, 32), ids_s, tw_s,
                           gate_up_config=replace(g_gu, tile_major=True), down_config=replace(g_dn, tile_major=True))
            assert torch.equal(tm, rm), (seed, bk)
        with pytest.raises(ValueError, match="multiple of the tile"):  # a step inside one K tile
            moe_w4a16(x, t13, w2, ids, tw, gate_up_config=MoEConfig(block_m=1, block_n=32, block_k=32,
                                                                   num_stages=1, gemv=True, tile_major=True))
    with pytest.raises(ValueError, match="tile-major stacks"):        # the Gluon kernel reads row-major stacks
        moe_w4a16(x, t13, w2, ids, tw, gate_up_config=replace(gu, gluon=True, tile_major=True), down_config=dn)
    with pytest.raises(ValueError, match="whole gate and up tiles"):  # 96 gate rows in 64-row tiles
        moe_w4a16(x, tile_major_experts(w13, 64, 64), w2, ids, tw,
                  gate_up_config=replace(gu, block_n=64, tile_major=True), down_config=dn)
    with pytest.raises(ValueError, match="does not divide"):
        tile_major_experts(w2, 48, 32)
    with pytest.raises(ValueError, match="row-major expert stacks"):
        tile_major_experts(t13, 32, 64)


def test_moe_takes_a_precomputed_fp16_operand():
    """x_operand (to_fp16_operand of x, which the decode step's norm writes in its own launch) replaces the
    gate/up conversion launch where the config converts its input, with the same output bits; a config that
    does not convert ignores it."""
    from megatron_qrl.kernels.moe_grouped_gemm import converts_input, to_fp16_operand

    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    w13, w2, x, ids, tw = _moe_case("nvfp4", 4, 128, 96, 2, 20, gen)
    op = to_fp16_operand(x)
    pre = MoEConfig(block_m=16, block_n=64, block_k=64, x_pre=True)
    dn = MoEConfig(block_m=16, block_n=64, block_k=32)
    for gu in (pre, MoEConfig(block_m=16, block_n=64, block_k=64)):
        y = moe_w4a16(x, w13, w2, ids, tw, gate_up_config=gu, down_config=dn)
        assert torch.equal(moe_w4a16(x, w13, w2, ids, tw, gate_up_config=gu, down_config=dn, x_operand=op), y)
    assert converts_input(pre, "nvfp4") and not converts_input(pre, "mxfp4")
    with pytest.raises(ValueError, match="x_operand"):
        moe_w4a16(x, w13, w2, ids, tw, gate_up_config=pre, down_config=dn, x_operand=op[:5])


@pytest.mark.parametrize("block_m,block_n,block_k", [(1, 64, 128), (2, 32, 64), (2, 64, 256)])
def test_moe_gemv_matches_per_expert_reference(block_m, block_n, block_k):
    """The CUDA-core path: experts with 0, 1 and several tokens (block_m=2 pads odd runs), F not a multiple
    of block_n (masked columns), K steps of 64-256; both projections on the GEMV."""
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    e, h, f, k = 6, 256, 96, 2
    w13, w2, x, ids, tw = _moe_case("nvfp4", e, h, f, k, 5, gen, favour_expert0=True)
    gu = MoEConfig(block_m=block_m, block_n=block_n, block_k=block_k, num_stages=1, gemv=True)
    dn = MoEConfig(block_m=block_m, block_n=block_n, block_k=32, num_stages=1, gemv=True)   # K = F = 96
    y = moe_w4a16(x, w13, w2, ids, tw, gate_up_config=gu, down_config=dn)
    assert _rel(y, moe_w4a16_reference(x, w13, w2, ids, tw)) < MOE_TOL, seed
    # the default at <= 1 assignment per expert is the GEMV (3 tokens x top-2 over 6 experts)
    assert heuristic_moe_config(3 * k, e, f, h, True).gemv and heuristic_moe_config(3 * k, e, h, f, False).gemv
    assert _rel(moe_w4a16(x[:3], w13, w2, ids[:3], tw[:3]),
                moe_w4a16_reference(x[:3], w13, w2, ids[:3], tw[:3])) < MOE_TOL, seed


def test_moe_gemv_dispatch_rules():
    # NVFP4 decode batches go to the CUDA-core kernel; more tokens per expert, or MXFP4, to the tensor cores
    assert heuristic_moe_config(16 * 8, 128, 768, 2048, True).block_m == 1
    assert not heuristic_moe_config(32 * 8, 128, 768, 2048, True).gemv
    assert not heuristic_moe_config(8 * 8, 128, 768, 2048, True, "mxfp4").gemv
    gen = torch.Generator().manual_seed(_seed())
    w = _experts("mxfp4", 2, 64, 64, gen)
    from megatron_qrl.kernels.moe_gemv import launch_moe_gemv
    r = moe_align(torch.zeros(1, 1, dtype=torch.long, device=DEVICE), 2, 1)
    with pytest.raises(ValueError, match="NVFP4 expert stack"):
        launch_moe_gemv(torch.zeros(1, 64, dtype=torch.bfloat16, device=DEVICE), w,
                        torch.empty(1, 64, dtype=torch.bfloat16, device=DEVICE), r, None, False, 64, 2, 4, True)


