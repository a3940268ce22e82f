"""Triton FP4 codec kernels (kernels/fp4_quant.py, kernels/fp4_fake_quant.py) against the torch reference.

Every check asserts byte-for-byte equality: packed codes, E4M3/E8M0 scales (as uint8), TRACE bits, and the
fake-quant outputs compared as raw bits (so -0.0 vs 0.0 counts).

How they run: Triton decides between compiling and interpreting when a kernel module is imported, so the
checks run in ONE child process (this file executed as a script) whose environment has
TRITON_INTERPRET=1 set before anything imports triton; each pytest test then reports one check's result.
On a GPU machine set QRL_KERNEL_TEST_DEVICE=cuda: the child then runs without the interpreter on CUDA
tensors and adds large random inputs (tools/gpu_codec.sh does this).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback

import pytest

CHECKS: dict = {}
DTYPES = ("float32", "float16", "bfloat16")


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


# ----------------------------------------------------------------------------------------------------------
# Inputs (built in the child; torch is imported lazily)
# ----------------------------------------------------------------------------------------------------------
def _families(torch, dtype, rows=64, cols=256, seed=0):
    """Named inputs of shape [rows, cols] in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    big = {torch.float16: 2.0 ** 4}.get(dtype, 2.0 ** 20)
    tiny = {torch.float16: 2.0 ** -14}.get(dtype, 2.0 ** -60)
    out = {}
    out["normal"] = torch.randn(rows, cols, generator=g)
    t = torch.distributions.StudentT(2.0).sample((rows, cols))
    out["heavy_tailed"] = t.clamp(-1e4, 1e4)
    x = torch.randn(rows, cols, generator=g)
    x[::7] *= 300.0                                   # outlier rows
    x[3, 5] = 5000.0                                  # one outlier element sets the global scale
    out["outliers"] = x
    x = torch.randn(rows, cols, generator=g)
    x[:, 32:64] = 0.0                                 # all-zero blocks
    x[10] = 0.0                                       # an all-zero row
    x[11, ::3] = -0.0                                 # negative zeros
    out["zero_blocks"] = x
    x = torch.randn(rows, cols, generator=g)
    x[:16] *= tiny                                    # blocks far below the global amax (scale clamps)
    x[16:20, :16] *= 1e-3
    out["tiny_blocks"] = x
    out["tiny_tensor"] = torch.randn(rows, cols, generator=g) * tiny * 8
    x = torch.randn(rows, cols, generator=g)
    x[0, 0] = big                                     # huge dynamic range within the tensor
    out["wide_range"] = x
    out["ties"] = _ties(torch, rows, cols, g, j=0 if dtype == torch.float16 else 3)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 3, rows)[:, None]
    out["row_scaled"] = x
    return {k: v.to(dtype) for k, v in out.items()}


def _ties(torch, rows, cols, g, j):
    """Values exactly on E2M1 midpoints (ties) and codewords: the global amax is 2688 * 2^j so s_global = 2^j,
    each block's amax is 6 * 2^(i+j) so its scale is exactly 2^i and every x / (s_block * s_global) is exact."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    nb = cols // 16
    i = torch.randint(-9, 8, (rows, nb, 1), generator=g).float()
    vals = mids[torch.randint(0, len(mids), (rows, nb, 16), generator=g)]
    sign = torch.where(torch.rand(rows, nb, 16, generator=g) < 0.5, -1.0, 1.0)
    vals = vals * sign
    vals[..., 0] = 6.0 * torch.where(torch.rand(rows, nb, generator=g) < 0.5, -1.0, 1.0)
    x = (vals * 2.0 ** (i + j)).reshape(rows, cols)
    x[0, 0] = 2688.0 * 2.0 ** j
    return x


def _bits(t):
    """Raw bit pattern (for exact comparisons of floats, signs of zero included)."""
    import torch
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    return t.contiguous().view(view)


def _assert_equal(a, b, what):
    import torch
    a, b = _bits(a).cpu(), _bits(b).cpu()
    if a.shape != b.shape:
        raise AssertionError(f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}")
    if not torch.equal(a, b):
        n = int((a != b).sum())
        idx = (a != b).nonzero()[0].tolist()
        raise AssertionError(f"{what}: {n} of {a.numel()} differ, first at {idx}: {a[tuple(idx)]} vs {b[tuple(idx)]}")


def _cmp_quant(got, ref, what):
    names = ("packed", "scales", "global_scale", "bits")
    for name, a, b in zip(names, got, ref):
        _assert_equal(a, b, f"{what} {name}")


# ----------------------------------------------------------------------------------------------------------
# Checks (each takes the device string)
# ----------------------------------------------------------------------------------------------------------
@check
def nvfp4_quantize_families(dev):
    import torch
    from megatron_qrl.kernels.fp4_quant import nvfp4_quantize_triton
    from megatron_qrl.quant import nvfp4_quantize
    for dt in DTYPES:
        for name, x in _families(torch, getattr(torch, dt)).items():
            x = x.to(dev)
            ref = nvfp4_quantize(x.cpu(), capture=True)
            _cmp_quant(nvfp4_quantize_triton(x, capture=True), ref, f"{dt}/{name}")
            if name == "outliers":
                got = nvfp4_quantize_triton(x)                   # without capture: same first three
                _cmp_quant(got, ref[:3], f"{dt}/{name} no-capture")


@check
def nvfp4_quantize_variants(dev):
    """The plain division / plain rounding / both tile orientations / launch shapes give the same bytes."""
    import torch
    from megatron_qrl.kernels.fp4_quant import nvfp4_quantize_triton
    from megatron_qrl.quant import nvfp4_quantize
    inputs = []
    for dt in ("float32", "bfloat16"):
        fam = _families(torch, getattr(torch, dt), rows=32, seed=1)
        inputs += [(f"{dt}/{name}", fam[name]) for name in ("outliers", "ties", "tiny_blocks")]
    combos = [dict(div=div, round_impl=rnd, rows_first=rb) for div in (0, 1) for rnd in (0, 1) for rb in (False, True)]
    combos += [dict(block_blocks=bb, num_warps=nw) for bb, nw in ((32, 1), (64, 2), (256, 8))]
    for i, kw in enumerate(combos):                      # every variant on two of the inputs, in turn
        for what, x in (inputs[i % len(inputs)], inputs[(i + 3) % len(inputs)]):
            ref = nvfp4_quantize(x, capture=True)
            _cmp_quant(nvfp4_quantize_triton(x.to(dev), capture=True, **kw), ref, f"{what} {kw}")


@check
def nvfp4_quantize_near_midpoints(dev):
    """fp32 inputs a few ulps around m * d for every E2M1 midpoint/codeword m: the division must be the
    correctly rounded one (the fast Markstein path and the per-element div_rn both)."""
    import torch
    from megatron_qrl.kernels.fp4_quant import nvfp4_quantize_triton
    from megatron_qrl.quant import nvfp4_quantize
    from megatron_qrl.quant.nvfp4 import nvfp4_block_scales, nvfp4_global_scale
    g = torch.Generator().manual_seed(5)
    rows, cols = 64, 256
    base = torch.rand(rows, cols // 16, 1, generator=g) * 10 + 0.01
    x = (torch.randn(rows, cols // 16, 16, generator=g).sign() * base).reshape(rows, cols)
    x = x * torch.logspace(-20, 20, rows)[:, None]
    gs = nvfp4_global_scale(x)
    d = (nvfp4_block_scales(x, gs).float() * gs).repeat_interleave(16, dim=-1)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 3.0, 4.0])
    m = mids[torch.randint(0, len(mids), (rows, cols), generator=g)]
    y = (m * d).float()
    k = torch.randint(-2, 3, (rows, cols), generator=g)
    for _ in range(2):
        y = torch.where(k > 0, torch.nextafter(y, torch.full_like(y, float("inf"))), y)
        y = torch.where(k < 0, torch.nextafter(y, torch.full_like(y, -float("inf"))), y)
        k = k - k.sign()
    keep = torch.zeros(rows, cols, dtype=torch.bool)
    keep[:, ::16] = True                                     # keep each block's amax element
    x = torch.where(keep, x, y * torch.sign(x))
    ref = nvfp4_quantize(x, gs, capture=True)
    assert torch.equal(nvfp4_block_scales(x, gs).view(torch.uint8), ref[1].view(torch.uint8))
    for div in (0, 1):
        _cmp_quant(nvfp4_quantize_triton(x.to(dev), gs.to(dev), capture=True, div=div), ref, f"div={div}")


@check
def nvfp4_quantize_shapes_and_scales(dev):
    """Leading dims, a non-contiguous input, a partial last tile, given and per-row global scales
    (including a too-small one that saturates and extreme ones that take the range-checked path)."""
    import torch
    from megatron_qrl.kernels.fp4_quant import nvfp4_quantize_triton
    from megatron_qrl.quant import nvfp4_quantize
    g = torch.Generator().manual_seed(2)
    cases = {
        "3d": torch.randn(2, 24, 96, generator=g),
        "non_contiguous": torch.randn(128, 48, generator=g).t(),           # [48, 128] with strides (1, 48)
        "partial_tile": torch.randn(3, 48, generator=g),
        "one_block": torch.randn(16, generator=g),
    }
    for name, x in cases.items():
        for dt in DTYPES:
            xd = x.to(getattr(torch, dt))
            _cmp_quant(nvfp4_quantize_triton(xd.to(dev), capture=True), nvfp4_quantize(xd, capture=True), f"{name}/{dt}")
    x = torch.randn(32, 128, generator=g) * 4
    for gs in (0.01, 1e-6, 3e-30, 1e25, 7.5):     # 0.01 / 1e-6 saturate; 3e-30 / 1e25 are outside the fast path
        gst = torch.tensor(gs)
        for dt in DTYPES:
            xd = x.to(getattr(torch, dt))
            _cmp_quant(nvfp4_quantize_triton(xd.to(dev), gst.to(dev), capture=True),
                       nvfp4_quantize(xd, gst, capture=True), f"given gs={gs}/{dt}")
    x = torch.randn(4, 6, 64, generator=g) * torch.logspace(-4, 4, 4)[:, None, None]
    gs = x.abs().amax(-1, keepdim=True) / 2688
    try:
        ref = nvfp4_quantize(x, gs, capture=True)
    except (ValueError, RuntimeError):
        ref = None                                      # a reference without per-row global scales
    if ref is not None:
        _cmp_quant(nvfp4_quantize_triton(x.to(dev), gs.to(dev), capture=True), ref, "per-row gs")


@check
def nvfp4_quantize_errors(dev):
    import torch
    from megatron_qrl.kernels.fp4_quant import nvfp4_quantize_triton
    for bad, err in ((torch.full((4, 32), float("nan")), "NaN"), (torch.tensor([[1.0] * 15 + [float("inf")]]), "NaN")):
        for gs in (None, torch.tensor(1.0)):
            try:
                nvfp4_quantize_triton(bad.to(dev), gs if gs is None else gs.to(dev))
            except ValueError as e:
                assert err in str(e), str(e)
            else:
                raise AssertionError("non-finite input was not rejected")
    for bad, exc, text in ((torch.zeros(4, 24), ValueError, "multiple of the block size 16"),
                           (torch.zeros(4, 32, dtype=torch.float64), TypeError, "not supported"),
                           (torch.zeros(0, 32), ValueError, "empty")):
        try:
            nvfp4_quantize_triton(bad.to(dev))
        except exc as e:
            assert text in str(e), str(e)
        else:
            raise AssertionError(f"{text}: no error")
    try:
        nvfp4_quantize_triton(torch.zeros(4, 32, device=dev), torch.ones(3, 1, device=dev))
    except ValueError as e:
        assert "one per row" in str(e)
    else:
        raise AssertionError("bad global_scale shape accepted")


@check
def mxfp4_quantize_families(dev):
    import torch
    from megatron_qrl.kernels.fp4_quant import mxfp4_quantize_triton
    from megatron_qrl.quant import mxfp4_quantize
    for dt in DTYPES:
        fam = _families(torch, getattr(torch, dt), rows=32, cols=256, seed=3)
        fam["subnormal_scales"] = (torch.randn(32, 256) * 2.0 ** -125).to(getattr(torch, dt))
        for name, x in fam.items():
            ref = mxfp4_quantize(x, capture=True)
            for rb in (False, True):
                got = mxfp4_quantize_triton(x.to(dev), capture=True, rows_first=rb)
                for nm, a, b in zip(("packed", "scales", "bits"), got, ref):
                    _assert_equal(a, b, f"mxfp4 {dt}/{name} rows_first={rb} {nm}")


def _guided_pairs(torch, dtype, seed):
    """(rollout x, trainer x): the trainer's activations differ slightly, as after other kernels."""
    fam = _families(torch, dtype, rows=32, cols=256, seed=seed)
    out = {}
    g = torch.Generator().manual_seed(seed + 100)
    for name in ("outliers", "zero_blocks", "ties", "tiny_blocks"):
        xr = fam[name]
        noise = 1 + 0.02 * torch.randn(xr.shape, generator=g)
        out[name] = (xr, (xr.float() * noise).to(dtype))
    return out


def _guided_grid(torch, seed):
    """(dtype name, family, rollout x, trainer x) for every dtype and guided-replay input family."""
    for dt in DTYPES:
        for name, (xr, xt) in _guided_pairs(torch, getattr(torch, dt), seed=seed).items():
            yield dt, name, xr, xt


def _guided_replay_matches(fake_quant, fmt, xt, guide, guide_dev, shift, label, **kwargs):
    """The kernel's TRACE replay of xt (guide_dev: the guide on the kernel's device) equals the reference's, with
    the same fallback stats; returns (the kernel's result, the reference's stats)."""
    from megatron_qrl.quant import quant_dequant
    st_got, st_ref = {}, {}
    got = fake_quant(xt.to(guide_dev.bits.device), guide_dev, fallback_shift=shift, stats=st_got, **kwargs)
    _assert_equal(got[0] if isinstance(got, tuple) else got,
                  quant_dequant(xt, fmt, guide=guide, fallback_shift=shift, stats=st_ref), label)
    assert st_got == st_ref, (st_got, st_ref)
    return got, st_ref


@check
def nvfp4_fake_quant(dev):
    """Nearest (computed or given scales) and guided replay, several fallback shifts; fallback counts."""
    import torch
    from megatron_qrl.kernels.fp4_fake_quant import nvfp4_fake_quant_triton
    from megatron_qrl.quant import GuidedRounding, nvfp4_dequantize, nvfp4_quantize, quant_dequant
    for dt, name, xr, xt in _guided_grid(torch, seed=7):
        _assert_equal(nvfp4_fake_quant_triton(xt.to(dev)), quant_dequant(xt, "nvfp4"), f"{dt}/{name} nearest")
        p, s, gs, b = nvfp4_quantize(xr, capture=True)
        _assert_equal(nvfp4_fake_quant_triton(xt.to(dev), scales=s.to(dev), global_scale=gs.to(dev)),
                      nvfp4_dequantize(*nvfp4_quantize(xt, gs, scales=s), dtype=xt.dtype),
                      f"{dt}/{name} nearest given scales")
        guide = GuidedRounding(bits=b, scales=s, global_scale=gs)
        guide_dev = GuidedRounding(bits=b.to(dev), scales=s.to(dev), global_scale=gs.to(dev))
        for shift in ((0.25, 0.1, -0.2, 0.6, -0.75) if dt == "float32" else (0.25, -0.2)):
            (_, count), st_ref = _guided_replay_matches(nvfp4_fake_quant_triton, "nvfp4", xt, guide, guide_dev,
                                                        shift, f"{dt}/{name} guided shift={shift}",
                                                        return_fallback=True)
            assert int(count) == st_ref["guided_fallback"]
        # the rollout's own tensor replays onto itself without a single fallback
        st = {}
        _assert_equal(nvfp4_fake_quant_triton(xr.to(dev), guide_dev, stats=st), quant_dequant(xr, "nvfp4"),
                      f"{dt}/{name} self-replay")
        assert st["guided_fallback"] == 0, st


@check
def nvfp4_fake_quant_variants(dev):
    import torch
    from megatron_qrl.kernels.fp4_fake_quant import nvfp4_fake_quant_triton
    from megatron_qrl.quant import GuidedRounding, nvfp4_quantize, quant_dequant
    for dt in ("float32", "bfloat16"):
        xr, xt = _guided_pairs(torch, getattr(torch, dt), seed=9)["outliers"]
        p, s, gs, b = nvfp4_quantize(xr, capture=True)
        guide = GuidedRounding(bits=b, scales=s, global_scale=gs)
        ref = quant_dequant(xt, "nvfp4", guide=guide)
        ref_n = quant_dequant(xt, "nvfp4")
        gd = GuidedRounding(bits=b.to(dev), scales=s.to(dev), global_scale=gs.to(dev))
        for i, (div, rnd, rb) in enumerate((d, r, o) for d in (0, 1) for r in (0, 1) for o in (False, True)):
            kw = dict(div=div, round_impl=rnd, rows_first=rb)
            if (i + (dt == "bfloat16")) % 2:
                _assert_equal(nvfp4_fake_quant_triton(xt.to(dev), gd, **kw), ref, f"{dt} guided {kw}")
            else:
                _assert_equal(nvfp4_fake_quant_triton(xt.to(dev), **kw), ref_n, f"{dt} nearest {kw}")
        for bb, nw in ((32, 1), (256, 8)):
            _assert_equal(nvfp4_fake_quant_triton(xt.to(dev), gd, block_blocks=bb, num_warps=nw), ref, f"BB={bb}")
    # per-row global scales (guided replay of rows from several engine calls)
    x = torch.randn(4, 6, 64) * torch.logspace(-4, 4, 4)[:, None, None]
    gs = x.abs().amax(-1, keepdim=True) / 2688
    try:
        p, s, _, b = nvfp4_quantize(x, gs, capture=True)
    except (ValueError, RuntimeError):
        return                                          # a reference without per-row global scales
    xt = x * (1 + 0.03 * torch.randn_like(x))
    guide = GuidedRounding(bits=b, scales=s, global_scale=gs)
    gd = GuidedRounding(bits=b.to(dev), scales=s.to(dev), global_scale=gs.to(dev))
    _assert_equal(nvfp4_fake_quant_triton(xt.to(dev), gd), quant_dequant(xt, "nvfp4", guide=guide), "per-row gs")


@check
def mxfp4_fake_quant(dev):
    import torch
    from megatron_qrl.kernels.fp4_fake_quant import mxfp4_fake_quant_triton
    from megatron_qrl.quant import GuidedRounding, mxfp4_dequantize, mxfp4_quantize, quant_dequant
    for dt, name, xr, xt in _guided_grid(torch, seed=11):
        _assert_equal(mxfp4_fake_quant_triton(xt.to(dev)), quant_dequant(xt, "mxfp4"), f"{dt}/{name} nearest")
        p, s, b = mxfp4_quantize(xr, capture=True)
        _assert_equal(mxfp4_fake_quant_triton(xt.to(dev), scales=s.to(dev)),
                      mxfp4_dequantize(*mxfp4_quantize(xt, scales=s), dtype=xt.dtype), f"{dt}/{name} given scales")
        guide = GuidedRounding(bits=b, scales=s)
        guide_dev = GuidedRounding(bits=b.to(dev), scales=s.to(dev))
        for shift in ((0.25, -0.3) if name in ("outliers", "tiny_blocks") else (0.25,)):
            _guided_replay_matches(mxfp4_fake_quant_triton, "mxfp4", xt, guide, guide_dev, shift,
                                   f"{dt}/{name} guided shift={shift}", rows_first=(shift > 0))


@check
def fake_quant_capture(dev):
    """The engine's fused W4A4 quantizer with TRACE capture: the quantize kernel's bytes (codes, scales, bits)
    and the fake-quant kernel's values from one launch, for both formats, scalar and per-row global scales,
    every dtype and input family (incl. a partial last tile)."""
    import torch
    from megatron_qrl.kernels.fp4_fake_quant import (fp4_fake_quant_capture_triton, mxfp4_fake_quant_triton,
                                                     nvfp4_fake_quant_triton)
    from megatron_qrl.kernels.fp4_quant import mxfp4_quantize_triton, nvfp4_quantize_triton
    from megatron_qrl.quant import nvfp4_global_scale
    for dt in DTYPES:
        dtype = getattr(torch, dt)
        fams = _families(torch, dtype, rows=24, cols=128, seed=5)
        for name in ("normal", "outliers", "zero_blocks", "ties", "row_scaled"):
            x = fams[name].to(dev)
            gs = nvfp4_global_scale(x.float().abs().amax().cpu()).to(dev)
            per_row = (x.float().abs().amax(dim=-1, keepdim=True) / (6 * 448)).clamp_min(2.0 ** -60)
            for g, what in ((gs, "scalar gs"), (per_row, "per-row gs")):
                deq, packed, scales, bits = fp4_fake_quant_capture_triton(x, "nvfp4", g)
                ref = nvfp4_quantize_triton(x, g, capture=True, check_finite=False)
                _cmp_quant((packed, scales.view(torch.uint8), bits),
                           (ref[0], ref[1].view(torch.uint8), ref[3]), f"nvfp4 {dt}/{name} {what}")
                _assert_equal(deq, nvfp4_fake_quant_triton(x, global_scale=g, check_finite=False),
                              f"nvfp4 {dt}/{name} {what} values")
            deq, packed, scales, bits = fp4_fake_quant_capture_triton(x, "mxfp4")
            _cmp_quant((packed, scales, bits), mxfp4_quantize_triton(x, capture=True, check_finite=False),
                       f"mxfp4 {dt}/{name}")
            _assert_equal(deq, mxfp4_fake_quant_triton(x, check_finite=False), f"mxfp4 {dt}/{name} values")
    x = torch.randn(3, 5, 48, device=dev)                     # leading dims, 45 blocks: a partial tile
    deq, packed, scales, bits = fp4_fake_quant_capture_triton(x, "nvfp4", torch.tensor(0.01, device=dev))
    assert packed.shape == (3, 5, 24) and scales.shape == (3, 5, 3) and bits.shape == (3, 5, 6)
    _assert_equal(deq, nvfp4_fake_quant_triton(x, global_scale=torch.tensor(0.01, device=dev), check_finite=False),
                  "leading dims")
    for bad, msg in ((lambda: fp4_fake_quant_capture_triton(x, "nvfp4"), "needs the global scale"),
                     (lambda: fp4_fake_quant_capture_triton(x, "int4"), "unknown FP4 format")):
        try:
            bad()
        except ValueError as e:
            assert msg in str(e), e
        else:
            raise AssertionError(f"expected ValueError: {msg}")


@check
def dispatcher_and_ste(dev):
    """megatron_qrl.kernels entry points route to the kernels and keep the reference's results."""
    import torch
    import megatron_qrl.kernels as K
    from megatron_qrl.quant import GuidedRounding, fake_quant, mxfp4_quantize, nvfp4_quantize, quant_dequant
    from megatron_qrl.kernels.fp4_fake_quant import fake_quant_ste_triton
    assert K.available()
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    assert K.use_triton(x.to(dev))
    _cmp_quant(K.nvfp4_quantize(x.to(dev), capture=True), nvfp4_quantize(x, capture=True), "dispatch nvfp4")
    for a, b in zip(K.mxfp4_quantize(x.to(dev), capture=True), mxfp4_quantize(x, capture=True)):
        _assert_equal(a, b, "dispatch mxfp4")
    p, s, gs, b = nvfp4_quantize(x, capture=True)
    guide = GuidedRounding(bits=b.to(dev), scales=s.to(dev), global_scale=gs.to(dev))
    xt = (x.float() * 1.01).to(torch.bfloat16)
    st1, st2 = {}, {}
    _assert_equal(K.quant_dequant(xt.to(dev), "nvfp4", guide=guide, stats=st1),
                  quant_dequant(xt, "nvfp4", guide=GuidedRounding(bits=b, scales=s, global_scale=gs), stats=st2),
                  "dispatch guided")
    assert st1 == st2
    xg = xt.float().to(dev).requires_grad_(True)
    y = K.fake_quant(xg, "nvfp4")
    _assert_equal(y.detach(), fake_quant(xt.float(), "nvfp4"), "dispatch fake_quant")
    y.sum().backward()
    assert torch.equal(xg.grad.cpu(), torch.ones(16, 64))
    xg.grad = None
    y = fake_quant_ste_triton(xg, "mxfp4")
    _assert_equal(y.detach(), quant_dequant(xt.float(), "mxfp4"), "ste forward")
    (y * 3).sum().backward()
    assert torch.equal(xg.grad.cpu(), torch.full((16, 64), 3.0))
    # stochastic rounding stays on the reference path
    gen = torch.Generator().manual_seed(0)
    K.nvfp4_quantize(x, rounding="stochastic", generator=gen)


@check
def large_random(dev):
    """GPU only: large fresh random inputs of every dtype (the interpreter would take too long)."""
    import torch
    if dev == "cpu":
        return
    from megatron_qrl.kernels.fp4_fake_quant import nvfp4_fake_quant_triton
    from megatron_qrl.kernels.fp4_quant import mxfp4_quantize_triton, nvfp4_quantize_triton
    from megatron_qrl.quant import GuidedRounding, mxfp4_quantize, nvfp4_quantize, quant_dequant
    from megatron_qrl.quant.nvfp4 import nvfp4_global_scale
    for seed in range(3):
        g = torch.Generator(device=dev).manual_seed(seed)
        for dt in DTYPES:
            dtype = getattr(torch, dt)
            x = torch.randn(1024, 4096, device=dev, generator=g)
            x = (x * torch.exp(2 * torch.randn(1024, 1, device=dev, generator=g))).to(dtype)
            # the reference's global scale on the CPU: torch on CUDA divides amax by 2688 as amax * (1/2688),
            # which can be 1 ulp off (the kernels compute the true quotient); all else runs on the GPU
            gs_cpu = nvfp4_global_scale(x.cpu()).to(dev)
            got = nvfp4_quantize_triton(x, capture=True)
            _assert_equal(got[2], gs_cpu, f"global scale {dt}")
            _cmp_quant(got, nvfp4_quantize(x, gs_cpu, capture=True), f"nvfp4 {dt}")
            # MXFP4 against the CPU reference too (its amax / 6 is the same kind of scalar division)
            for a, b in zip(mxfp4_quantize_triton(x, capture=True), mxfp4_quantize(x.cpu(), capture=True)):
                _assert_equal(a, b, f"mxfp4 {dt}")
            p, s, gs, b = nvfp4_quantize(x, capture=True)
            xt = (x.float() * (1 + 0.02 * torch.randn(x.shape, device=dev, generator=g))).to(dtype)
            guide = GuidedRounding(bits=b, scales=s, global_scale=gs)
            st1, st2 = {}, {}
            _assert_equal(nvfp4_fake_quant_triton(xt, guide, stats=st1),
                          quant_dequant(xt, "nvfp4", guide=guide, stats=st2), f"guided {dt}")
            assert st1 == st2
            _assert_equal(nvfp4_fake_quant_triton(xt),
                          quant_dequant(xt, "nvfp4", global_scale=nvfp4_global_scale(xt.cpu()).to(dev)),
                          f"nearest {dt}")


# ----------------------------------------------------------------------------------------------------------
# Child process and pytest glue
# ----------------------------------------------------------------------------------------------------------
def _child(device: str, out: str, names: list[str]) -> None:
    if device == "cpu":
        assert os.environ.get("TRITON_INTERPRET") == "1", "the CPU checks need TRITON_INTERPRET=1 before import"
    else:
        os.environ["QRL_KERNELS"] = "auto"
    results = {}
    for name in names:
        t0 = time.time()
        try:
            CHECKS[name](device)
            results[name] = {"ok": True, "seconds": round(time.time() - t0, 2)}
        except Exception:  # report every failure, keep going
            results[name] = {"ok": False, "error": traceback.format_exc(), "seconds": round(time.time() - t0, 2)}
        print(f"{name}: {'ok' if results[name]['ok'] else 'FAILED'} ({results[name]['seconds']} s)", flush=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


def _import_kernels():
    """megatron_qrl.kernels (in a plain checkout on PYTHONPATH, megatron_qrl/__init__.py maps the top-level
    kernels/ directory to that name)."""
    import megatron_qrl.kernels as K
    return K


def _device() -> str:
    return os.environ.get("QRL_KERNEL_TEST_DEVICE", "cpu")


@pytest.fixture(scope="module")
def kernel_results(tmp_path_factory):
    """Runs the checks in child processes (QRL_KERNEL_TEST_JOBS of them, default 2 on CPU, up to 8 on a
    GPU where most of the time is Triton compiling the kernel variants) and merges their results."""
    pytest.importorskip("triton")
    device = _device()
    tmp = tmp_path_factory.mktemp("kernels")
    env = dict(os.environ)
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
        env["QRL_KERNELS"] = "triton"
    else:
        env.pop("TRITON_INTERPRET", None)
    default_jobs = 2 if device == "cpu" else 8
    jobs = max(1, min(int(os.environ.get("QRL_KERNEL_TEST_JOBS", default_jobs)), len(CHECKS), os.cpu_count() or 1))
    # the slow checks first, spread round-robin
    order = sorted(CHECKS, key=lambda n: (not n.startswith(("nvfp4_fake", "mxfp4_fake", "nvfp4_quantize_fam")), n))
    groups = [order[i::jobs] for i in range(jobs)]
    procs = []
    for i, names in enumerate(groups):
        out = tmp / f"results{i}.json"
        cmd = [sys.executable, os.path.abspath(__file__), "--device", device, "--out", str(out), "--only", *names]
        stream = None if device != "cpu" else subprocess.PIPE   # on a GPU machine progress goes to the log
        procs.append((out, subprocess.Popen(cmd, env=env, stdout=stream, stderr=subprocess.STDOUT, text=True)))
    results = {}
    for out, p in procs:
        log, _ = p.communicate(timeout=900)
        if not out.exists():
            raise RuntimeError(f"kernel check process failed (rc {p.returncode}):\n{log}")
        results.update(json.loads(out.read_text()))
    return results


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_kernel_codec(kernel_results, name):
    r = kernel_results[name]
    assert r["ok"], r["error"]


def test_dispatch_without_interpreter(monkeypatch):
    """In this process (no interpreter forced): CPU tensors take the torch path, QRL_KERNELS is validated."""
    import torch
    K = _import_kernels()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("QRL_KERNELS", "auto")
    x = torch.randn(4, 32)
    assert not K.use_triton(x)
    ref = __import__("megatron_qrl.quant", fromlist=["nvfp4_quantize"]).nvfp4_quantize(x, capture=True)
    for a, b in zip(K.nvfp4_quantize(x, capture=True), ref):
        assert torch.equal(_bits(a), _bits(b))
    monkeypatch.setenv("QRL_KERNELS", "torch")
    assert not K.use_triton(x)
    monkeypatch.setenv("QRL_KERNELS", "bogus")
    with pytest.raises(ValueError, match="QRL_KERNELS"):
        K.use_triton(x)


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", nargs="*", default=None)
    a = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    _import_kernels()
    _child(a.device, a.out, a.only or sorted(CHECKS))
