"""The engine's copy of the policy weights (WeightStore) and the digest check every sync passes.

The contract of DESIGN.md ("the engine runs exactly the weights the trainer quantized") is made
checkable here: the trainer quantizes with the project codec and hashes every payload (the wire format,
megatron_qrl.quant: FP4Tensor, pack_state, payload_digests), and the engine recomputes the digests of the
bytes it received before it installs anything (`WeightStore.stage`, all payloads hashed together). One
mismatch refuses the whole update.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Optional

import torch

from megatron_qrl.quant.digest import UnknownDigestError
from megatron_qrl.quant.digest import digest_algorithm as _digest_algorithm
from megatron_qrl.quant.formats import FP4_FORMATS
from megatron_qrl.quant.wire import FP4Tensor, Payload, pack_weight, payload_digests, payload_nbytes

from .protocol import WeightUpdateError


def digest_algorithm(digest: str) -> str:
    """The algorithm a digest names (WeightUpdateError when it names none this side can compute)."""
    try:
        return _digest_algorithm(digest)
    except UnknownDigestError as e:
        raise WeightUpdateError(str(e)) from e


def digest_problem(name: str, payload: Payload, expected: Optional[str]) -> Optional[str]:
    """Why `payload` fails its digest check (None when its bytes hash to `expected`)."""
    if expected is None:
        return f"'{name}': no digest sent"
    return digest_problems({name: payload}, {name: expected})[name]


def digest_problems(weights: Mapping[str, Payload], hashes: Mapping[str, str]) -> dict[str, Optional[str]]:
    """digest_problem of every payload, hashed together per algorithm (qh128: a few launches per device for
    the whole update instead of a few per tensor)."""
    out: dict[str, Optional[str]] = {}
    by_algo: dict[str, list[str]] = {}
    for name, payload in weights.items():
        expected = hashes.get(name)
        if expected is None:
            out[name] = f"'{name}': no digest sent"
            continue
        if not isinstance(payload, (torch.Tensor, FP4Tensor)):
            out[name] = f"'{name}': weight payload must be a torch.Tensor or FP4Tensor, got {type(payload).__name__}"
            continue
        try:
            by_algo.setdefault(digest_algorithm(expected), []).append(name)
        except WeightUpdateError as e:
            out[name] = f"'{name}': {e}"
    for algo, names in by_algo.items():
        try:
            got = payload_digests([weights[n] for n in names], algo)
        except UnknownDigestError as e:   # e.g. xxh3_128 without the xxhash package on this side
            got = [e] * len(names)
        for n, g in zip(names, got):
            if isinstance(g, Exception):
                out[n] = f"'{n}': {g}"
            elif g != hashes[n]:
                out[n] = f"'{n}': digest mismatch (sent {hashes[n][:20]}..., received bytes hash to {g[:20]}...)"
            else:
                out[n] = None
    return out


class WeightStore:
    """The engine's copy of the policy weights in their sync form (FP4 packed or plain), by parameter name.

    `stage` validates an update completely (known names, a digest per payload that matches its bytes,
    shapes, formats) before anything is written, so a refused update leaves the store untouched.
    `materialize` writes the dequantized values into the engine model's parameters; without the FP4 kernels
    that is the only execution path (dequantize once per update into the compute dtype). Weights the kernels
    read in packed form (`keep_packed_only`) are never dequantized: the engine holds no dense copy of them.
    """

    def __init__(self, params: Mapping[str, torch.nn.Parameter], quantized: Iterable[str], fmt: str):
        self.params = dict(params)
        self.shapes = {name: p.shape for name, p in self.params.items()}   # kept when a parameter's storage goes
        self.quantized = set(quantized)
        unknown = self.quantized - set(self.params)
        if unknown:
            raise ValueError(f"quantized names not among the model's parameters: {sorted(unknown)[:3]}")
        self.format = fmt
        self.entries: dict[str, Payload] = {}
        self.digests: dict[str, str] = {}
        self.version = -1
        self.packed_only: set[str] = set()   # read only in packed form (the FP4 kernels): never dequantized

    def keep_packed_only(self, names: Iterable[str]) -> None:
        """Stop dequantizing `names` into their parameters (the engine frees those parameters' storage)."""
        names = set(names)
        unknown = names - self.quantized
        if unknown:
            raise ValueError(f"only FP4 weights can be kept packed-only; not quantized: {sorted(unknown)[:3]}")
        self.packed_only = names

    def stage(self, weights: Mapping[str, Payload], hashes: Mapping[str, str]) -> dict[str, Payload]:
        """Check an update; returns the payloads to install (plain tensors for FP4 sites get packed)."""
        problems = []
        staged: dict[str, Payload] = {}
        digest_checks = digest_problems({n: p for n, p in weights.items() if n in self.params}, hashes)
        for name, payload in weights.items():
            param = self.params.get(name)
            if param is None:
                problems.append(f"'{name}': not a parameter of the engine's model")
                continue
            problem = digest_checks[name]
            if problem is not None:
                problems.append(problem)
                continue
            if tuple(payload.shape) != tuple(self.shapes[name]):
                problems.append(f"'{name}': shape {tuple(payload.shape)} != model {tuple(self.shapes[name])}")
                continue
            if isinstance(payload, FP4Tensor) and name not in self.quantized:
                problems.append(f"'{name}': FP4 payload for a parameter the engine keeps in high precision")
                continue
            if isinstance(payload, FP4Tensor) and payload.format != self.format:
                problems.append(f"'{name}': {payload.format} payload but the engine runs {self.format}")
                continue
            if name in self.quantized and isinstance(payload, torch.Tensor) and self.format in FP4_FORMATS:
                payload = pack_weight(payload.to(param.device), self.format)
            # own copies: the sender may keep training the tensors it sent (in place) after the update
            staged[name] = (payload.detach().to(param.device).clone() if isinstance(payload, torch.Tensor)
                            else FP4Tensor(payload.format, *(None if p is None else p.detach().clone()
                                                            for p in (payload.packed, payload.scales,
                                                                      payload.global_scale))))
        extra = set(hashes) - set(weights)
        if extra:
            problems.append(f"digests for names that were not sent: {sorted(extra)[:3]}")
        if problems:
            raise WeightUpdateError(f"weight update refused ({len(problems)} problem(s)), weights unchanged: "
                                    + "; ".join(problems[:5]) + (" ..." if len(problems) > 5 else ""))
        return staged

    def commit(self, staged: Mapping[str, Payload], hashes: Mapping[str, str], version: int) -> None:
        for name, payload in staged.items():
            self.entries[name] = payload
            self.digests[name] = hashes[name]
        self.version = version

    def materialize(self, names: Optional[Iterable[str]] = None) -> None:
        """Write dequantized (or plain) values into the model parameters, in each parameter's dtype (not the
        packed-only ones)."""
        with torch.no_grad():
            for name in (self.entries if names is None else names):
                if name in self.packed_only:
                    continue
                param, payload = self.params[name], self.entries[name]
                value = payload.dequantize(param.dtype) if isinstance(payload, FP4Tensor) else payload
                param.copy_(value.to(device=param.device, dtype=param.dtype))

    def missing(self) -> list[str]:
        """Parameters that never received a value (the engine refuses to generate until none are)."""
        return sorted(set(self.params) - set(self.entries))

    def nbytes(self) -> int:
        return sum(payload_nbytes(p) for p in self.entries.values())

    def offload(self) -> None:
        """Move the packed payloads to host memory (colocated mode, while the trainer runs)."""
        self.entries = {n: p.to("cpu") for n, p in self.entries.items()}


__all__ = ["WeightStore", "WeightUpdateError", "digest_algorithm", "digest_problem", "digest_problems"]
