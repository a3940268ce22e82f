"""Grouped MoE W4A16: all experts in one launch per projection, FP4 expert weights dequantized in registers.

Pipeline for hidden states x [T, H], router top-k (ids [T, k], weights [T, k]) and prepared expert stacks
w13 [E, 2F, H] (gate rows 0..F-1, up rows F..2F-1: `layouts.prepare_nvfp4_weight` on the stacked
checkpoint tensors) and w2 [E, H, F]:

1. `moe_align(topk_ids, E, block_m)`: sorts the T*k (token, slot) assignments by expert and pads each
   expert's run to a multiple of block_m. Pure torch, no host synchronisation (CUDA-graph capturable);
   the buffer size uses the bound  sum_e ceil(c_e / B) <= min(E, T*k) + T*k // B  blocks.
2. `_moe_gemm_kernel` GATED: one program per (block of block_m sorted rows of one expert, tile of F):
   gathers the tokens' rows of x, computes gate and up tiles against the expert's FP4 rows n and F + n
   (two accumulators sharing the activation tiles), writes silu(gate) * up (bf16) in sorted order.
3. `_moe_gemm_kernel` down: the same kernel over the intermediate rows (contiguous per block) and w2,
   scaling each row by its router weight and scattering it to its (token, slot) row.
4. The k slot rows of every token are summed (fixed order: deterministic).

Blocks past the last expert's run exit at once. The decode path is "swapped" (weights are the MMA's M
side, the block's tokens its N side), as in the dense kernel; see w4a16_gemm.py for the dequant math.
Reference: `moe_w4a16_reference` (per-expert loop of dequantize + matmul).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
import triton
import triton.language as tl

from .layouts import PreparedFP4Weight
from .rounding import _cast_out
from .w4a16_gemm import (FP16_ACC_FACTOR, INTERPRET, _dequant_tile, _mma, _prep_x, tma_compatible,
                         weight_descriptor)


# ----------------------------------------------------------------------------------------------------
# Routing: sorted assignment ids + per-block expert
# ----------------------------------------------------------------------------------------------------
@dataclass
class MoERouting:
    sorted_ids: torch.Tensor     # int32 [num_blocks * block_m]: assignment index t*k + j, or n_assign (pad)
    block_expert: torch.Tensor   # int32 [num_blocks]: expert of each block, -1 past the end
    num_blocks: int              # grid bound (host-side, from shapes only)
    block_m: int
    n_tokens: int
    top_k: int

    @property
    def n_assign(self) -> int:
        return self.n_tokens * self.top_k


def max_blocks(n_assign: int, num_experts: int, block_m: int) -> int:
    """Upper bound of sum_e ceil(count_e / block_m) over any routing of n_assign assignments."""
    return min(num_experts, n_assign) + n_assign // block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int = 16) -> MoERouting:
    """Sort (token, slot) assignments by expert, each expert's run padded to a multiple of block_m."""
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, k], got {tuple(topk_ids.shape)}")
    t, k = topk_ids.shape
    n = t * k
    dev = topk_ids.device
    nb = max_blocks(n, num_experts, block_m)
    flat = topk_ids.reshape(-1).to(torch.int64)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    end_padded = torch.cumsum(padded, 0)
    start_padded = end_padded - padded
    start_count = torch.cumsum(counts, 0) - counts
    order = torch.sort(flat, stable=True).indices
    sorted_expert = flat[order]
    rank = torch.arange(n, device=dev) - start_count[sorted_expert]
    dest = start_padded[sorted_expert] + rank
    sorted_ids = torch.full((nb * block_m,), n, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)
    block_start = torch.arange(nb, device=dev, dtype=torch.int64) * block_m
    block_expert = torch.searchsorted(end_padded, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, torch.full_like(block_expert, -1))
    return MoERouting(sorted_ids, block_expert.to(torch.int32), nb, block_m, t, k)


# ----------------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _settled(acc, DOT_F32: tl.constexpr):
    """acc once the MMAs producing it have completed: an identity the compiler cannot look through, so Triton
    waits for the asynchronous wgmma here (the interpreter, DOT_F32, has nothing in flight)."""
    if DOT_F32:
        return acc
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [acc], dtype=tl.float32, is_pure=False, pack=1)


@triton.jit
def _moe_tile(pid_m, pid_n, expert, x_ptr, w_ptr, s_ptr, gs_ptr, y_ptr, sorted_ids_ptr, block_expert_ptr,
              topk_w_ptr, N, K, n_assign, stride_we, stride_wn, stride_se, stride_sn, stride_xm, stride_ym, acc_factor,
              TOP_K: tl.constexpr, GATED: tl.constexpr, IS_MX: tl.constexpr, FP16: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
              USE_ASM: tl.constexpr, X_PRE: tl.constexpr, OUT_SCALED: tl.constexpr, W_TMA: tl.constexpr,
              SYNC_DOTS: tl.constexpr, PACKED_SCALES: tl.constexpr, UNROLL: tl.constexpr,
              TILE_N: tl.constexpr):
    """One tile of a grouped projection: routing block pid_m (of expert), weight-row tile pid_n.
    GATED: y[sorted row, n] = silu(x_tok . Wg[e, n]) * (x_tok . Wu[e, n]), x_tok = x[assign // TOP_K],
    n < N = F, weight rows n (gate) and N + n (up).
    not GATED: y[assign, n] = topk_w[assign] * (x[sorted row] . W[e, n]), n < N = H.
    X_PRE: x is already the fp16 operand x * 2^-8; OUT_SCALED: store y * 2^-8 (fp16), the down
    projection's ready-made operand. W_TMA: w_ptr is a TensorDescriptor over the [E, rows, K/2] codes with
    block [1, BLOCK_N, BLOCK_K/2] (gate rows past N then read up rows, whose columns are never stored).
    SYNC_DOTS: each projection's dots start once the MMAs in flight have completed (_settled), so no wgmma
    operand is decoded while a wgmma pipeline stage is open; otherwise ptxas (CUDA 12.8, Triton 3.6) issues
    every wgmma of the kernel alone and waits for it (C7513 / C7515: 16 waits per gate/up trip instead of 4).
    Same products and the same fp32 sums in the same order. PACKED_SCALES: NVFP4 scales decoded four bytes per
    register (w4a16_gemm._SCALE_ASM; the same fp16 values). UNROLL: K steps per loop trip (the loop's
    bookkeeping -- stage indices, barriers, TMA -- paid once per UNROLL steps; the same sums in the same order).
    TILE_N > 0: the stacks are `layouts.tile_major_experts(w, TILE_N, BLOCK_K)` (N % TILE_N == 0, BLOCK_N a multiple
    of TILE_N): trip t of stack row tile r is rows (r * K / BLOCK_K + t) * TILE_N..., one contiguous run of codes and
    one of scales; w_ptr's TMA descriptor views the codes as [E, row tiles, K / BLOCK_K * TILE_N, BLOCK_K / 2]."""
    HALF: tl.constexpr = BLOCK_K // 2
    SB: tl.constexpr = BLOCK_K // 32 if IS_MX else BLOCK_K // 16

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assign = tl.load(sorted_ids_ptr + rows)
    valid = assign < n_assign
    if GATED:
        x_row = assign // TOP_K
    else:
        x_row = rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    # trip t's weight rows: row-major stacks step along the rows' K bytes, tile-major ones TILE_N rows down each
    # tile's run, whose row strides are HALF and SB bytes (constants, so the compiler sees contiguous runs); the up
    # rows lie up_rows past the gate rows
    if TILE_N > 0:
        k_steps = K // BLOCK_K
        n_of = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        w_row = (n_of // TILE_N) * (k_steps * TILE_N) + n_of % TILE_N
        up_rows = (N // TILE_N) * k_steps * TILE_N
        w_stride: tl.constexpr = HALF
        s_stride: tl.constexpr = SB
        code_step: tl.constexpr = TILE_N * HALF
        scale_step: tl.constexpr = TILE_N * SB
        # TMA: box [1, BLOCK_N / TILE_N row tiles, TILE_N, HALF] at (expert, tma_tile, t * TILE_N, 0)
        tma_tile = pid_n * (BLOCK_N // TILE_N)
        tma_tile_u = tma_tile + N // TILE_N
    else:
        w_row = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        up_rows = N
        w_stride = stride_wn
        s_stride = stride_sn
        code_step: tl.constexpr = HALF
        scale_step: tl.constexpr = SB
    kk = tl.arange(0, HALF)
    k_lo = (kk // 16) * 32 + (kk % 16)
    ks = tl.arange(0, SB)

    e64 = expert.to(tl.int64)
    s_base = s_ptr + e64 * stride_se
    gs = tl.load(gs_ptr + expert)
    if W_TMA:
        w_rows = w_ptr
    else:
        w_rows = w_ptr + e64 * stride_we + w_row.to(tl.int64)[:, None] * w_stride + kk[None, :]
    s_rows = s_base + w_row.to(tl.int64)[:, None] * s_stride + ks[None, :]
    x_rows = x_ptr + x_row.to(tl.int64)[:, None] * stride_xm + k_lo[None, :]
    x_mask = valid[:, None]

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if GATED:
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        if W_TMA:
            wu_rows = w_ptr
        else:
            wu_rows = w_rows + up_rows.to(tl.int64) * w_stride
        su_rows = s_rows + up_rows.to(tl.int64) * s_stride
    for t in tl.range(0, K // BLOCK_K, loop_unroll_factor=UNROLL):
        k0 = t * BLOCK_K
        x_lo = _prep_x(tl.load(x_rows + k0, mask=x_mask, other=0.0), FP16, DOT_F32, X_PRE)
        x_hi = _prep_x(tl.load(x_rows + (k0 + 16), mask=x_mask, other=0.0), FP16, DOT_F32, X_PRE)
        if W_TMA and TILE_N > 0:
            b = tl.reshape(w_rows.load([expert, tma_tile, t * TILE_N, 0]), (BLOCK_N, HALF))
        elif W_TMA:
            b = tl.reshape(w_rows.load([expert, pid_n * BLOCK_N, t * HALF]), (BLOCK_N, HALF))
        else:
            b = tl.load(w_rows + t * code_step, mask=n_mask[:, None], other=0)
        sb = tl.load(s_rows + t * scale_step, mask=n_mask[:, None], other=0)
        w_lo, w_hi = _dequant_tile(b, sb, gs, BLOCK_N, HALF, IS_MX, FP16, USE_ASM, DOT_F32, PACKED_SCALES)
        if SYNC_DOTS:      # the previous trip's last dot (up, or this projection's) completes first
            if GATED:
                acc_u = _settled(acc_u, DOT_F32)
            else:
                acc = _settled(acc, DOT_F32)
        acc = _mma(w_lo, x_lo, acc, True, DOT_F32)
        acc = _mma(w_hi, x_hi, acc, True, DOT_F32)
        if GATED:
            if W_TMA and TILE_N > 0:
                bu = tl.reshape(wu_rows.load([expert, tma_tile_u, t * TILE_N, 0]), (BLOCK_N, HALF))
            elif W_TMA:
                bu = tl.reshape(wu_rows.load([expert, N + pid_n * BLOCK_N, t * HALF]), (BLOCK_N, HALF))
            else:
                bu = tl.load(wu_rows + t * code_step, mask=n_mask[:, None], other=0)
            sbu = tl.load(su_rows + t * scale_step, mask=n_mask[:, None], other=0)
            u_lo, u_hi = _dequant_tile(bu, sbu, gs, BLOCK_N, HALF, IS_MX, FP16, USE_ASM, DOT_F32, PACKED_SCALES)
            if SYNC_DOTS:
                acc = _settled(acc, DOT_F32)
            acc_u = _mma(u_lo, x_lo, acc_u, True, DOT_F32)
            acc_u = _mma(u_hi, x_hi, acc_u, True, DOT_F32)

    if FP16:
        acc = acc * (gs * acc_factor)
        if GATED:
            acc_u = acc_u * (gs * acc_factor)
    if GATED:
        out = acc / (1.0 + tl.exp(-acc)) * acc_u                 # silu(gate) * up, fp32
        if OUT_SCALED:
            out = out * (1.0 / 256.0)
        y_ptrs = y_ptr + rows.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
        tl.store(y_ptrs, _cast_out(out, y_ptr, DOT_F32), mask=n_mask[:, None] & valid[None, :])
    else:
        tw = tl.load(topk_w_ptr + assign, mask=valid, other=0.0).to(tl.float32)
        out = acc * tw[None, :]
        y_ptrs = y_ptr + assign.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
        tl.store(y_ptrs, _cast_out(out, y_ptr, DOT_F32), mask=n_mask[:, None] & valid[None, :])


@triton.jit(do_not_specialize=["n_assign"])
def _moe_gemm_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, y_ptr, sorted_ids_ptr, block_expert_ptr, topk_w_ptr,
                     N, K, n_assign, stride_we, stride_wn, stride_se, stride_sn, stride_xm, stride_ym,
                     acc_factor,
                     TOP_K: tl.constexpr, GATED: tl.constexpr, IS_MX: tl.constexpr, FP16: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     DOT_F32: tl.constexpr, USE_ASM: tl.constexpr, X_PRE: tl.constexpr,
                     OUT_SCALED: tl.constexpr, W_TMA: tl.constexpr = False, SYNC_DOTS: tl.constexpr = False,
                     PACKED_SCALES: tl.constexpr = False, UNROLL: tl.constexpr = 1,
                     TILE_N: tl.constexpr = 0):
    """One program per (routing block, weight-row tile): grid (num_blocks, cdiv(N, BLOCK_N)); blocks past the
    last expert's run exit at once."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    _moe_tile(pid_m, pid_n, expert, x_ptr, w_ptr, s_ptr, gs_ptr, y_ptr, sorted_ids_ptr, block_expert_ptr,
              topk_w_ptr, N, K, n_assign, stride_we, stride_wn, stride_se, stride_sn, stride_xm, stride_ym,
              acc_factor, TOP_K, GATED, IS_MX, FP16, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, USE_ASM, X_PRE, OUT_SCALED,
              W_TMA, SYNC_DOTS, PACKED_SCALES, UNROLL, TILE_N)


@triton.jit(do_not_specialize=["n_assign", "num_blocks", "num_progs"])
def _moe_gemm_persistent_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, y_ptr, sorted_ids_ptr, block_expert_ptr,
                                topk_w_ptr, N, K, n_assign, stride_we, stride_wn, stride_se, stride_sn, stride_xm,
                                stride_ym, acc_factor,
                                TOP_K: tl.constexpr, GATED: tl.constexpr, IS_MX: tl.constexpr, FP16: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                DOT_F32: tl.constexpr, USE_ASM: tl.constexpr, X_PRE: tl.constexpr,
                                OUT_SCALED: tl.constexpr, W_TMA: tl.constexpr = False,
                                SYNC_DOTS: tl.constexpr = False, PACKED_SCALES: tl.constexpr = False,
                                UNROLL: tl.constexpr = 1, TILE_N: tl.constexpr = 0, num_blocks=0,
                                num_progs=1, BLOCKS_POW2: tl.constexpr = 1, FLATTEN: tl.constexpr = True):
    """The same tiles from num_progs resident programs, each walking tiles num_progs apart (persistent). Why:
    with FLATTEN the compiler pipelines the tile loop and the K loop as one, so a program's loads for its next
    tile are in flight while it finishes the current one (no pipeline fill per tile), and the grid is sized to
    the machine, not to the worst-case routing. The valid blocks (a prefix of block_expert, >= 0) are counted
    here, from the num_blocks entries, so no host value depends on the routing."""
    offs_b = tl.arange(0, BLOCKS_POW2)
    experts = tl.load(block_expert_ptr + offs_b, mask=offs_b < num_blocks, other=-1)
    n_tiles_n = tl.cdiv(N, BLOCK_N)
    n_tiles = tl.sum((experts >= 0).to(tl.int32), axis=0) * n_tiles_n
    for tile in tl.range(tl.program_id(0), n_tiles, num_progs, flatten=FLATTEN):
        pid_m = tile // n_tiles_n
        pid_n = tile % n_tiles_n
        expert = tl.load(block_expert_ptr + pid_m)
        _moe_tile(pid_m, pid_n, expert, x_ptr, w_ptr, s_ptr, gs_ptr, y_ptr, sorted_ids_ptr, block_expert_ptr,
              topk_w_ptr, N, K, n_assign, stride_we, stride_wn, stride_se, stride_sn, stride_xm, stride_ym,
              acc_factor, TOP_K, GATED, IS_MX, FP16, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, USE_ASM, X_PRE, OUT_SCALED,
              W_TMA, SYNC_DOTS, PACKED_SCALES, UNROLL, TILE_N)


# ----------------------------------------------------------------------------------------------------
# Configs and API
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MoEConfig:
    block_m: int = 16
    block_n: int = 64
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 3
    fp16_dot: bool = True
    asm: bool = True
    x_pre: bool = False       # fp16 path: convert the input once (gate/up); the intermediate is then fp16
    gemv: bool = False        # CUDA-core kernel (moe_gemv.py; NVFP4, block_m <= 2, block_k = K per step)
    tma: bool = False         # tensor-core kernel: weight tiles through a TMA tensor descriptor
    gluon: bool = False       # the Gluon kernel (moe_gluon.py; NVFP4, block_m 8/16/32, K % 128 == 0, CUDA):
    #                           block_n = weight rows per program, split over num_warps warps (1, 2, 4: one
    #                           x tile for all), num_stages = its cp.async code ring, block_k = 128; any other
    #                           call runs the Triton kernel instead
    sync_dots: bool = False   # tensor-core kernel: each projection's dots wait for the MMAs in flight (SYNC_DOTS)
    packed_scales: bool = True  # tensor-core kernel: NVFP4 scales decoded 4 bytes per register (PACKED_SCALES)
    unroll: int = 1           # tensor-core kernel: K steps per loop trip (UNROLL)
    persistent: int = 0       # tensor-core kernel: resident programs per SM walking all tiles, their tile and K
    #                           loops pipelined as one (_moe_gemm_persistent_kernel); 0: one program per tile
    max_regs: int = 0         # tensor-core kernel: registers per thread at most (ptxas maxnreg; 0: its choice), for
    #                           more programs per SM
    tile_major: bool = False  # over stacks from layouts.tile_major_experts(w, tile_n, tile_k): the tensor-core kernel
    #                           (block_k = tile_k, block_n a multiple of tile_n: each trip's weight tile whole runs,
    #                           TILE_N) or the GEMV


# The single switch to the Gluon kernel (moe_gluon.py) for NVFP4 decode blocks of 16 and 32 rows: off until
# tools/bench_kernels.py has measured it on an H100 / H200 (the G... configs of its MoE sweep).
GLUON_DEFAULT = False


def gluon_moe_config(block_m: int, gated: bool, x_pre: bool = False, rows: int = 0, stages: int = 3,
                     warps: int = 1) -> MoEConfig:
    """A Gluon config: rows per warp default to moe_gluon.default_rows (the compile-checked no-spill ones)."""
    from .moe_gluon import default_rows

    return MoEConfig(block_m, rows or warps * default_rows(gated, block_m), 128, warps, stages, x_pre=x_pre,
                     gluon=True)


# the CUDA-core path while routed experts average at most this many assignments (H200, E=128 top-8: at 2
# the tensor-core kernel is 1.2x faster than the GEMV with one or two tokens per program; docs/PERF.md)
GEMV_MAX_PER_EXPERT = 1.0
# 16-row blocks while routed experts average at most this many assignments, then 32-row blocks (up to 48).
# H100, 2026-12-07 (tools/bench_kernels.py --configs blocks): at 8 per expert 16-row blocks 166.3 us against
# 174.4 with 32 rows; at 16 per expert 32-row blocks 182.7 us against 204.7 (the 24-layer decode step at batch
# 256: 6.53 ms against 7.11); at 12 per expert 16-row blocks 172.3 us against 175.7 (fourth session): the
# crossover lies between 12 and 16
BLOCK16_MAX_PER_EXPERT = 12.0
# 32-row gate/up blocks with the 16-row blocks' 128-wide K steps and the fp16 operand converted once (x_pre),
# instead of 256-wide steps (139 registers, 84 KB of shared memory: 2 programs per SM) on bf16 x, up to this many
# assignments per expert (0: never): one block per expert where 16-row blocks spill half the experts into a
# second block that dequantizes the same weights again. H100 (2026-12-07, fourth session), against the 256-wide
# steps: 182.7 / 204.7 us at 16 per expert, 249.6 / 287.0 at 32, 343.3 / 387.9 at 48 -- the whole 32-row range
BLOCK32_NARROW_K_MAX_PER_EXPERT = 48.0
# MoEConfig.sync_dots of the heuristic's tensor-core configs, per projection: without it ptxas serializes every
# wgmma of the kernel (C7513 / C7515; tools/inspect_moe_sm90.py prints its verdict); with it each dot's wgmmas go
# as one batch (5-6% fewer loop instructions, more registers). H100, 2026-12-07 (tools/bench_kernels.py --configs
# sync, whole MoE layer): on gate/up 178.2 -> 167.5 us at T = 256, 248.5 -> 240.7 at 512, 161.0 -> 159.5 at 128;
# on down within +-0.5% (so off: 125 -> 156 registers at 32-row blocks for nothing)
SYNC_DOTS = {"gate_up": True, "down": False}
# MoEConfig.persistent (resident programs per SM) of the heuristic's 16-row gate/up configs; 0: one program per tile.
# H100, 2026-12-08 (tools/bench_kernels.py --configs sync, whole MoE layer at T = 128, 8 per expert): 5 per SM
# 159.7 -> 156.6 us; on down 165.2 (slower), at 32-row blocks 167.8 -> 169.1 (T = 256), so off there. Off here too
# until the decode step has measured it (bench_rollout --moe-persistent)
PERSISTENT_GATE_UP_BLOCK16 = 0
# The tile (rows, K) of the engine's tile-major expert stacks (rollout/kernel_linears.prepare: layouts.
# tile_major_experts, and the heuristic's configs for them, tile=w.tile), or None: row-major stacks. Off until the
# grouped kernel and the decode step have measured it (bench_kernels --configs layout, bench_rollout
# --moe-tile-major); the GEMV reads them too, the Gluon kernel does not
EXPERT_STACK_TILE = None


def heuristic_moe_config(n_assign: int, num_experts: int, n: int, k: int, gated: bool,
                         fmt: str = "nvfp4", gemv: bool = True, tile: Optional[tuple] = None) -> MoEConfig:
    """sm_90 choice (docs/PERF.md): NVFP4 with <= GEMV_MAX_PER_EXPERT assignments per expert takes the
    CUDA-core GEMV (one token per program); otherwise block_m by tokens per expert; the fp16 input operand
    is converted by a separate kernel (x_pre) only once there are enough assignments to pay for the extra
    launch; the down projection uses 64-row weight tiles with 16-token blocks, 128-row tiles with larger
    blocks. gemv=False: the tensor-core choice regardless. Each choice is the fastest of the sweep in
    tools/bench_kernels.py --configs all at E=128, H=2048, F=768, top-8. tile: the stacks' `PreparedFP4Weight.tile`
    (tile-major stacks): the same choice, the tensor-core kernel's K steps of the tile's width and its weight tiles
    whole row tiles, never the Gluon kernel."""
    per_expert = n_assign / max(1, num_experts)
    if gemv and fmt == "nvfp4" and per_expert <= GEMV_MAX_PER_EXPERT and (tile is None or _bk(k) % tile[1] == 0):
        # gate/up tiles hold gate and up rows: 32 of each match the loads in flight of 64 down rows
        return MoEConfig(1, 32 if gated else 64, _bk(k), 4, 1, gemv=True, tile_major=tile is not None)
    bm = 16 if per_expert <= BLOCK16_MAX_PER_EXPERT else (32 if per_expert <= 48 else 64)
    block32_narrow = bm == 32 and per_expert <= BLOCK32_NARROW_K_MAX_PER_EXPERT
    x_pre = (bm == 16 or block32_narrow) and n_assign >= 64
    if GLUON_DEFAULT and tile is None and fmt == "nvfp4" and bm in (16, 32) and k % 128 == 0:
        # the fp16 operand at both block sizes: the Gluon kernel converts bf16 x per program and trip, +25-45%
        # instructions in its loop (tools/inspect_moe_sm90.py --bf16-x)
        return gluon_moe_config(bm, gated, n_assign >= 64)
    bn = 64 if gated or bm == 16 else 128
    # 128-wide K steps (not 256) for 16-token blocks and every down projection up to 32-token blocks:
    # 1.15-1.2x faster end to end at 2-8 tokens per expert, 1.1x at 32 (H200, docs/PERF.md)
    narrow_k = bm == 16 or (bm == 32 and (not gated or block32_narrow))
    bk = min(128, _bk(k)) if narrow_k else _bk(k)
    if tile is not None:        # whole row tiles per weight tile, the tile's K steps
        bn, bk = -(-bn // tile[0]) * tile[0], tile[1]
    # NVFP4 weight tiles by TMA: 1.10-1.11x end to end at 32-128 tokens (H200, docs/PERF.md)
    return MoEConfig(bm, bn, bk, 4, 3 if bm <= 32 else 2, x_pre=x_pre, tma=fmt == "nvfp4",
                     sync_dots=SYNC_DOTS["gate_up" if gated else "down"],
                     persistent=PERSISTENT_GATE_UP_BLOCK16 if gated and bm == 16 else 0, tile_major=tile is not None)


def converts_input(cfg: MoEConfig, fmt: str) -> bool:
    """Whether the gate/up projection under cfg first converts its input to the fp16 operand (one launch)."""
    return cfg.x_pre and cfg.fp16_dot and fmt == "nvfp4" and not cfg.gemv


def _launch(x, w: PreparedFP4Weight, y, routing: MoERouting, topk_w, gated: bool, cfg: MoEConfig):
    """x: bf16 activations, or (fp16 path) the fp16 operand x * 2^-8; y: bf16, or fp16 for a scaled
    intermediate (gate/up with x_pre)."""
    if cfg.sync_dots and (cfg.gemv or cfg.gluon):
        raise ValueError("MoE config sync_dots is a Triton tensor-core kernel option; the GEMV and the Gluon "
                         "kernel take sync_dots=False")
    for name, value, neutral in (("unroll", cfg.unroll, 1), ("persistent", cfg.persistent, 0),
                                 ("max_regs", cfg.max_regs, 0)):
        if value != neutral and (cfg.gemv or cfg.gluon):
            raise ValueError(f"MoE config {name}={value} is a Triton tensor-core kernel option; the GEMV and the "
                             f"Gluon kernel take {name}={neutral}")
    if w.tile is not None or cfg.tile_major:
        if (cfg.gluon or not cfg.tile_major or w.tile is None
                or not cfg.gemv and (cfg.block_k != w.tile[1] or cfg.block_n % w.tile[0])):
            raise ValueError(f"MoE weights with tile={w.tile} under a config with tile_major={cfg.tile_major}, "
                             f"block_n={cfg.block_n}, block_k={cfg.block_k}{', gemv' if cfg.gemv else ''}"
                             f"{', gluon' if cfg.gluon else ''}: tile-major stacks are read by the tensor-core kernel "
                             "(tile_major=True, their tile width as block_k, whole row tiles as block_n) and the GEMV "
                             "(tile_major=True), not the Gluon kernel; heuristic_moe_config(..., tile=w.tile) picks "
                             "such a config; row-major stacks need tile_major=False")
    if cfg.persistent < 0:
        raise ValueError(f"MoE config persistent={cfg.persistent}: programs per SM must be >= 0 (0: one per tile)")
    if cfg.unroll < 1:
        raise ValueError(f"MoE config unroll={cfg.unroll}: K steps per loop trip must be >= 1")
    n = w.n // 2 if gated else w.n
    k = w.k
    if cfg.gluon:
        from .moe_gluon import launch as launch_gluon, takes

        if cfg.fp16_dot and takes(x, w, y, cfg.block_m, cfg.block_n, cfg.num_warps):
            return launch_gluon(x, w, y, routing, topk_w, gated, cfg.block_n, cfg.num_stages, cfg.num_warps)
        # not the Gluon kernel's call (MXFP4, no GPU, another block_m ...): the Triton kernel's usual tiles
        cfg = replace(cfg, gluon=False, block_n=64, block_k=min(128, _bk(k)), num_warps=4,
                      num_stages=max(2, cfg.num_stages))
    if k % cfg.block_k:
        raise ValueError(f"MoE config block_k={cfg.block_k} does not divide K={k}")
    if cfg.tile_major and n % w.tile[0]:
        raise ValueError(f"tile-major stacks of {w.tile[0]}-row tiles do not divide the projection's {n} rows: "
                         "gate/up stacks need whole gate and up tiles")
    if cfg.gemv:
        from .moe_gemv import launch_moe_gemv

        return launch_moe_gemv(x, w, y, routing, topk_w, gated, cfg.block_n, cfg.block_k // 32, cfg.num_warps,
                               INTERPRET, cfg.asm)
    is_mx = w.fmt == "mxfp4"
    fp16 = cfg.fp16_dot and not is_mx
    use_tma = cfg.tma and tma_compatible(w.qweight) and (cfg.block_k // 2) % 16 == 0   # else pointer loads
    tile_n = w.tile[0] if cfg.tile_major else 0
    if use_tma and tile_n:      # [E, row tiles, trips x tile rows, K step bytes]: a box of whole row tiles
        codes = w.qweight.view(w.num_experts, w.n // tile_n, -1, cfg.block_k // 2)
        q = weight_descriptor(codes, [1, cfg.block_n // tile_n, tile_n, cfg.block_k // 2])
    else:
        q = weight_descriptor(w.qweight, [1, cfg.block_n, cfg.block_k // 2]) if use_tma else w.qweight
    args = (x, q, w.scales, w.global_scale, y, routing.sorted_ids, routing.block_expert,
            topk_w if topk_w is not None else w.global_scale,
            n, k, routing.n_assign, w.qweight.stride(0), w.qweight.stride(1), w.scales.stride(0),
            w.scales.stride(1), x.stride(0), y.stride(0), FP16_ACC_FACTOR)
    consts = dict(TOP_K=routing.top_k, GATED=gated, IS_MX=is_mx, FP16=fp16, BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_F32=INTERPRET, USE_ASM=cfg.asm and not INTERPRET,
                  X_PRE=fp16 and x.dtype == torch.float16, OUT_SCALED=y.dtype == torch.float16, W_TMA=use_tma,
                  SYNC_DOTS=cfg.sync_dots, PACKED_SCALES=cfg.packed_scales, UNROLL=cfg.unroll,
                  TILE_N=tile_n,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.max_regs:
        consts["maxnreg"] = cfg.max_regs
    tiles = routing.num_blocks * triton.cdiv(n, cfg.block_n)
    if cfg.persistent:
        progs = max(1, min(tiles, _multiprocessors(x.device) * cfg.persistent))
        _moe_gemm_persistent_kernel[(progs,)](*args, num_blocks=routing.num_blocks, num_progs=progs,
                                              BLOCKS_POW2=triton.next_power_of_2(routing.num_blocks), **consts)
    else:
        _moe_gemm_kernel[(routing.num_blocks, triton.cdiv(n, cfg.block_n))](*args, **consts)
    return y


def _multiprocessors(device: torch.device) -> int:
    """SMs of the device (the persistent kernel's programs are a multiple of it); 4 off the GPU (interpreter)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def moe_gate_up(x: torch.Tensor, w13: PreparedFP4Weight, routing: MoERouting,
                config: Optional[MoEConfig] = None, x_operand: Optional[torch.Tensor] = None) -> torch.Tensor:
    """silu(x W1^T) * (x W3^T) per assignment, rows in sorted order: [num_blocks * block_m, F], bf16, or with
    cfg.x_pre (fp16 path) fp16 holding the value * 2^-8 (what moe_down consumes directly). x_operand: the
    caller's to_fp16_operand(x) (e.g. written by the norm before), used instead of converting x here."""
    f = w13.n // 2
    cfg = config or heuristic_moe_config(routing.n_assign, w13.num_experts, f, w13.k, True, w13.fmt, tile=w13.tile)
    if cfg.block_m != routing.block_m:
        raise ValueError(f"config block_m={cfg.block_m} differs from the routing's {routing.block_m}")
    pre = converts_input(cfg, w13.fmt)
    if pre and x.dtype != torch.float16:
        if x_operand is None:
            x = to_fp16_operand(x)
        elif x_operand.shape != x.shape or x_operand.dtype != torch.float16 or not x_operand.is_contiguous():
            raise ValueError(f"x_operand must be contiguous float16 {tuple(x.shape)}, got {x_operand.dtype} "
                             f"{tuple(x_operand.shape)}")
        else:
            x = x_operand
    h = torch.empty((routing.sorted_ids.numel(), f), device=x.device,
                    dtype=torch.float16 if pre else torch.bfloat16)
    return _launch(x, w13, h, routing, None, True, cfg)


def to_fp16_operand(x: torch.Tensor) -> torch.Tensor:
    """float16(x * 2^-8): the fp16 path's activation operand (one small kernel)."""
    from .w4a16_gemm import _x_to_f16_kernel

    x = x.contiguous()
    out = torch.empty(x.shape, device=x.device, dtype=torch.float16)
    _x_to_f16_kernel[(triton.cdiv(x.numel(), 2048),)](x, out, x.numel(), BLOCK=2048, num_warps=4)
    return out


def moe_down(h: torch.Tensor, w2: PreparedFP4Weight, routing: MoERouting, topk_weights: torch.Tensor,
             config: Optional[MoEConfig] = None) -> torch.Tensor:
    """Down projection of the sorted intermediate rows (moe_gate_up's output), times the router weight:
    bf16 [T * k, H]."""
    cfg = config or heuristic_moe_config(routing.n_assign, w2.num_experts, w2.n, w2.k, False, w2.fmt, tile=w2.tile)
    if cfg.block_m != routing.block_m:
        raise ValueError(f"config block_m={cfg.block_m} differs from the routing's {routing.block_m}")
    if cfg.gemv and h.dtype == torch.float16:       # the tensor-core gate/up's scaled fp16 operand
        h = (h.float() * 256.0).to(torch.bfloat16)
    y = torch.empty((routing.n_assign, w2.n), device=h.device, dtype=torch.bfloat16)
    tw = topk_weights.reshape(-1).to(torch.float32).contiguous()
    return _launch(h, w2, y, routing, tw, False, cfg)


def moe_w4a16(x: torch.Tensor, w13: PreparedFP4Weight, w2: PreparedFP4Weight, topk_ids: Optional[torch.Tensor],
              topk_weights: torch.Tensor, *, routing: Optional[MoERouting] = None,
              gate_up_config: Optional[MoEConfig] = None, down_config: Optional[MoEConfig] = None,
              combine: bool = True, x_operand: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Routed-expert SwiGLU MLP: sum_j topk_w[t, j] * W2[e] (silu(W1[e] x_t) * W3[e] x_t), e = topk_ids[t, j].

    x [T, H] bf16; w13 prepared [E, 2F, H] (gate rows first); w2 prepared [E, H, F]. Returns [T, H] bf16, or
    with combine=False the k weighted expert outputs [T, k, H] (bf16) for the caller to sum in its precision.
    Pass `routing` (from moe_align) to reuse one sort across layers that share the routing, and `x_operand`
    (to_fp16_operand of x in bf16, see moe_gate_up) when the caller already has it.
    """
    if w13.num_experts is None or w2.num_experts is None:
        raise ValueError("moe_w4a16 needs expert stacks ([E, N, K/2]) from prepare_*_weight")
    if x.shape[-1] != w13.k or w2.k != w13.n // 2 or w2.n != w13.k:
        raise ValueError(f"shapes do not chain: x {tuple(x.shape)}, w13 [E, {w13.n}, {w13.k}], "
                         f"w2 [E, {w2.n}, {w2.k}]")
    x = x.to(torch.bfloat16)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if routing is None and topk_ids is None:
        raise ValueError("pass topk_ids or a routing from moe_align")
    t, k = (routing.n_tokens, routing.top_k) if routing is not None else topk_ids.shape
    if routing is None:
        bm = (gate_up_config.block_m if gate_up_config else
              heuristic_moe_config(t * k, w13.num_experts, w13.n // 2, w13.k, True, w13.fmt, tile=w13.tile).block_m)
        routing = moe_align(topk_ids, w13.num_experts, bm)
    h = moe_gate_up(x, w13, routing, gate_up_config, x_operand)
    if down_config is None:
        if gate_up_config is None or w2.tile is not None:
            down_config = replace(heuristic_moe_config(routing.n_assign, w2.num_experts, w2.n, w2.k, False, w2.fmt,
                                                       tile=w2.tile), block_m=routing.block_m)
        elif gate_up_config.gluon:
            down_config = gluon_moe_config(routing.block_m, False, stages=gate_up_config.num_stages,
                                           warps=gate_up_config.num_warps)
        else:
            g = gate_up_config
            down_config = MoEConfig(routing.block_m, 64 if g.gemv else 128, _bk(w2.k), 4, 1 if g.gemv else 3,
                                    g.fp16_dot, g.asm, g.x_pre, g.gemv)
    if h.dtype == torch.float16 and not (down_config.fp16_dot and w2.fmt == "nvfp4"):
        h = (h.float() * 256.0).to(torch.bfloat16)
    y = moe_down(h, w2, routing, topk_weights, down_config)
    return y.view(t, k, -1).sum(dim=1) if combine else y.view(t, k, -1)


def _bk(k: int) -> int:
    bk = 256
    while bk > 32 and k % bk:
        bk //= 2
    return bk


def moe_w4a16_reference(x: torch.Tensor, w13: PreparedFP4Weight, w2: PreparedFP4Weight,
                        topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        dequantized: Optional[tuple] = None) -> torch.Tensor:
    """Torch reference: per-expert loop of dequantize (codec) + fp32 matmuls; bf16 intermediate like the
    kernel. `dequantized` = (w13, w2) float32 stacks, to skip the dequantization on repeated calls."""
    from .layouts import dequantize_prepared

    if dequantized is None:
        dequantized = (dequantize_prepared(w13, torch.float32), dequantize_prepared(w2, torch.float32))
    w13d, w2d = dequantized
    f = w13.n // 2
    t, k = topk_ids.shape
    out = torch.zeros(t, w2.n, dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in torch.unique(topk_ids).tolist():
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        g = xf[tok] @ w13d[e, :f].t()
        u = xf[tok] @ w13d[e, f:].t()
        h = (torch.nn.functional.silu(g) * u).to(torch.bfloat16).float()
        y = (h @ w2d[e].t()) * topk_weights[tok, slot].float()[:, None]
        out.index_add_(0, tok, y)
    return out.to(torch.bfloat16)
