"""Streaming access to Hugging Face safetensors checkpoints: one tensor in memory at a time.

`SafetensorsReader` lists names, shapes and dtypes from the file headers only and reads a tensor when it
is asked for (memory-mapped through `safe_open`). `ShardedSafetensorsWriter` buffers tensors up to a shard
size, writes each full shard, and finishes with HF's names (`model.safetensors`, or
`model-0000i-of-0000N.safetensors` + `model.safetensors.index.json`).
"""
from __future__ import annotations

import json
import os
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .errors import ConvertError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "U8": torch.uint8, "I8": torch.int8,
           "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool}


@dataclass(frozen=True)
class TensorInfo:
    file: str
    shape: tuple
    dtype: torch.dtype


class SafetensorsReader:
    """Names/shapes/dtypes of every tensor of an HF checkpoint directory; tensors read on demand."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.info: dict[str, TensorInfo] = {}
        self._stack = ExitStack()
        self._handles: dict[str, object] = {}
        for file in self._files():
            with safe_open(str(self.directory / file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name in self.info:
                        raise ConvertError(f"tensor '{name}' is stored twice ({self.info[name].file} and {file}) in "
                                           f"'{self.directory}'; remove the stale shard")
                    sl = f.get_slice(name)
                    dtype = _DTYPES.get(sl.get_dtype())
                    if dtype is None:
                        raise ConvertError(f"tensor '{name}' in {file} has dtype {sl.get_dtype()}, which conversion "
                                           "does not read; convert a BF16/FP16/FP32 checkpoint")
                    self.info[name] = TensorInfo(file, tuple(sl.get_shape()), dtype)
        self._check_index()

    def _files(self) -> list[str]:
        index = self.directory / INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ConvertError(f"'{index}' has no weight_map; re-save the checkpoint with save_pretrained")
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (self.directory / f).is_file()]
            if missing:
                raise ConvertError(f"'{index}' lists shard(s) {missing[:3]} that are not in '{self.directory}'; "
                                   "download the missing files")
            self._weight_map = weight_map
            return files
        self._weight_map = None
        files = sorted(p.name for p in self.directory.glob("*.safetensors"))
        if not files:
            raise ConvertError(f"no *.safetensors files in '{self.directory}'; pass a Hugging Face checkpoint "
                               "directory (config.json + model*.safetensors)")
        return files

    def _check_index(self) -> None:
        if self._weight_map is None:
            return
        wrong = [n for n, f in self._weight_map.items() if n not in self.info or self.info[n].file != f]
        if wrong:
            raise ConvertError(f"{INDEX} in '{self.directory}' does not match the shards (e.g. '{wrong[0]}'); "
                               "re-save or re-download the checkpoint")

    def names(self) -> list[str]:
        return list(self.info)

    def get(self, name: str) -> torch.Tensor:
        """The tensor `name` (read from its memory-mapped shard)."""
        file = self.info[name].file
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(
                safe_open(str(self.directory / file), framework="pt", device="cpu"))
        return self._handles[file].get_tensor(name)

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def parse_size(text: str | int) -> int:
    """'5GB' / '500MB' / '4096' -> bytes."""
    if isinstance(text, int):
        return text
    s = str(text).strip().upper()
    for suffix, factor in (("GB", 10 ** 9), ("MB", 10 ** 6), ("KB", 10 ** 3), ("B", 1)):
        if s.endswith(suffix):
            s, mult = s[: -len(suffix)], factor
            break
    else:
        mult = 1
    try:
        value = int(float(s) * mult)
    except ValueError:
        raise ConvertError(f"cannot read the size '{text}'; write e.g. 5GB, 500MB or a byte count") from None
    if value <= 0:
        raise ConvertError(f"shard size must be positive, got '{text}'")
    return value


class ShardedSafetensorsWriter:
    """Write tensors into shards of at most `max_shard_bytes` (a bigger single tensor gets its own shard)."""

    def __init__(self, directory: str | Path, max_shard_bytes: int = 5 * 10 ** 9):
        self.directory = Path(directory)
        self.max_shard_bytes = max_shard_bytes
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._shards: list[tuple[str, list[str]]] = []   # (temporary file name, tensor names)
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._buffer and self._buffer_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._buffer[name] = tensor.detach().contiguous().cpu()
        self._buffer_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        if not self._buffer:
            return
        tmp_name = f"shard-{len(self._shards):05d}.safetensors.partial"
        save_file(self._buffer, str(self.directory / tmp_name), metadata={"format": "pt"})
        self._shards.append((tmp_name, list(self._buffer)))
        self._buffer, self._buffer_bytes = {}, 0

    def close(self) -> list[str]:
        """Write the last shard, give every shard its final name, write the index; returns the file names."""
        self._flush()
        n = len(self._shards)
        if n == 0:
            raise ConvertError("no tensors to write")
        if n == 1:
            os.replace(self.directory / self._shards[0][0], self.directory / SINGLE)
            return [SINGLE]
        weight_map, files = {}, []
        for i, (tmp_name, names) in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.directory / tmp_name, self.directory / final)
            files.append(final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return files + [INDEX]
