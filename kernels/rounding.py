"""fp32 -> bf16 output rounding shared by the W4A16 and attention kernels (Triton device functions)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _to_bf16(x, RNE: tl.constexpr):
    """fp32 -> bf16, round to nearest even. RNE=True rounds with integer arithmetic first: the CPU
    interpreter's float cast truncates (the GPU's cvt.rn rounds), so interpreter runs pass RNE=True."""
    if RNE:
        b = x.to(tl.int32, bitcast=True)
        b = (b + (0x7FFF + ((b >> 16) & 1))) & -65536
        x = b.to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def _cast_out(x, ptr, RNE: tl.constexpr):
    """Cast an fp32 tile to the element type of ptr (rounding bf16 to nearest even, see _to_bf16)."""
    if ptr.dtype.element_ty == tl.bfloat16:
        return _to_bf16(x, RNE)
    return x.to(ptr.dtype.element_ty)
