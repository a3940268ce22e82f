"""Kernel-preferred layouts of FP4 weights, produced ONCE at weight-sync time (never per GEMM call).

The checkpoint / weight-sync format (METHODS.md section 1) packs element 2i in the low nibble and 2i+1 in
the high nibble of byte i. The W4A16 kernels want each byte to feed two *contiguous* runs of the
activation row, so one 16-byte load of weights dequantizes into two tiles that each multiply a contiguous
slice of x (no stride-2 activation loads, no in-register interleave), and they want the bits of each code
where a float16 wants them, so the decode is a shift and a mask:

    kernel layout, per group of 32 elements (16 bytes), byte j (0..15) holds
        a = code[32g + j]  ("low" element)   and   b = code[32g + 16 + j]  ("high" element) as
        bit 0: sign(b), bits 1-3: |a| index, bits 4-6: |b| index, bit 7: sign(a)
    so   (byte << 8) & 0x8E00                           = float16 bits of value(a) * 2^-14
         ((byte << 5) & 0x0E00) | ((byte << 15) & 0x8000) = float16 bits of value(b) * 2^-14
    and two bytes placed in the upper bytes of a 32-bit word t decode to two fp16x2 words with
    t & 0x8E008E00 and ((t >> 3) | (t << 7)) & 0x8E008E00: 5 integer instructions per 4 weights.

With NVFP4 (blocks of 16) the low elements of a group are exactly scale block 2g and the high ones block
2g+1; with MXFP4 (blocks of 32) the whole group is one scale block. Scales keep their [N, K/block] order
(one contiguous run per weight row and K tile, so a tile's scales come in one vector load); they are
stored as raw uint8 bytes (E4M3 bits for NVFP4, E8M0 exponents for MXFP4) and decoded in-kernel with bit
arithmetic, which runs identically on Triton 3.6 (GPU image) and the 3.9 CPU interpreter. Each scale byte is
re-encoded once so that its decode is a single shift:
    NVFP4: byte = "E5M3" of s * 2^5, i.e. float16 bits of (s * 2^5) >> 7. Exact for every E4M3 scale
           (subnormals included: s * 2^5 lies in [2^-4, 14336] with at most 3 mantissa bits).
    MXFP4: byte = e + 14, so that fp32 bits byte << 23 = 2^(e - 127) * 2^14 (needs e <= 240).

The global scale is folded with the kernel's constant exponent offsets (`global_scale * 2^22`, see
`w4a16_gemm._dequant_*`), so the in-kernel dequant reproduces `nvfp4_dequantize` bit for bit.

All `prepare_*` functions are pure functions of the synced bytes: the engine calls them once per weight
sync (after hashing the synced tensors) and keeps the result until the next sync.

Expert stacks can also be held tile-major (`tile_major_experts`: each tile_n x tile_k tile of an expert one
contiguous run of codes and one of scales, what one loop trip of the grouped kernels reads); the grouped
tensor-core kernel and the MoE GEMV read that order too (`PreparedFP4Weight.tile` says which one a stack is in).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from megatron_qrl.quant.blocks import MXFP4_BLOCK, NVFP4_BLOCK

PACK_GROUP = 32          # elements per 16-byte permutation group
# Exponent offsets used by the in-kernel decode: codes decode to value * 2^-14 and E4M3 scales to
# value * 2^-8 (both through float16 bit patterns), so the folded factor is 2^(14 + 8).
NVFP4_GLOBAL_FOLD = 2.0 ** 22
NVFP4_SCALE_SHIFT = 5     # prepared NVFP4 scale bytes hold s * 2^5
MX_MAX_EXPONENT_BYTE = 240  # E8M0 byte e decodes as fp32 bits (e + 14) << 23; e + 14 must stay <= 254


@dataclass
class PreparedFP4Weight:
    """FP4 weight(s) in the layout the Triton kernels read.

    qweight:      uint8 [N, K/2] or [E, N, K/2] (E experts), nibbles permuted per 32-element group.
    scales:       uint8 [N, K/block] or [E, N, K/block], re-encoded for a one-shift decode (module doc).
    global_scale: float32 [1] or [E]: s_global * 2^22 (nvfp4); unused by mxfp4 (ones).
    fmt:          "nvfp4" or "mxfp4".
    tile:         None (rows in order), or (block_n, block_k) for expert stacks made tile-major by
                  `tile_major_experts` (codes [E, N*K/(2*block_k), block_k/2], scales likewise).
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor
    fmt: str
    n: int
    k: int
    num_experts: Optional[int] = None
    tile: Optional[Tuple[int, int]] = None

    @property
    def block(self) -> int:
        return NVFP4_BLOCK if self.fmt == "nvfp4" else MXFP4_BLOCK

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def nbytes(self) -> int:
        """Bytes the kernels stream per full pass over the weight (codes + scales)."""
        return self.qweight.numel() + self.scales.numel()

    def to(self, device) -> "PreparedFP4Weight":
        return PreparedFP4Weight(self.qweight.to(device), self.scales.to(device), self.global_scale.to(device),
                                 self.fmt, self.n, self.k, self.num_experts, self.tile)


def permute_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Checkpoint packing (2i low, 2i+1 high) -> kernel packing (see the module docstring)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed FP4 codes must be uint8, got {packed.dtype}")
    k = packed.shape[-1] * 2
    if k % PACK_GROUP:
        raise ValueError(f"K = {k} is not a multiple of {PACK_GROUP}; the W4A16 kernels need K % 32 == 0 "
                         "(pad the weight's input dimension)")
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(*packed.shape[:-1], k // PACK_GROUP, 2, 16)
    a, b = codes[..., 0, :], codes[..., 1, :]
    out = (b >> 3) | ((a & 7) << 1) | ((b & 7) << 4) | ((a >> 3) << 7)
    return out.reshape(packed.shape).contiguous()


def unpermute_nibbles(qweight: torch.Tensor) -> torch.Tensor:
    """Inverse of permute_nibbles (kernel packing -> checkpoint packing)."""
    k = qweight.shape[-1] * 2
    g = qweight.reshape(*qweight.shape[:-1], k // PACK_GROUP, 16)
    a = ((g >> 1) & 7) | (((g >> 7) & 1) << 3)
    b = ((g >> 4) & 7) | ((g & 1) << 3)
    codes = torch.stack([a, b], dim=-2).reshape(*qweight.shape[:-1], k)
    return ((codes[..., 1::2] << 4) | codes[..., 0::2]).contiguous()


def _check(packed: torch.Tensor, scales: torch.Tensor, block: int, where: str) -> None:
    if packed.dim() not in (2, 3):
        raise ValueError(f"{where}: packed must be [N, K/2] or [E, N, K/2], got {tuple(packed.shape)}")
    k = packed.shape[-1] * 2
    if tuple(scales.shape) != (*packed.shape[:-1], k // block):
        raise ValueError(f"{where}: scales {tuple(scales.shape)} do not match packed {tuple(packed.shape)} "
                         f"(expected {(*packed.shape[:-1], k // block)})")
    if scales.device != packed.device:
        raise ValueError(f"{where}: scales on {scales.device}, packed on {packed.device}; put both on one device")


def encode_nvfp4_scales(scales: torch.Tensor, check: bool = True) -> torch.Tensor:
    """float8_e4m3fn scales -> prepared bytes (float16 bits of s * 2^5, shifted right by 7). check=False
    skips the validation (two host synchronisations), for codec-made scales on a hot path."""
    if scales.dtype == torch.uint8:
        scales = scales.view(torch.float8_e4m3fn)
    s = scales.to(torch.float32)
    if check and (bool((s < 0).any()) or not bool(torch.isfinite(s).all())):
        raise ValueError("NVFP4 block scales must be finite and non-negative")
    bits = (s * 2.0 ** NVFP4_SCALE_SHIFT).to(torch.float16).view(torch.int16).to(torch.int32)
    if check and bool((bits & 0x7F).any()):
        raise AssertionError("E4M3 scale did not re-encode exactly")  # impossible for E4M3 inputs
    return (bits >> 7).to(torch.uint8).contiguous()


def decode_nvfp4_scales(prepared: torch.Tensor) -> torch.Tensor:
    """Inverse of encode_nvfp4_scales: prepared bytes -> float8_e4m3fn scales."""
    f = (prepared.to(torch.int32) << 7).to(torch.int16).view(torch.float16).to(torch.float32)
    return (f / 2.0 ** NVFP4_SCALE_SHIFT).to(torch.float8_e4m3fn)


def prepare_nvfp4_weight(packed: torch.Tensor, scales: torch.Tensor,
                         global_scale) -> PreparedFP4Weight:
    """NVFP4 (codec output: packed uint8 [N, K/2], float8_e4m3fn [N, K/16], fp32 scalar) -> kernel layout.

    Also takes a stack of experts: packed [E, N, K/2], scales [E, N, K/16], global_scale [E] (or scalar).
    """
    _check(packed, scales, NVFP4_BLOCK, "prepare_nvfp4_weight")
    if scales.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise TypeError(f"prepare_nvfp4_weight: scales must be float8_e4m3fn, got {scales.dtype}")
    experts = packed.shape[0] if packed.dim() == 3 else None
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=packed.device).reshape(-1)
    if experts is not None and gs.numel() == 1:
        gs = gs.expand(experts)
    if gs.numel() != (experts or 1):
        raise ValueError(f"prepare_nvfp4_weight: {gs.numel()} global scales for {experts or 1} weight(s)")
    return PreparedFP4Weight(
        qweight=permute_nibbles(packed),
        scales=encode_nvfp4_scales(scales),
        global_scale=(gs * NVFP4_GLOBAL_FOLD).contiguous(),
        fmt="nvfp4", n=packed.shape[-2], k=packed.shape[-1] * 2, num_experts=experts)


def prepare_mxfp4_weight(packed: torch.Tensor, scales: torch.Tensor) -> PreparedFP4Weight:
    """MXFP4 (packed uint8 [N, K/2] or [E, N, K/2], E8M0 uint8 scales [.., K/32]) -> kernel layout."""
    _check(packed, scales, MXFP4_BLOCK, "prepare_mxfp4_weight")
    if scales.dtype != torch.uint8:
        raise TypeError(f"prepare_mxfp4_weight: E8M0 scales must be uint8, got {scales.dtype}")
    if scales.numel() and int(scales.max()) > MX_MAX_EXPONENT_BYTE:
        raise ValueError(f"prepare_mxfp4_weight: an E8M0 scale byte is {int(scales.max())} (2^"
                         f"{int(scales.max()) - 127}); the kernels support bytes <= {MX_MAX_EXPONENT_BYTE}")
    experts = packed.shape[0] if packed.dim() == 3 else None
    return PreparedFP4Weight(
        qweight=permute_nibbles(packed), scales=(scales.to(torch.int32) + 14).to(torch.uint8).contiguous(),
        global_scale=torch.ones(experts or 1, dtype=torch.float32, device=packed.device),
        fmt="mxfp4", n=packed.shape[-2], k=packed.shape[-1] * 2, num_experts=experts)


def tile_major_experts(w: PreparedFP4Weight, block_n: int, block_k: int) -> PreparedFP4Weight:
    """Expert stacks re-ordered so that each tile of block_n rows x block_k elements (one loop trip of the grouped
    kernel, `MoEConfig.tile_major`) is one contiguous run of block_n * block_k / 2 code bytes and one of its
    scale bytes: tile (expert e, row tile r, K step t) is rows (r * K / block_k + t) * block_n ... of expert e.
    Why: row-major stacks give a trip block_n pieces of block_k / 2 bytes, 1 KB apart (K = 2048), and its scales
    in pieces of block_k / 16 bytes; the dense MMA GEMV ran 1.06-1.13x faster on such a layout (docs/PERF.md,
    2026-11-30). A second layout of the same bytes, not a copy the engine keeps: `row_major_experts` inverts it."""
    if w.num_experts is None or w.tile is not None:
        raise ValueError("tile_major_experts takes row-major expert stacks [E, N, K/2] (prepare_*_weight on "
                         f"stacked tensors); got num_experts={w.num_experts}, tile={w.tile}")
    if block_n <= 0 or block_k <= 0 or w.n % block_n or w.k % block_k or block_k % w.block:
        raise ValueError(f"tile {block_n} x {block_k} does not divide the {w.n} x {w.k} expert weights into whole "
                         f"scale blocks of {w.block}; pick block_n | N and block_k | K, block_k a multiple of "
                         f"{w.block}")
    return PreparedFP4Weight(_to_tiles(w.qweight, block_n, block_k // 2),
                             _to_tiles(w.scales, block_n, block_k // w.block), w.global_scale, w.fmt, w.n, w.k,
                             w.num_experts, (block_n, block_k))


def row_major_experts(w: PreparedFP4Weight) -> PreparedFP4Weight:
    """The inverse of `tile_major_experts` (w itself when it is row-major)."""
    if w.tile is None:
        return w
    block_n, block_k = w.tile
    return PreparedFP4Weight(_from_tiles(w.qweight, w.n, block_n, block_k // 2),
                             _from_tiles(w.scales, w.n, block_n, block_k // w.block), w.global_scale, w.fmt,
                             w.n, w.k, w.num_experts)


def _to_tiles(a: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[E, N, C] -> [E, (N / rows) * (C / cols) * rows, cols]: row tile major, then column step, then row."""
    e, n, c = a.shape
    return (a.reshape(e, n // rows, rows, c // cols, cols).permute(0, 1, 3, 2, 4)
            .reshape(e, n * c // cols, cols).contiguous())


def _from_tiles(a: torch.Tensor, n: int, rows: int, cols: int) -> torch.Tensor:
    e, total, _ = a.shape
    steps = total // n
    return (a.reshape(e, n // rows, steps, rows, cols).permute(0, 1, 3, 2, 4)
            .reshape(e, n, steps * cols).contiguous())


def dequantize_prepared(w: PreparedFP4Weight, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Torch reference: the dense weight a prepared tensor stands for (through the codec's dequantizer)."""
    from megatron_qrl.quant import mxfp4_dequantize, nvfp4_dequantize

    w = row_major_experts(w)
    packed = unpermute_nibbles(w.qweight)
    if w.fmt == "mxfp4":
        return mxfp4_dequantize(packed, (w.scales.to(torch.int32) - 14).to(torch.uint8), dtype)
    scales = decode_nvfp4_scales(w.scales)
    gs = w.global_scale / NVFP4_GLOBAL_FOLD
    if w.num_experts is None:
        return nvfp4_dequantize(packed, scales, gs.reshape(()), dtype)
    return torch.stack([nvfp4_dequantize(packed[e], scales[e], gs[e], dtype) for e in range(w.num_experts)])
