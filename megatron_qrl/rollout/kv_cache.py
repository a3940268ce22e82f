"""The engine's KV cache: one contiguous slot of max_len positions per running sequence, per layer.

A sequence gets a slot when the scheduler admits it and returns it when it finishes, so sequences of
any length and phase (prefill or decode) share one batch: attention reads each sequence's own slot up
to its own length (see attention.py). K/V are quantize-dequantized by `kv_format` when written:
- bf16: stored unquantized in the model's compute dtype (fp32 on CPU tests, bf16 on GPU);
- fp8:  float8_e4m3fn with one fp32 scale per (token, kv-head) = amax / 448;
- fp4:  NVFP4 via the project codec along head_dim (blocks of 16, E4M3 block scales) with one FP32
        global scale per (token, kv-head). Production FP4 KV caches use a calibrated per-tensor global
        scale; a per-row scale keeps a token's cache entry independent of what else is in the batch.
On CPU the quantized values are stored dequantized (the numerics are exact, the memory saving is not
realised); a GPU build stores codes + scales and dequantizes inside the attention kernel.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_qrl.quant import e2m1
from megatron_qrl.quant.nvfp4 import (BLOCK as NVFP4_BLOCK, E4M3_MAX, nvfp4_block_scales, nvfp4_dequantize,
                                      nvfp4_scaled)

KV_FORMATS = ("bf16", "fp8", "fp4")


def quantize_dequantize_kv(x: torch.Tensor, kv_format: str) -> torch.Tensor:
    """x [..., head_dim] -> dequant(quant(x)) in x.dtype, one scale set per row (token, head)."""
    if kv_format == "bf16":
        return x
    rows = x.reshape(-1, x.shape[-1]).float()
    amax = rows.abs().amax(-1, keepdim=True)
    amax = torch.where(amax > 0, amax, torch.ones_like(amax))
    if kv_format == "fp8":
        scale = amax / E4M3_MAX
        out = (rows / scale).to(torch.float8_e4m3fn).float() * scale
    elif kv_format == "fp4":
        if x.shape[-1] % NVFP4_BLOCK:
            raise ValueError(f"rollout.kv_cache=fp4 needs head_dim divisible by {NVFP4_BLOCK}, got {x.shape[-1]}; "
                             "use kv_cache=fp8 or bf16")
        global_scale = amax / (e2m1.E2M1_MAX * E4M3_MAX)
        scales = nvfp4_block_scales(rows, global_scale)
        codes = e2m1.round_nearest(nvfp4_scaled(rows, scales, global_scale))
        out = nvfp4_dequantize(e2m1.pack_nibbles(codes), scales, global_scale, dtype=torch.float32)
    else:
        raise ValueError(f"unknown KV cache format '{kv_format}'; use one of {KV_FORMATS}")
    return out.reshape(x.shape).to(x.dtype)


class KVCache:
    """K and V buffers [slots, max_len, kv_heads, head_dim] per layer, plus slot bookkeeping."""

    def __init__(self, num_layers: int, max_slots: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, kv_format: str = "bf16", scratch: bool = False):
        if kv_format not in KV_FORMATS:
            raise ValueError(f"rollout.kv_cache='{kv_format}' is not supported; use one of {KV_FORMATS}")
        if kv_format == "fp4" and head_dim % NVFP4_BLOCK:
            raise ValueError(f"rollout.kv_cache=fp4 needs head_dim divisible by {NVFP4_BLOCK}, got {head_dim}; "
                             "use kv_cache=fp8 or bf16")
        # scratch: one extra slot, never handed out, where static decode steps write the K/V of inactive rows
        self.scratch_slot = max_slots if scratch else None
        self.shape = (max_slots + int(scratch), max_len, num_kv_heads, head_dim)
        self.num_layers, self.dtype, self.device, self.kv_format = num_layers, dtype, torch.device(device), kv_format
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._max_slots = max_slots
        self.free_slots = list(range(max_slots - 1, -1, -1))
        self.allocate()

    @property
    def max_slots(self) -> int:
        return self._max_slots

    @property
    def max_len(self) -> int:
        return self.shape[1]

    @property
    def allocated(self) -> bool:
        return bool(self.keys)

    def allocate(self) -> None:
        if not self.allocated:
            self.keys = [torch.zeros(self.shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
            self.values = [torch.zeros_like(k) for k in self.keys]

    def release(self) -> None:
        """Drop the buffers (colocated mode); allocate() brings back empty ones."""
        if len(self.free_slots) != self.max_slots:
            raise RuntimeError("cannot release the KV cache while sequences are running; finish generate() first")
        self.keys, self.values = [], []

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def acquire_slot(self) -> int:
        if not self.free_slots:
            raise RuntimeError("no free KV cache slot; the scheduler admitted more sequences than max_batch_size")
        return self.free_slots.pop()

    def free_slot(self, slot: int) -> None:
        self.free_slots.append(slot)

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor) -> None:
        """Store token t's key/value [T, kv_heads, head_dim] at (slots[t], positions[t]) after quantization."""
        if int(positions.max()) >= self.max_len:
            raise RuntimeError(f"position {int(positions.max())} exceeds the KV cache length {self.max_len}; "
                               "raise model.max_sequence_length or lower max_new_tokens")
        self.keys[layer][slots, positions] = quantize_dequantize_kv(key, self.kv_format).to(self.dtype)
        self.values[layer][slots, positions] = quantize_dequantize_kv(value, self.kv_format).to(self.dtype)

    def read(self, layer: int, slots: torch.Tensor, length: int,
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, length, kv_heads, head_dim] of the given slots (positions >= a sequence's
        own length hold stale data; attention masks them)."""
        return self.keys[layer][slots, :length], self.values[layer][slots, :length]

    def clear(self, slot: Optional[int] = None) -> None:
        """Zero one slot (or all); not needed for correctness, useful when debugging."""
        for t in self.keys + self.values:
            if slot is None:
                t.zero_()
            else:
                t[slot].zero_()
