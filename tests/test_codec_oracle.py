"""The FP4 codec against nvidia-modelopt's NVFP4QTensor: codes and scales bit for bit on >= 10^7 elements."""
import pytest
import torch

from megatron_qrl.quant import nvfp4_dequantize, nvfp4_quantize

# nvidia-modelopt is a test dependency: a missing one fails the suite (no skip).
from modelopt.torch.quantization.qtensor import MXFP4QTensor, NVFP4QTensor

ROWS, COLS = 512, 1376  # 704,512 elements per case; 15 cases -> 10.6M elements


def _inputs(kind: str, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(ROWS, COLS, generator=gen)
    if kind == "normal":
        return x
    if kind == "heavy_tailed":  # Student-t with 2 degrees of freedom: rare huge values
        chi2 = torch.randn(ROWS, COLS, 2, generator=gen).pow(2).sum(-1)
        return x / torch.sqrt(chi2 / 2)
    if kind == "outlier_rows":
        rows = torch.randint(0, ROWS, (ROWS // 32,), generator=gen)
        x[rows] *= 300.0
        x[:, ::97] *= 50.0
        return x
    if kind == "zero_blocks":
        blocks = x.view(ROWS, COLS // 16, 16)
        zero = torch.rand(ROWS, COLS // 16, generator=gen) < 0.3
        blocks[zero] = 0.0
        return blocks.view(ROWS, COLS)
    if kind == "tiny":  # block scales fall into E4M3's subnormal range and below its 2^-9 floor
        mags = torch.exp2(torch.randint(-30, -8, (ROWS, COLS // 16, 1), generator=gen).float())
        return (x.view(ROWS, COLS // 16, 16) * mags).view(ROWS, COLS) + 0.0 * x
    raise ValueError(kind)


CASES = [(k, d) for k in ["normal", "heavy_tailed", "outlier_rows", "zero_blocks", "tiny"]
         for d in [torch.float32, torch.bfloat16, torch.float16]]


@pytest.mark.parametrize("kind,dtype", CASES, ids=[f"{k}-{str(d).split('.')[-1]}" for k, d in CASES])
def test_nvfp4_matches_modelopt_bit_for_bit(kind, dtype):
    gen = torch.Generator().manual_seed(hash(kind) % 1000 + 7)
    x = _inputs(kind, gen)
    if kind == "tiny" and dtype == torch.float16:
        x = x * 2.0 ** 14  # keep fp16 out of its flush-to-zero range but still far below 1
    x = x.to(dtype)
    x[0, -16:] = 1.0  # guarantee at least one non-zero block per tensor (the all-zero tensor is special)
    packed, scales, gscale = nvfp4_quantize(x)
    ref_q, ref_scales, ref_g = NVFP4QTensor.quantize(x.clone(), 16)
    assert packed.shape == (ROWS, COLS // 2) and packed.dtype == torch.uint8
    assert scales.shape == (ROWS, COLS // 16) and scales.dtype == torch.float8_e4m3fn
    assert gscale.dim() == 0 and gscale.dtype == torch.float32
    assert torch.equal(gscale, ref_g.float())
    assert torch.equal(scales.view(torch.uint8), ref_scales.view(torch.uint8))
    assert torch.equal(packed, ref_q._quantized_data)
    ours = nvfp4_dequantize(packed, scales, gscale, dtype=dtype)
    theirs = ref_q.dequantize(dtype=dtype, scale=ref_scales, double_scale=ref_g, block_sizes={-1: 16})
    assert torch.equal(ours, theirs)


def test_all_zero_tensor_is_finite():
    """ModelOpt yields NaN scales here; ours defines s_global from amax=1 so everything stays finite."""
    packed, scales, g = nvfp4_quantize(torch.zeros(4, 32))
    assert torch.all(packed == 0) and torch.isfinite(scales.float()).all() and torch.isfinite(g)
    assert torch.equal(nvfp4_dequantize(packed, scales, g, torch.float32), torch.zeros(4, 32))


def test_mxfp4_scales_match_modelopt_and_values_within_rounding():
    from megatron_qrl.quant import mxfp4_dequantize, mxfp4_quantize

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(256, 1024, generator=gen) * torch.exp2(torch.randint(-6, 6, (256, 1), generator=gen).float())
    packed, scales = mxfp4_quantize(x)
    ref_q, ref_scales = MXFP4QTensor.quantize(x.clone(), 32)
    assert torch.equal(scales, ref_scales.view(256, 32))
    # ModelOpt rounds exact midpoints down; we round them to even: codes may differ only on ties.
    ours = mxfp4_dequantize(packed, scales, torch.float32)
    theirs = ref_q.dequantize(dtype=torch.float32, scale=ref_scales, block_sizes={-1: 32})
    differ = ours != theirs
    z = (x.view(256, 32, 32) / torch.exp2(scales.float() - 127).unsqueeze(-1)).view(256, 1024).abs()
    ties = torch.zeros_like(differ)
    for m in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0):
        ties |= z == m
    assert not (differ & ~ties).any()
