"""Which SGLang `quantization` (and FP4 kernel backends) to start an engine with, by GPU compute capability.

Facts of the pinned release (0.5.15.post1; tests/test_sglang_contract.py checks them in its source):
- `modelopt_fp4` (ModelOpt NVFP4 checkpoints): `get_min_capability() == 80`. Dense linears need a native
  FP4 GEMM (W4A4, activations quantized with the checkpoint's static `input_scale`) on SM100+; on
  SM80-SM90 only `--fp4-gemm-backend marlin` works (weight-only W4A16; `auto` picks marlin there). Its
  fused-MoE method falls back to Marlin on 8.0 <= capability < 10.0 (`moe_runner_backend` auto or marlin).
  So: Blackwell -> W4A4; Hopper/Ampere -> weight-only NVFP4 through Marlin.
- `mxfp4`: registered only on CUDA/ROCm builds, `get_min_capability() == 80`; it quantizes the fused MoE
  experts only (linears stay high precision). `--moe-runner-backend marlin` runs it weight-only on SM80+;
  the FlashInfer MXFP4 paths quantize activations to MXFP8/BF16, never FP4, so there is no MXFP4 W4A4.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

BLACKWELL = (10, 0)
MARLIN_MIN = (8, 0)
NVFP4_QUANTIZATION = "modelopt_fp4"
MXFP4_QUANTIZATION = "mxfp4"
MARLIN_BACKEND = "marlin"


class UnsupportedQuantization(ValueError):
    """The requested rollout numerics cannot run on this GPU with the pinned SGLang release."""


@dataclass(frozen=True)
class EngineQuantization:
    """What to pass to SGLang: `quantization` plus extra ServerArgs fields, and the numerics that result."""

    quantization: Optional[str]
    server_args: dict = field(default_factory=dict)
    scheme: str = "w16a16"  # what actually runs: w4a4 | w4a16 | w16a16
    note: str = ""


def _cap(capability) -> tuple[int, int]:
    major, minor = (int(capability[0]), int(capability[1])) if isinstance(capability, (tuple, list)) else \
        divmod(int(round(float(capability) * 10)), 10)
    return major, minor


def choose_engine_quantization(capability, weights: str, scheme: str) -> EngineQuantization:
    """Pick SGLang's quantization for (compute capability, rollout.weights, rollout.scheme).

    `capability` is (major, minor) as torch.cuda.get_device_capability() returns it, or a float like 9.0.
    Raises UnsupportedQuantization with the fix when the combination cannot run.
    """
    cap = _cap(capability)
    sm = f"SM{cap[0]}{cap[1]}"
    if weights == "bf16":
        return EngineQuantization(None, {}, "w16a16", "unquantized checkpoint")
    if weights not in ("nvfp4", "mxfp4"):
        raise UnsupportedQuantization(f"rollout.weights={weights!r} has no SGLang quantization; "
                                      "use nvfp4, mxfp4 or bf16")
    if scheme not in ("w4a4", "w4a16"):
        raise UnsupportedQuantization(f"rollout.scheme={scheme!r} is not one of w4a4, w4a16")
    if cap < MARLIN_MIN:
        raise UnsupportedQuantization(f"FP4 rollouts with SGLang need compute capability >= 8.0 (Marlin); this GPU "
                                      f"is {sm}. Use rollout.weights=bf16 or another GPU")
    marlin = {"fp4_gemm_runner_backend": MARLIN_BACKEND, "moe_runner_backend": MARLIN_BACKEND}
    if weights == "nvfp4":
        if scheme == "w4a4":
            if cap < BLACKWELL:
                raise UnsupportedQuantization(
                    f"W4A4 NVFP4 needs Blackwell (SM100+); on {sm} SGLang runs NVFP4 only weight-only through Marlin: "
                    "set rollout.scheme=w4a16")
            return EngineQuantization(NVFP4_QUANTIZATION, {}, "w4a4",
                                      f"{sm}: native NVFP4 GEMMs (auto backend), activations use the checkpoint's "
                                      "static input_scale")
        return EngineQuantization(NVFP4_QUANTIZATION, marlin, "w4a16", f"{sm}: NVFP4 weights, Marlin W4A16 kernels")
    if scheme == "w4a4":
        raise UnsupportedQuantization("SGLang has no MXFP4 W4A4 path (its MXFP4 MoE kernels run activations in "
                                      "MXFP8/BF16); set rollout.scheme=w4a16 or rollout.weights=nvfp4")
    return EngineQuantization(MXFP4_QUANTIZATION, {"moe_runner_backend": MARLIN_BACKEND}, "w4a16",
                              f"{sm}: MXFP4 routed experts through Marlin, other linears high precision")


def local_capability() -> tuple[int, int]:
    """Compute capability of the current CUDA device (the engine's GPU in colocated mode)."""
    import torch

    if not torch.cuda.is_available():
        raise UnsupportedQuantization("no CUDA device is visible: SGLang engines run on NVIDIA GPUs only")
    return tuple(torch.cuda.get_device_capability())
