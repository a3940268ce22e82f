"""The SGLang ServerArgs an engine starts with: one dict for `sglang.Engine(**kwargs)` and the same
settings as `python -m sglang.launch_server` flags. NVFP4 engines also register this project's FP4 reload
loaders (`custom_weight_loader`, custom_loader.py).

Every key is a field of the pinned release's `ServerArgs` and every flag one of its CLI names
(tests/test_sglang_contract.py reads both from server_args.py).
"""
from __future__ import annotations

from typing import Optional

from .custom_loader import CUSTOM_WEIGHT_LOADERS
from .quantization import NVFP4_QUANTIZATION, EngineQuantization

# ServerArgs fields whose CLI flag is not "--" + name.replace("_", "-") in the pinned release
CLI_FLAG_OVERRIDES = {"fp4_gemm_runner_backend": "--fp4-gemm-backend"}


def engine_server_args(rollout_cfg, quant: EngineQuantization, *, routed_experts: bool, colocated: bool,
                       model_path: Optional[str] = None) -> dict:
    """ServerArgs fields for one engine (colocated: in-process Engine; else: a launch_server process)."""
    path = model_path or rollout_cfg.sglang_model_path
    if not path:
        raise ValueError("rollout.sglang_model_path is not set: point it at the served checkpoint "
                         "(an NVFP4 ModelOpt export for rollout.weights=nvfp4)")
    args = {
        "model_path": str(path),
        "tp_size": int(rollout_cfg.sglang_tp_size),
        "mem_fraction_static": float(rollout_cfg.sglang_mem_fraction),
        "random_seed": int(rollout_cfg.seed),
    }
    if quant.quantization is not None:
        args["quantization"] = quant.quantization
    args.update(quant.server_args)
    if quant.quantization == NVFP4_QUANTIZATION:
        # FP4 updates re-run post-load processing through these loaders (custom_loader.py)
        args["custom_weight_loader"] = list(CUSTOM_WEIGHT_LOADERS)
    if routed_experts:
        args["enable_return_routed_experts"] = True
    if colocated:
        args["enable_memory_saver"] = True  # release/resume_memory_occupation need it
    return args


def cli_flag(field: str) -> str:
    return CLI_FLAG_OVERRIDES.get(field, "--" + field.replace("_", "-"))


def launch_server_argv(server_args: dict, host: str, port: int, python: str = "python") -> list[str]:
    """argv of `python -m sglang.launch_server` for these ServerArgs (booleans become bare flags, lists nargs)."""
    argv = [python, "-m", "sglang.launch_server"]
    for key, value in {**server_args, "host": host, "port": int(port)}.items():
        if value is True:
            argv.append(cli_flag(key))
        elif isinstance(value, (list, tuple)):
            argv += [cli_flag(key), *map(str, value)]
        elif value is not False and value is not None:
            argv += [cli_flag(key), str(value)]
    return argv
