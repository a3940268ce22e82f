"""FP4 weights for the rollout engine: the packed tensor type, the digest every sync checks, the store.

The contract of DESIGN.md ("the engine runs exactly the weights the trainer quantized") is made
checkable here: the trainer quantizes with the project codec (`pack_weight`), hashes every payload with
`tensor_digest` / `payload_digest`, and the engine recomputes the digests of the bytes it received
before it installs anything (`WeightStore.stage`). One mismatch refuses the whole update.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional, Union

import torch

from megatron_qrl.quant import mxfp4_dequantize, mxfp4_quantize, nvfp4_dequantize, nvfp4_global_scale, nvfp4_quantize

from .protocol import WeightUpdateError

FP4_FORMATS = ("nvfp4", "mxfp4")
DIGEST_ALGORITHMS = ("sha256", "xxh3_128")
DEFAULT_DIGEST = "sha256"


def _raw_bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().reshape(-1).contiguous().cpu()
    return flat.view(torch.uint8).numpy().tobytes()


def tensor_digest(t: torch.Tensor, algorithm: str = DEFAULT_DIGEST) -> str:
    """'<algorithm>:<hex>' over dtype, shape and the raw bytes of `t` (device and strides do not matter).

    Shared by the trainer's weight sync and the engine. sha256 is the default because it is always
    available on both sides; 'xxh3_128' (needs the xxhash package) is ~10x faster for large syncs.
    The algorithm travels in the digest, so the verifier recomputes with the sender's choice.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"tensor_digest expects a torch.Tensor, got {type(t).__name__}")
    header = f"{t.dtype}|{tuple(t.shape)}|".encode()
    if algorithm == "sha256":
        h = hashlib.sha256(header)
    elif algorithm == "xxh3_128":
        try:
            import xxhash
        except ImportError as e:
            raise WeightUpdateError("digest algorithm xxh3_128 needs the xxhash package on this side "
                                    "(pip install xxhash) or use sha256 on the sender") from e
        h = xxhash.xxh3_128(header)
    else:
        raise ValueError(f"unknown digest algorithm '{algorithm}'; use one of {DIGEST_ALGORITHMS}")
    h.update(_raw_bytes(t))
    return f"{algorithm}:{h.hexdigest()}"


def digest_algorithm(digest: str) -> str:
    algo = digest.split(":", 1)[0] if ":" in digest else ""
    if algo not in DIGEST_ALGORITHMS:
        raise WeightUpdateError(f"digest '{digest[:24]}...' does not start with a known algorithm "
                                f"({', '.join(DIGEST_ALGORITHMS)}); compute it with rollout.weights.tensor_digest")
    return algo


@dataclass
class FP4Tensor:
    """A weight in the project's FP4 format: what SGLang/vLLM/ModelOpt read (METHODS.md section 1).

    packed: uint8 [N, K/2]; scales: float8_e4m3fn [N, K/16] (nvfp4) or uint8 E8M0 [N, K/32] (mxfp4);
    global_scale: fp32 0-dim (nvfp4) or None (mxfp4).
    """

    format: str
    packed: torch.Tensor
    scales: torch.Tensor
    global_scale: Optional[torch.Tensor] = None

    def __post_init__(self):
        if self.format not in FP4_FORMATS:
            raise ValueError(f"FP4Tensor.format must be one of {FP4_FORMATS}, got '{self.format}'")
        if self.format == "nvfp4" and self.global_scale is None:
            raise ValueError("an nvfp4 FP4Tensor needs its global_scale (weight_scale_2)")

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.packed.shape[:-1], self.packed.shape[-1] * 2))

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        if self.format == "nvfp4":
            return nvfp4_dequantize(self.packed, self.scales, self.global_scale, dtype=dtype)
        return mxfp4_dequantize(self.packed, self.scales, dtype=dtype)

    def parts(self) -> list[torch.Tensor]:
        return [self.packed, self.scales] + ([self.global_scale] if self.global_scale is not None else [])

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parts())

    def to(self, device) -> "FP4Tensor":
        return FP4Tensor(self.format, *(p.to(device) if p is not None else None
                                        for p in (self.packed, self.scales, self.global_scale)))


Payload = Union[torch.Tensor, FP4Tensor]


def payload_nbytes(x: Payload) -> int:
    """Bytes a payload occupies (packed FP4 parts, or the plain tensor)."""
    return x.nbytes() if isinstance(x, FP4Tensor) else x.numel() * x.element_size()


def payload_digest(x: Payload, algorithm: str = DEFAULT_DIGEST) -> str:
    """Digest of a sync payload: a plain tensor's tensor_digest, or one digest over an FP4Tensor's parts."""
    if isinstance(x, torch.Tensor):
        return tensor_digest(x, algorithm)
    if isinstance(x, FP4Tensor):
        parts = "|".join(tensor_digest(p, algorithm) for p in x.parts())
        h = hashlib.sha256(f"{x.format}|{parts}".encode()).hexdigest()
        return f"{algorithm}:{h}"
    raise TypeError(f"weight payload must be a torch.Tensor or FP4Tensor, got {type(x).__name__}")


def _triton_codec(w: torch.Tensor) -> bool:
    """CUDA weights go to the Triton codec (byte-identical to the torch reference, tests/test_kernels_codec.py)."""
    if not w.is_cuda:
        return False
    from megatron_qrl.kernels import use_triton

    return use_triton(w)


def pack_weight(w: torch.Tensor, fmt: str) -> FP4Tensor:
    """Quantize a full (unsharded) weight with the project codec, nearest rounding -- the trainer side.

    The NVFP4 global scale is amax(|w|) / (6*448) over the whole tensor, which is what the QAT linears use
    (their amax is all-reduced over tensor-parallel shards), so the engine runs the trainer's FP4 weights.
    """
    w = w.detach()
    fast = _triton_codec(w)
    if fmt == "nvfp4":
        if fast:   # the same bytes from one Triton launch instead of ~75 torch kernels per weight
            from megatron_qrl.kernels.fp4_quant import nvfp4_quantize_triton

            packed, scales, gs = nvfp4_quantize_triton(w, nvfp4_global_scale(w))
        else:
            packed, scales, gs = nvfp4_quantize(w)
        return FP4Tensor("nvfp4", packed, scales, gs)
    if fmt == "mxfp4":
        if fast:
            from megatron_qrl.kernels.fp4_quant import mxfp4_quantize_triton

            packed, scales = mxfp4_quantize_triton(w)
        else:
            packed, scales = mxfp4_quantize(w)
        return FP4Tensor("mxfp4", packed, scales, None)
    raise ValueError(f"cannot pack a weight as '{fmt}'; use one of {FP4_FORMATS}")


def pack_state(named_params: Iterable[tuple[str, torch.Tensor]], fmt: str,
               is_quantized: Callable[[str], bool]) -> tuple[dict[str, Payload], dict[str, str]]:
    """(payloads, digests) for a weight sync: FP4 for quantized linears' weights, plain tensors elsewhere."""
    weights: dict[str, Payload] = {}
    for name, p in named_params:
        weights[name] = pack_weight(p, fmt) if fmt in FP4_FORMATS and is_quantized(name) else p.detach()
    return weights, {n: payload_digest(w) for n, w in weights.items()}


def digest_problem(name: str, payload: Payload, expected: Optional[str]) -> Optional[str]:
    """Why `payload` fails its digest check (None when its bytes hash to `expected`)."""
    if expected is None:
        return f"'{name}': no digest sent"
    try:
        got = payload_digest(payload, digest_algorithm(expected))
    except (TypeError, WeightUpdateError) as e:
        return f"'{name}': {e}"
    if got != expected:
        return f"'{name}': digest mismatch (sent {expected[:20]}..., received bytes hash to {got[:20]}...)"
    return None


class WeightStore:
    """The engine's copy of the policy weights in their sync form (FP4 packed or plain), by parameter name.

    `stage` validates an update completely (known names, a digest per payload that matches its bytes,
    shapes, formats) before anything is written, so a refused update leaves the store untouched.
    `materialize` writes the dequantized values into the engine model's parameters; on CPU that is the
    only execution path (dequantize once per update into the compute dtype). This is the seam for a GPU
    W4A16 kernel: a materializer that keeps `packed`/`scales` on the device and swaps the linear's GEMM
    instead of writing dequantized weights.
    """

    def __init__(self, params: Mapping[str, torch.nn.Parameter], quantized: Iterable[str], fmt: str):
        self.params = dict(params)
        self.quantized = set(quantized)
        unknown = self.quantized - set(self.params)
        if unknown:
            raise ValueError(f"quantized names not among the model's parameters: {sorted(unknown)[:3]}")
        self.format = fmt
        self.entries: dict[str, Payload] = {}
        self.digests: dict[str, str] = {}
        self.version = -1

    def stage(self, weights: Mapping[str, Payload], hashes: Mapping[str, str]) -> dict[str, Payload]:
        """Check an update; returns the payloads to install (plain tensors for FP4 sites get packed)."""
        problems = []
        staged: dict[str, Payload] = {}
        for name, payload in weights.items():
            param = self.params.get(name)
            if param is None:
                problems.append(f"'{name}': not a parameter of the engine's model")
                continue
            problem = digest_problem(name, payload, hashes.get(name))
            if problem is not None:
                problems.append(problem)
                continue
            if tuple(payload.shape) != tuple(param.shape):
                problems.append(f"'{name}': shape {tuple(payload.shape)} != model {tuple(param.shape)}")
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
        """Write dequantized (or plain) values into the model parameters, in each parameter's dtype."""
        with torch.no_grad():
            for name in (self.entries if names is None else names):
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
