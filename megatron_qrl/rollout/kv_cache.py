"""The engine's KV cache: one contiguous slot of max_len positions per running sequence, per layer.

A sequence gets a slot when the scheduler admits it and returns it when it finishes, so sequences of
any length and phase (prefill or decode) share one batch: attention reads each sequence's own slot up
to its own length (see attention.py). K/V are quantized by `kv_format` when written, one scale set per
(token, kv-head) row (megatron_qrl/quant/kv_rows.py):
- bf16: stored unquantized in the model's compute dtype (fp32 on CPU tests, bf16 on GPU);
- fp8:  float8_e4m3fn with one fp32 scale per row = amax / 448;
- fp4:  NVFP4 via the project codec along head_dim (blocks of 16, E4M3 block scales) with one FP32
        global scale per row. Production FP4 KV caches use a calibrated per-tensor global scale; a
        per-row scale keeps a token's cache entry independent of what else is in the batch.
Two storages of the same values:
- dequantized (the CPU default and the reference): [slots, max_len, kv_heads, head_dim] in the model dtype;
  the numerics are exact, the memory saving is not realised;
- packed (`packed=True`; the engine's choice on CUDA, or with its kernels on under TRITON_INTERPRET):
  codes + scales in kernels/kv_layout.py's head-major layout, ~3.4x (fp4) / ~1.9x (fp8) smaller than bf16.
  `read` dequantizes (float32, then the cache dtype), so it returns exactly what the dequantized storage
  holds and the eager engine's numbers do not depend on the storage; the static decode step writes with
  kernels/kv_quant_write.py and attends with kernels/kv_decode_attention.py straight from the bytes.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_qrl.kernels import kv_layout
from megatron_qrl.quant.kv_rows import check_head_dim, dequantize_kv_rows, quantize_kv_rows

KV_FORMATS = ("bf16", "fp8", "fp4")


def quantize_dequantize_kv(x: torch.Tensor, kv_format: str) -> torch.Tensor:
    """x [..., head_dim] -> dequant(quant(x)) in x.dtype, one scale set per row (token, head)."""
    if kv_format == "bf16":
        return x
    if kv_format not in KV_FORMATS:
        raise ValueError(f"unknown KV cache format '{kv_format}'; use one of {KV_FORMATS}")
    return dequantize_kv_rows(quantize_kv_rows(x, kv_format)).to(x.dtype)


def packed_storage(kv_format: str, head_dim: int, device: torch.device, kernels: bool) -> bool:
    """The engine's storage choice: packed on CUDA, or with its Triton kernels on (the CPU interpreter), where
    the packed layout takes the format and head_dim; dequantized otherwise."""
    on = torch.device(device).type == "cuda" or kernels
    return on and kv_layout.packed_supported(kv_format, head_dim)


class KVCache:
    """K and V per layer, plus slot bookkeeping: dequantized tensors [slots, max_len, kv_heads, head_dim], or
    kv_layout.PackedKV buffers when packed (module docstring)."""

    def __init__(self, num_layers: int, max_slots: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, kv_format: str = "bf16", scratch: bool = False,
                 packed: bool = False):
        if kv_format not in KV_FORMATS:
            raise ValueError(f"rollout.kv_cache='{kv_format}' is not supported; use one of {KV_FORMATS}")
        check_head_dim(kv_format, head_dim)
        if packed and not kv_layout.packed_supported(kv_format, head_dim):
            raise ValueError(f"a packed KV cache needs kv_cache fp8 / fp4 and a power-of-two head_dim (>= 32 for "
                             f"fp4, >= 16 for fp8), got {kv_format} with head_dim {head_dim}")
        # scratch: one extra slot, never handed out, where static decode steps write the K/V of inactive rows
        self.scratch_slot = max_slots if scratch else None
        self.shape = (max_slots + int(scratch), max_len, num_kv_heads, head_dim)
        self.num_layers, self.dtype, self.device, self.kv_format = num_layers, dtype, torch.device(device), kv_format
        self.packed = packed
        self.keys: list = []
        self.values: list = []
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

    def _new_layer(self):
        if self.packed:
            slots, length, heads, dim = self.shape
            return kv_layout.PackedKV.zeros(self.kv_format, slots, heads, length, dim, self.device)
        return torch.zeros(self.shape, dtype=self.dtype, device=self.device)

    def allocate(self) -> None:
        if not self.allocated:
            self.keys = [self._new_layer() for _ in range(self.num_layers)]
            self.values = [self._new_layer() for _ in range(self.num_layers)]

    def release(self) -> None:
        """Drop the buffers (colocated mode); allocate() brings back empty ones."""
        if len(self.free_slots) != self.max_slots:
            raise RuntimeError("cannot release the KV cache while sequences are running; finish generate() first")
        self.keys, self.values = [], []

    def _tensors(self) -> list[torch.Tensor]:
        layers = self.keys + self.values
        return [t for x in layers for t in x.tensors()] if self.packed else layers

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def acquire_slot(self) -> int:
        if not self.free_slots:
            raise RuntimeError("no free KV cache slot; the scheduler admitted more sequences than max_batch_size")
        return self.free_slots.pop()

    def free_slot(self, slot: int) -> None:
        self.free_slots.append(slot)

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor, check: bool = True) -> None:
        """Store token t's key/value [T, kv_heads, head_dim] at (slots[t], positions[t]) after quantization.
        check=False skips the position check (a host synchronisation; the static decode step's bounds hold)."""
        if check and int(positions.max()) >= self.max_len:
            raise RuntimeError(f"position {int(positions.max())} exceeds the KV cache length {self.max_len}; "
                               "raise model.max_sequence_length or lower max_new_tokens")
        if self.packed:
            kv_layout.store(self.keys[layer], slots, positions, key)
            kv_layout.store(self.values[layer], slots, positions, value)
            return
        self.keys[layer][slots, positions] = quantize_dequantize_kv(key, self.kv_format).to(self.dtype)
        self.values[layer][slots, positions] = quantize_dequantize_kv(value, self.kv_format).to(self.dtype)

    def read(self, layer: int, slots: torch.Tensor, length: int,
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, length, kv_heads, head_dim] of the given slots, in the cache dtype (positions >=
        a sequence's own length hold stale data; attention masks them). Packed: dequantized here."""
        if self.packed:
            return (kv_layout.gather(self.keys[layer], slots, length, self.dtype),
                    kv_layout.gather(self.values[layer], slots, length, self.dtype))
        return self.keys[layer][slots, :length], self.values[layer][slots, :length]

    def clear(self, slot: Optional[int] = None) -> None:
        """Zero one slot (or all); not needed for correctness, useful when debugging."""
        for t in self._tensors():
            if slot is None:
                t.zero_()
            else:
                t[slot].zero_()
