"""Fused norm / RoPE / KV-write kernels for the static decode step (rollout/static_decode.py).

At decode batch sizes a step is bound by kernel launches, not bytes: torch's RMSNorm is ~10 kernels,
Megatron's unfused RoPE ~10 per tensor plus cos/sin per call, the cache write two index_put. These kernels
do each group of them in one launch, with the numerics of the torch op sequence they replace:
- `add_rmsnorm`: residual add + RMSNorm with AQN noise (models/aqn_norm.py RMSNorm.forward), one program
  per row; x may be the k routed-expert slot outputs [B, k, N] of an MoE layer, summed here in fp32 in slot
  order and rounded to the model dtype (what `.float().sum(1).to(dtype)` computes, minus three launches and
  an fp32 [B, k, N] temporary); it can also write y's conversions for the next consumers (the router's
  float32 input, the grouped expert kernels' fp16 operand), which saves their launches; `embed_rmsnorm`
  takes the rows from an embedding table by token id instead (the first norm);
- `qk_norm_rope_cache`: from the QKV linear's output (Megatron's per-group layout), QK-norm, RoPE on the
  query heads and the key, the K/V cache write at (slot, position), the query out; one program per
  (row, KV group).
Every intermediate the torch code rounds to the model dtype is rounded here too (w + noise in the weight's
dtype, the residual sum, the normed q/k, each RoPE product and their sum), through kernels/rounding.py so
that the CPU interpreter rounds to nearest even like the GPU. What stays different: the order of the fp32
sum of squares (and rsqrt's last bit), so bf16 outputs agree bit for bit except for rare 1-ulp flips.
Each kernel has its torch reference (`*_reference`); tests/test_kernels_decode_fused.py ties them together
and the references to the model's modules. No host synchronisation: CUDA graphs capture these launches.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .rounding import _cast_out, _to_bf16
from .w4a16_gemm import INTERPRET


@triton.jit
def _round_like(x, ptr, RNE: tl.constexpr):
    """Round an fp32 value to ptr's element type and back: the rounding a torch op in that dtype does."""
    return _cast_out(x, ptr, RNE).to(tl.float32)


@triton.jit
def _norm_weight(w_ptr, noise_ptr, offs, mask, HAS_NOISE: tl.constexpr, RNE: tl.constexpr):
    """weight + noise.to(weight.dtype), added in the weight's dtype (RMSNorm.effective_weight), as fp32."""
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_NOISE:
        z = _round_like(tl.load(noise_ptr + offs, mask=mask, other=0.0).to(tl.float32), w_ptr, RNE)
        w = _round_like(w + z, w_ptr, RNE)
    return w


# ------------------------------------------------------------------------------------ add + RMSNorm
@triton.jit
def _add_rmsnorm_kernel(x_ptr, res_ptr, ids_ptr, w_ptr, noise_ptr, y_ptr, h_ptr, wide_ptr, f16_ptr, N, eps,
                        stride_x, stride_slot, stride_res, stride_y, stride_h,
                        HAS_RESIDUAL: tl.constexpr, GATHER: tl.constexpr, HAS_NOISE: tl.constexpr,
                        WRITE_H: tl.constexpr, SLOTS: tl.constexpr, BLOCK: tl.constexpr, RNE: tl.constexpr,
                        WIDE: tl.constexpr, F16_OPERAND: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    if GATHER:                                                       # x is an embedding table
        src = tl.load(ids_ptr + row).to(tl.int64)
    else:
        src = row
    h = tl.load(x_ptr + src * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if SLOTS > 1:                                                    # expert slot outputs: fp32 sum in order
        for j in tl.static_range(1, SLOTS):
            h += tl.load(x_ptr + src * stride_x + j * stride_slot + cols, mask=mask, other=0.0).to(tl.float32)
        h = _round_like(h, h_ptr, RNE)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        h = _round_like(r + h, h_ptr, RNE)                             # residual + x in x's dtype
    if WRITE_H:
        tl.store(h_ptr + row * stride_h + cols, h.to(h_ptr.dtype.element_ty), mask=mask)   # exact
    rstd = tl.rsqrt(tl.sum(h * h, 0) / N + eps)
    w = _norm_weight(w_ptr, noise_ptr, cols, mask, HAS_NOISE, RNE)
    y = (h * rstd) * w
    tl.store(y_ptr + row * stride_y + cols, _cast_out(y, y_ptr, RNE), mask=mask)
    if WIDE or F16_OPERAND:
        # conversions of the stored y for the next consumers (rows with y's stride), from y read back after a
        # barrier: they hang off memory, not off y's values, so they cannot change how the compiler lays out
        # (and so sums) the norm above
        tl.debug_barrier()
        ys = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0)
        if WIDE:                                                     # y.to(wide dtype): exact
            tl.store(wide_ptr + row * stride_y + cols, ys.to(wide_ptr.dtype.element_ty), mask=mask)
        if F16_OPERAND:                                              # to_fp16_operand(y.to(bfloat16))
            yb = _to_bf16(ys.to(tl.float32), RNE).to(tl.float32)
            tl.store(f16_ptr + row * stride_y + cols, (yb * (1.0 / 256.0)).to(tl.float16), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _check_norm_params(weight: torch.Tensor, noise: Optional[torch.Tensor], n: int) -> None:
    if weight.shape != (n,) or (noise is not None and noise.shape != (n,)):
        raise ValueError(f"norm weight / noise must be [{n}], got {tuple(weight.shape)} / "
                         f"{None if noise is None else tuple(noise.shape)}")


def _launch_norm(x2, res2, ids, weight, noise, eps, y2, h2, n_rows: int, gather: bool, write_h: bool,
                 slots: int = 1, wide=None, f16=None) -> None:
    """x2: rows [R, N], or with slots > 1 slot outputs [R, slots, N] (unit stride along N); wide / f16: extra
    outputs laid out like y2."""
    n = weight.shape[0]
    block = triton.next_power_of_2(n)
    w = weight.contiguous()
    z = noise.contiguous() if noise is not None else w
    _add_rmsnorm_kernel[(n_rows,)](
        x2, res2 if res2 is not None else x2, ids if ids is not None else x2, w, z, y2, h2,
        wide if wide is not None else y2, f16 if f16 is not None else y2, n, float(eps),
        x2.stride(0), x2.stride(1) if slots > 1 else 0, res2.stride(0) if res2 is not None else 0, y2.stride(0),
        h2.stride(0), HAS_RESIDUAL=res2 is not None, GATHER=gather, HAS_NOISE=noise is not None, WRITE_H=write_h,
        SLOTS=slots, BLOCK=block, RNE=INTERPRET, WIDE=wide is not None, F16_OPERAND=f16 is not None,
        num_warps=min(16, max(1, block // 512)))


def add_rmsnorm(x: torch.Tensor, weight: torch.Tensor, noise: Optional[torch.Tensor], eps: float,
                residual: Optional[torch.Tensor] = None, slots: bool = False, wide: Optional[torch.Tensor] = None,
                f16_operand: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h): h = residual + x (in x's dtype; h = x without a residual), y = RMSNorm_{weight+noise}(h).

    x / residual [..., N] of one dtype, weight [N] (model dtype), noise [N] (the AQN buffer, any float
    dtype) or None. slots: x is [R, k, N], the k expert slot outputs of residual's R rows, and the x above
    is their fp32 sum in slot order rounded to x's dtype. One launch; h is the new residual stream (x itself
    when there is neither a residual nor slots).
    wide / f16_operand (bfloat16 x only): contiguous tensors of y's shape that the same launch also fills, saving
    the consumers' conversion launches: wide with y.to(wide.dtype) (float32 / float64: the router's input), f16_operand with moe_grouped_gemm.to_fp16_operand(y.to(torch.bfloat16)) (the
    fp16 operand of the grouped expert kernels)."""
    n = x.shape[-1]
    _check_norm_params(weight, noise, n)
    rows_shape = x.shape[:-2] + x.shape[-1:] if slots else x.shape
    if slots and (x.dim() != 3 or x.stride(-1) != 1):
        raise ValueError(f"slot outputs must be [rows, k, N] with unit stride along N, got {tuple(x.shape)}")
    if residual is not None and (residual.shape != rows_shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match x "
                         f"{tuple(rows_shape)} {x.dtype}")
    if (wide is not None or f16_operand is not None) and x.dtype != torch.bfloat16:
        # on the H200 the float32 variant with the extra stores compiled to a norm that sums differently
        # (y off by an ulp against the plain launch); the bfloat16 one is bit-identical (GPU tests)
        raise ValueError(f"wide / f16_operand need a bfloat16 x (the GPU-checked variant), got {x.dtype}; convert "
                         "after the norm instead")
    wide_ok = (torch.float32, torch.float64)
    for name, t, dtypes in (("wide", wide, wide_ok), ("f16_operand", f16_operand, (torch.float16,))):
        if t is not None and (t.shape != rows_shape or not t.is_contiguous() or t.dtype not in dtypes
                              or t.device != x.device):
            raise ValueError(f"{name} must be a contiguous {tuple(rows_shape)} tensor in one of {dtypes} on "
                             f"{x.device}, got {t.dtype} {tuple(t.shape)}")
    x2 = x if slots else _rows(x)
    res2 = _rows(residual) if residual is not None else None
    y2 = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    new_h = residual is not None or slots
    h2 = torch.empty_like(y2) if new_h else x2
    if x2.shape[0]:
        _launch_norm(x2, res2, None, weight, noise, eps, y2, h2, x2.shape[0], gather=False, write_h=new_h,
                     slots=x.shape[1] if slots else 1, wide=wide, f16=f16_operand)
    h = h2.view(rows_shape) if new_h else x
    return y2.view(rows_shape), h


def embed_rmsnorm(tokens: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, noise: Optional[torch.Tensor],
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h): h = table[tokens] (F.embedding), y = RMSNorm_{weight+noise}(h); the first layer's norm
    fused with the embedding gather. tokens int [B], table [V, N]."""
    n = table.shape[-1]
    _check_norm_params(weight, noise, n)
    if table.dim() != 2 or table.stride(-1) != 1 or tokens.dim() != 1:
        raise ValueError(f"need a contiguous [V, N] table and [B] tokens, got {tuple(table.shape)} / "
                         f"{tuple(tokens.shape)}")
    b = tokens.shape[0]
    y = torch.empty((b, n), dtype=table.dtype, device=table.device)
    h = torch.empty_like(y)
    if b:
        _launch_norm(table, None, tokens, weight, noise, eps, y, h, b, gather=True, write_h=True)
    return y, h


def rmsnorm_reference(h: torch.Tensor, weight: torch.Tensor, noise: Optional[torch.Tensor],
                      eps: float) -> torch.Tensor:
    """models/aqn_norm.py RMSNorm.forward with weight and noise given as tensors."""
    w = weight if noise is None else weight + noise.to(weight.dtype)
    hf = h.float()
    y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * w.float()).to(h.dtype)


def sum_slots(x: torch.Tensor) -> torch.Tensor:
    """[R, k, N] expert slot outputs -> [R, N]: fp32 sum in slot order, rounded to x's dtype."""
    acc = x[:, 0].float()
    for j in range(1, x.shape[1]):
        acc = acc + x[:, j].float()
    return acc.to(x.dtype)


def add_rmsnorm_reference(x, weight, noise, eps, residual=None, slots=False) -> tuple[torch.Tensor, torch.Tensor]:
    if slots:
        x = sum_slots(x)
    h = x if residual is None else residual + x
    return rmsnorm_reference(h, weight, noise, eps), h


# ------------------------------------------------------------------- QK-norm + RoPE + KV cache write
@triton.jit
def _qk_norm_rope_cache_kernel(mixed_ptr, qw_ptr, kw_ptr, qz_ptr, kz_ptr, cos_ptr, sin_ptr, pos_ptr, slots_ptr,
                               kc_ptr, vc_ptr, q_ptr, eps, stride_mixed, stride_rope, stride_slot, stride_pos,
                               NUM_HEADS, HPG: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                               ROT: tl.constexpr, NORM: tl.constexpr, Q_NOISE: tl.constexpr,
                               K_NOISE: tl.constexpr, RNE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    pos = tl.load(pos_ptr + b).to(tl.int64)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    # the group's HPG query heads and its key head are HPG + 1 consecutive head rows of `mixed`
    r = tl.arange(0, ROWS)
    c = tl.arange(0, D_PAD)
    is_key = r == HPG
    rmask = r <= HPG
    cmask = c < D
    mask = rmask[:, None] & cmask[None, :]
    base = mixed_ptr + b * stride_mixed + g * (HPG + 2) * D
    rows = base + r[:, None] * D
    t = tl.load(rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
    # rotate_half pairs channel c with c -/+ ROT/2 (first ROT channels); the partner's normed value is
    # recomputed from its own input with the row's rstd: the same elementwise formula, the same bits
    half: tl.constexpr = ROT // 2
    rot = c < ROT
    partner = tl.where(rot, tl.where(c < half, c + half, c - half), c)
    tp = tl.load(rows + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if NORM:
        rstd = tl.rsqrt(tl.sum(t * t, 1) / D + eps)
        wq = _norm_weight(qw_ptr, qz_ptr, c, cmask, Q_NOISE, RNE)
        wk = _norm_weight(kw_ptr, kz_ptr, c, cmask, K_NOISE, RNE)
        wq_p = _norm_weight(qw_ptr, qz_ptr, partner, cmask, Q_NOISE, RNE)
        wk_p = _norm_weight(kw_ptr, kz_ptr, partner, cmask, K_NOISE, RNE)
        w = tl.where(is_key[:, None], wk[None, :], wq[None, :])
        w_p = tl.where(is_key[:, None], wk_p[None, :], wq_p[None, :])
        t = _round_like((t * rstd[:, None]) * w, q_ptr, RNE)
        tp = _round_like((tp * rstd[:, None]) * w_p, q_ptr, RNE)
    # Megatron's non-interleaved RoPE in the model dtype: t*cos + rotate_half(t)*sin, each step rounded
    rmask_c = rot & cmask
    cos = tl.load(cos_ptr + pos * stride_rope + c, mask=rmask_c, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_rope + c, mask=rmask_c, other=0.0).to(tl.float32)
    t_rot = tl.where((c < half)[None, :], -tp, tp)
    roped = _round_like(_round_like(t * cos[None, :], q_ptr, RNE) + _round_like(t_rot * sin[None, :], q_ptr, RNE),
                        q_ptr, RNE)
    out = tl.where(rot[None, :], roped, t)
    # queries -> q [B, H, D]; the key -> k_cache[slot, pos, g]; the raw value -> v_cache[slot, pos, g]
    q_rows = (b * NUM_HEADS + g * HPG + r).to(tl.int64)
    qmask = (r < HPG)[:, None] & cmask[None, :]
    tl.store(q_ptr + q_rows[:, None] * D + c[None, :], _cast_out(out, q_ptr, RNE), mask=qmask)
    cache_row = slot * stride_slot + pos * stride_pos + g * D
    kmask = is_key[:, None] & cmask[None, :]
    tl.store(kc_ptr + cache_row + (r[:, None] * 0) + c[None, :], _cast_out(out, kc_ptr, RNE), mask=kmask)
    v = tl.load(base + (HPG + 1) * D + c, mask=cmask, other=0.0)
    tl.store(vc_ptr + cache_row + c, _cast_out(v.to(tl.float32), vc_ptr, RNE), mask=cmask)


def rope_tables(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [max_len, rot_dim] in the model dtype from RotaryEmbedding angles [max_len, 1, 1, rot_dim]:
    what Megatron's unfused RoPE computes per call (`(torch.cos(freqs) * mscale).to(t.dtype)`, mscale 1)."""
    f = freqs.reshape(freqs.shape[0], freqs.shape[-1])
    return torch.cos(f).to(dtype).contiguous(), torch.sin(f).to(dtype).contiguous()


def qk_norm_rope_cache(mixed: torch.Tensor, q_weight: Optional[torch.Tensor], k_weight: Optional[torch.Tensor],
                       eps: float, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                       slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                       num_groups: int, head_dim: int, q_noise: Optional[torch.Tensor] = None,
                       k_noise: Optional[torch.Tensor] = None) -> torch.Tensor:
    """QK-norm + RoPE on the QKV linear's output and the K/V cache write, in one launch; returns q [B, H, D].

    mixed [B, G*(H/G+2)*D] (per group: H/G query heads, one key, one value); q_weight / k_weight [D] (both,
    or both None: no QK-norm) with optional AQN noise [D]; cos / sin [max_len, rot_dim] (`rope_tables`)
    read at positions[b]; the normed, roped key and the raw value go to k_cache / v_cache [S, L, G, D] at
    [slots[b], positions[b]]. positions / slots int [B] device tensors (not checked: no host sync)."""
    B = mixed.shape[0]
    G, D = num_groups, head_dim
    if num_heads % G or mixed.dim() != 2 or mixed.shape[1] != G * (num_heads // G + 2) * D:
        raise ValueError(f"mixed {tuple(mixed.shape)} is not [B, G*(H/G+2)*D] for H={num_heads} G={G} D={D}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("pass both QK-norm weights or neither")
    for nm, w in (("q_weight", q_weight), ("k_weight", k_weight), ("q_noise", q_noise), ("k_noise", k_noise)):
        if w is not None and w.shape != (D,):
            raise ValueError(f"{nm} must be [{D}], got {tuple(w.shape)}")
    rot = cos.shape[-1]
    if cos.shape != sin.shape or cos.dim() != 2 or rot % 2 or rot > D or cos.stride() != sin.stride():
        raise ValueError(f"cos / sin must be [max_len, even rot_dim <= {D}], got {tuple(cos.shape)}")
    if cos.dtype != mixed.dtype or sin.dtype != mixed.dtype:
        raise ValueError(f"cos / sin must be in the model dtype {mixed.dtype} (RoPE rounds them to it)")
    if (k_cache.shape != v_cache.shape or k_cache.dim() != 4 or k_cache.shape[2:] != (G, D)
            or k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1 or k_cache.stride(2) != D):
        raise ValueError(f"caches must be [S, L, {G}, {D}] with contiguous heads, got {tuple(k_cache.shape)}")
    m = mixed if mixed.stride(-1) == 1 else mixed.contiguous()
    q = torch.empty((B, num_heads, D), dtype=mixed.dtype, device=mixed.device)
    if B == 0:
        return q
    hpg = num_heads // G
    norm = q_weight is not None
    qw = q_weight.contiguous() if norm else m
    kw = k_weight.contiguous() if norm else m
    _qk_norm_rope_cache_kernel[(B, G)](
        m, qw, kw, q_noise if q_noise is not None else qw, k_noise if k_noise is not None else kw, cos, sin,
        positions, slots, k_cache, v_cache, q, float(eps), m.stride(0), cos.stride(0), k_cache.stride(0),
        k_cache.stride(1), num_heads, HPG=hpg, ROWS=triton.next_power_of_2(hpg + 1), D=D,
        D_PAD=triton.next_power_of_2(D), ROT=rot, NORM=norm, Q_NOISE=norm and q_noise is not None,
        K_NOISE=norm and k_noise is not None, RNE=INTERPRET, num_warps=4,
        # no FMA contraction: torch rounds each RoPE product before the sum (with FMAs 13-15% of the bf16
        # outputs and the fp32 ones differed from the reference on an H200, 2026-12-02)
        enable_fp_fusion=False)
    return q


def rotate_half_rope_reference(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Megatron's `_apply_rotary_pos_emb_bshd` (non-interleaved, mscale 1) with precomputed cos_ / sin_."""
    r = cos.shape[-1]
    t_rot, t_pass = t[..., :r], t[..., r:]
    x1, x2 = torch.chunk(t_rot, 2, dim=-1)
    return torch.cat((t_rot * cos + torch.cat((-x2, x1), dim=-1) * sin, t_pass), dim=-1)


def qk_norm_rope_cache_reference(mixed, q_weight, k_weight, eps, cos, sin, positions, slots, k_cache, v_cache,
                                 num_heads, num_groups, head_dim, q_noise=None, k_noise=None) -> torch.Tensor:
    """The op sequence of DecodeModel's torch path: _qkv (split + QK-norm), RoPE, _write_cache (bf16 KV)."""
    B, hpg, D = mixed.shape[0], num_heads // num_groups, head_dim
    mixed = mixed.view(B, num_groups, (hpg + 2) * D)
    q = mixed[..., :hpg * D].reshape(B, num_heads, D)
    k = mixed[..., hpg * D:(hpg + 1) * D]
    v = mixed[..., (hpg + 1) * D:]
    if q_weight is not None:
        q = rmsnorm_reference(q, q_weight, q_noise, eps)
        k = rmsnorm_reference(k, k_weight, k_noise, eps)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)         # [B, 1, rot_dim]
    q, k = rotate_half_rope_reference(q, c, s), rotate_half_rope_reference(k, c, s)
    k_cache[slots, positions] = k.to(k_cache.dtype)
    v_cache[slots, positions] = v.to(v_cache.dtype)
    return q
