"""Colocated placement: an in-process `sglang.Engine` sharing the trainer's GPU.

The Engine is built lazily on first use (importing this module never imports SGLang). Weights go in
with `update_weights_from_tensor` (CUDA tensors handed over by IPC handles, one call per bucket, the
KV/radix cache flushed after the last; FP4 updates framed by the reload loaders, custom_loader.py); the
trainer's turn frees the engine's memory with `release_memory_occupation` (needs
ServerArgs.enable_memory_saver, which launch_args sets).
"""
from __future__ import annotations

import os
from typing import Callable, Optional

from .custom_loader import BEGIN_FP4_UPDATE, END_FP4_UPDATE
from .payloads import engine_environment
from .wire import WireTensor


class SGLangUnavailable(ImportError):
    """SGLang is not installed in this environment."""


def import_sglang_engine(**server_args):
    """sglang.Engine(**server_args); SGLang's scheduler processes inherit the environment set here."""
    os.environ.update(engine_environment())
    try:
        import sglang
    except ImportError as e:
        raise SGLangUnavailable("rollout.engine=sglang with placement=colocated needs SGLang in this process: "
                                "pip install 'sglang==0.5.15.post1' on a GPU node (docs/sglang.md)") from e
    return sglang.Engine(**server_args)


def _ok(result, what: str) -> None:
    """Engine weight calls return (success, message) in the pinned release."""
    if isinstance(result, tuple) and len(result) >= 1 and result[0] is False:
        raise RuntimeError(f"SGLang {what} failed: {result[1] if len(result) > 1 else ''}")


class ColocatedBackend:
    """Drives one in-process sglang.Engine."""

    reports_version = False  # Engine.update_weights_from_tensor takes no weight_version; we own the engine

    def __init__(self, server_args: dict, engine_factory: Optional[Callable] = None, max_restarts: int = 2,
                 device=None):
        self.server_args = dict(server_args)
        self.device = device  # where weight tensors are handed over; default: the current CUDA device
        self.engine_factory = engine_factory or import_sglang_engine
        self.max_restarts = max_restarts
        self.restarts = 0
        self._engine = None

    @property
    def engine(self):
        if self._engine is None:
            self._engine = self.engine_factory(**self.server_args)
        return self._engine

    def generate(self, requests: list[dict]) -> list[dict]:
        first = requests[0]
        out = self.engine.generate(
            input_ids=[r["input_ids"] for r in requests],
            sampling_params=[r["sampling_params"] for r in requests],
            return_logprob=first["return_logprob"], logprob_start_len=first["logprob_start_len"],
            return_routed_experts=first["return_routed_experts"])
        return out if isinstance(out, list) else [out]

    def sync(self, buckets: list[list[WireTensor]], version: int, reprocess: bool = False) -> None:
        """reprocess (FP4 payloads): the buckets are framed by the FP4 reload loaders (custom_loader.py), and the
        cache is flushed after the end call, once the touched layers are re-processed."""
        import torch

        device = self.device if self.device is not None else torch.device("cuda", torch.cuda.current_device())
        if reprocess:
            self._frame(BEGIN_FP4_UPDATE, flush_cache=False)
        for i, bucket in enumerate(buckets):
            named = [(t.name, t.tensor.to(device)) for t in bucket]
            _ok(self.engine.update_weights_from_tensor(named_tensors=named, load_format=None,
                                                       flush_cache=not reprocess and i == len(buckets) - 1),
                "update_weights_from_tensor")
        if reprocess:
            self._frame(END_FP4_UPDATE, flush_cache=True)

    def _frame(self, loader: str, flush_cache: bool) -> None:
        _ok(self.engine.update_weights_from_tensor(named_tensors=[], load_format=loader, flush_cache=flush_cache),
            f"update_weights_from_tensor({loader})")

    def audit(self, version: int) -> dict:
        return {"weight_version_check": "not available in-process (Engine.update_weights_from_tensor has no "
                                        "weight_version); the adapter owns the engine"}

    def release(self) -> None:
        self.engine.release_memory_occupation(tags=None)

    def resume(self) -> None:
        self.engine.resume_memory_occupation(tags=None)

    def ensure_alive(self) -> bool:
        return False  # a crashed in-process engine raises from its next call; see restart()

    def restart(self) -> None:
        """Shut the engine down and build a fresh one (checkpoint weights); bounded by max_restarts."""
        if self.restarts >= self.max_restarts:
            raise RuntimeError(f"the colocated SGLang engine was already restarted {self.restarts} time(s)")
        if self._engine is not None:
            try:
                self._engine.shutdown()
            finally:
                self._engine = None
        self.restarts += 1
        _ = self.engine

    def status(self) -> dict:
        return {"placement": "colocated", "started": self._engine is not None, "restarts": self.restarts}

    def shutdown(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
