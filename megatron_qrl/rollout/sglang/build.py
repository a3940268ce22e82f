"""Build an SGLangEngine from the run config: quantization by GPU, the backend by placement.

colocated      -> in-process sglang.Engine on this process's GPU (capability read from torch.cuda).
disaggregated  -> HTTP to rollout.sglang_server_urls (+ rollout.sglang_router_url); with launch=True the
                  adapter starts those servers itself on this node (`python -m sglang.launch_server`, one per
                  URL, GPUs from `base_gpu_id` on) and restarts them when they die.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

from .colocated import ColocatedBackend
from .custom_loader import CUSTOM_WEIGHT_LOADERS
from .disaggregated import ServerBackend
from .engine import NameMap, SGLangEngine, identity_names
from .launch_args import engine_server_args, launch_server_argv
from .launcher import ServerProcess
from .payloads import RoutingLayout
from .quantization import EngineQuantization, choose_engine_quantization, local_capability
from .server_client import ServerClient, Transport
from .trace_support import refuse_trace


class SGLangConfigError(ValueError):
    """rollout.* settings the SGLang adapter cannot work with (the message names the field)."""


def _check_config(cfg) -> None:
    ro = cfg.rollout
    if ro.engine != "sglang":
        raise SGLangConfigError(f"rollout.engine is {ro.engine!r}; the SGLang adapter needs rollout.engine=sglang")
    if not ro.sglang_model_path:
        raise SGLangConfigError("rollout.sglang_model_path is not set: the served checkpoint (NVFP4 ModelOpt export "
                                "for rollout.weights=nvfp4) that engines start from and restart from")
    if ro.placement == "disaggregated" and not ro.sglang_server_urls:
        raise SGLangConfigError("rollout.placement=disaggregated needs rollout.sglang_server_urls "
                                "(e.g. ['http://10.0.0.5:30000']; with launch=True the adapter starts them here)")


def _check_served_quantization(servers: list[ServerClient], quant: EngineQuantization,
                               server_args: dict) -> None:
    """External servers: /server_info must report the quantization this config expects and, for NVFP4, the FP4
    reload loaders (without them every FP4 update after the first would leave stale or broken layers)."""
    for s in servers:
        info = s.server_info()
        served = info.get("quantization")
        if served != quant.quantization:
            raise SGLangConfigError(f"server {s.url} runs quantization={served!r}, but rollout.weights/scheme ask for "
                                    f"{quant.quantization!r}; restart it with the launch flags in docs/sglang.md")
        wanted = server_args.get("custom_weight_loader", [])
        missing = [x for x in wanted if x not in (info.get("custom_weight_loader") or [])]
        if missing:
            raise SGLangConfigError(f"server {s.url} was started without the FP4 reload loaders {missing}: restart it "
                                    f"with --custom-weight-loader {' '.join(CUSTOM_WEIGHT_LOADERS)} (and megatron-qrl "
                                    "installed in its environment; docs/sglang.md)")


def build_sglang_engine(cfg, *, capability=None, transport: Optional[Transport] = None, launch: bool = False,
                        base_gpu_id: int = 0, name_map: NameMap = identity_names, engine_factory=None,
                        input_scales=None, deterministic: bool = False, check_servers: bool = True,
                        device=None) -> SGLangEngine:
    """base_gpu_id: colocated, the GPU of this process's in-process Engine (its scheduler is a subprocess that
    would otherwise start on GPU 0); with launch=True, the first GPU of the launched servers. device: where a
    colocated sync hands tensors over (default: the current CUDA device)."""
    refuse_trace(cfg)
    _check_config(cfg)
    ro = cfg.rollout
    colocated = ro.placement == "colocated"
    if capability is None and (colocated or launch):
        capability = local_capability()
    routing = RoutingLayout.from_model_config(cfg.model) if cfg.r3.enabled else None
    if capability is None:
        # external servers: their GPUs are remote, so take the config's scheme as the servers' (the cheapest GPU
        # that runs it) and verify the quantization they report below
        capability = (10, 0) if ro.scheme == "w4a4" else (8, 0)
    quant = choose_engine_quantization(capability, ro.weights, ro.scheme)
    server_args = engine_server_args(ro, quant, routed_experts=routing is not None, colocated=colocated)
    if colocated:
        backend = ColocatedBackend({**server_args, "base_gpu_id": int(base_gpu_id)}, engine_factory=engine_factory,
                                   max_restarts=ro.sglang_max_restarts, device=device)
    else:
        servers = [ServerClient(u, transport) for u in ro.sglang_server_urls]
        processes = _launch(servers, server_args, ro, cfg.run.output_dir, base_gpu_id) if launch else []
        if check_servers and not launch:
            _check_served_quantization(servers, quant, server_args)
        router = ServerClient(ro.sglang_router_url, transport) if ro.sglang_router_url else None
        backend = ServerBackend(servers, router, tp_size=ro.sglang_tp_size,
                                master_address=ro.sglang_update_group_addr,
                                master_port=ro.sglang_update_group_port, processes=processes)
    return SGLangEngine(cfg, backend, routing=routing, name_map=name_map, input_scales=input_scales,
                        deterministic=deterministic, quantization=quant)


def _launch(servers: list[ServerClient], server_args: dict, ro, output_dir: str,
            base_gpu_id: int) -> list[ServerProcess]:
    procs = []
    for i, s in enumerate(servers):
        url = urlparse(s.url)
        if url.port is None:
            raise SGLangConfigError(f"rollout.sglang_server_urls[{i}] = {s.url!r} needs an explicit port to launch it")
        args = {**server_args, "base_gpu_id": base_gpu_id + i * ro.sglang_tp_size}
        p = ServerProcess(launch_server_argv(args, url.hostname, url.port, sys.executable), s.is_healthy,
                          Path(output_dir) / "sglang" / f"server_{i}.log", max_restarts=ro.sglang_max_restarts)
        p.start()
        procs.append(p)
    return procs
