"""The Triton-vs-torch choices, in one place: per tensor `use_triton` (QRL_KERNELS=auto|torch|triton), which
every codec call asks (through megatron_qrl.quant.formats), `w4a16_runs` for W4A16 GEMMs of frozen FP4
weights, and `engine_kernels`, the rollout engine's W4A16 mode (QRL_ROLLOUT_KERNELS=auto|on|off).

A leaf module (torch and the standard library only), so the FP4 facade (megatron_qrl/quant/formats.py)
and the kernels' own entry points (kernels/__init__.py) can both import it without a cycle.
Triton is imported lazily: this module imports without it.
"""
from __future__ import annotations

import os
from importlib.util import find_spec

import torch

MODES = ("auto", "torch", "triton")
ENGINE_MODES = ("auto", "on", "off")


def interpreter_enabled() -> bool:
    """TRITON_INTERPRET=1: Triton kernels run on the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


def available() -> bool:
    """Triton is importable and can run here: a CUDA device, or TRITON_INTERPRET=1."""
    if find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # a broken install counts as absent
        return False
    return interpreter_enabled() or torch.cuda.is_available()


def use_triton(x: torch.Tensor) -> bool:
    """Whether `x` goes to the Triton kernels: CUDA tensors when Triton is available (QRL_KERNELS=auto);
    never with QRL_KERNELS=torch; QRL_KERNELS=triton also sends CPU tensors under TRITON_INTERPRET=1 (tests)."""
    mode = os.environ.get("QRL_KERNELS", "auto").lower()
    if mode not in MODES:
        raise ValueError(f"QRL_KERNELS={mode!r}: use auto, torch or triton")
    if mode == "torch":
        return False
    if not available():
        if mode == "triton":
            raise RuntimeError("QRL_KERNELS=triton but Triton cannot run here: install triton and use a CUDA "
                               "device, or set TRITON_INTERPRET=1 for the CPU interpreter")
        return False
    if x.is_cuda:
        return True
    return mode == "triton" and interpreter_enabled()


def w4a16_runs(x: torch.Tensor) -> bool:
    """Whether a W4A16 GEMM with activations `x` runs on the Triton kernels (they take bf16 activations)."""
    return x.dtype == torch.bfloat16 and use_triton(x)


def engine_setting(setting) -> str:
    """The rollout engine's W4A16 mode from EmbeddedEngine(kernels=...): None (QRL_ROLLOUT_KERNELS, default
    auto), a bool, or one of ENGINE_MODES."""
    if setting is None:
        setting = os.environ.get("QRL_ROLLOUT_KERNELS", "auto")
    if isinstance(setting, bool):
        setting = "on" if setting else "off"
    setting = str(setting).lower()
    if setting not in ENGINE_MODES:
        raise ValueError(f"rollout kernels setting {setting!r}: use one of {ENGINE_MODES}")
    return setting


def engine_kernels(setting, device: torch.device, dtype: torch.dtype) -> bool:
    """Run the rollout engine's FP4 linears on the W4A16 kernels? 'on' is forced (needs a GPU or
    TRITON_INTERPRET=1), 'off' never, 'auto' on CUDA with a bf16 model (`engine_setting` reads `setting`)."""
    setting = engine_setting(setting)
    if setting == "off":
        return False
    if setting == "on":
        if not available():
            raise RuntimeError("rollout kernels forced on but Triton cannot run here: use a CUDA device or set "
                               "TRITON_INTERPRET=1 (before anything imports triton) for the CPU interpreter")
        return True
    return device.type == "cuda" and dtype == torch.bfloat16 and available()


__all__ = ["ENGINE_MODES", "MODES", "available", "engine_kernels", "engine_setting", "interpreter_enabled",
           "use_triton", "w4a16_runs"]
