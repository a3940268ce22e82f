"""SGLangEngine: the RolloutEngine protocol over SGLang (colocated in-process Engine or HTTP servers).

What the RL loop gets is the same as from the embedded engine, minus TRACE: samples with raw-logit
log-probs and R3 routed-expert ids, digest-checked weight updates, release/resume in colocated mode.
Digests are checked on *our* side of the wire: the release's own checksum (/weights_checker) hashes its
internal, post-processed tensors, which cannot be compared with our digests. After a sync the adapter
audits what SGLang can report (disaggregated placement): the weight version on every server and in every
sample's meta_info, and that all servers' checksums agree.
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch

from megatron_qrl.quant.wire import FP4Tensor, Payload

from ..protocol import RolloutSample, SamplingParams, WeightUpdateError
from ..weights import digest_problem
from .payloads import (RoutingLayout, SGLangResponseError, generate_request, parse_generate_response,
                       request_seed)
from .release import SGLANG_VERSION
from .trace_support import refuse_trace
from .wire import WireFormatError, split_buckets, wire_tensors

NameMap = Callable[[str, Payload], list[tuple[str, Payload]]]


def identity_names(name: str, payload: Payload) -> list[tuple[str, Payload]]:
    return [(name, payload)]


def verify_digests(weights: Mapping[str, Payload], hashes: Mapping[str, str]) -> None:
    """All-or-nothing: every payload has a digest that matches its bytes, and no digest lacks a payload."""
    problems = []
    for name, payload in weights.items():
        problem = digest_problem(name, payload, hashes.get(name))
        if problem is not None:
            problems.append(problem)
    extra = sorted(set(hashes) - set(weights))
    if extra:
        problems.append(f"digests for names that were not sent: {extra[:3]}")
    if problems:
        raise WeightUpdateError(f"weight update refused ({len(problems)} problem(s)), nothing sent to SGLang: "
                                + "; ".join(problems[:5]) + (" ..." if len(problems) > 5 else ""))


class SGLangEngine:
    """RolloutEngine over a backend (ColocatedBackend or ServerBackend); see the module docstring."""

    def __init__(self, cfg, backend, *, routing: Optional[RoutingLayout] = None, name_map: NameMap = identity_names,
                 input_scales: Optional[Mapping[str, torch.Tensor]] = None, deterministic: bool = False,
                 quantization=None):
        refuse_trace(cfg)
        self.cfg = cfg
        self.backend = backend
        self.routing = routing
        self.name_map = name_map
        self.input_scales = dict(input_scales or {})
        self.deterministic = deterministic
        self.quantization = quantization
        self.bucket_bytes = int(cfg.rollout.weight_sync_bucket_mb * 2 ** 20)
        self.version = -1
        self.digests: dict[str, str] = {}
        self.released = False
        self.weights_consistent = True
        self.last_audit: dict = {}
        # the loop keeps the step's update here from its sync to the end of its generation, so that a restarted
        # engine gets the same bytes again without another (collective) gather from the trainer ranks
        self.retained_update: Optional[tuple] = None
        self.stats = {"generate_calls": 0, "sequences": 0, "generated_tokens": 0, "syncs": 0, "sync_buckets": 0,
                      "refused_updates": 0, "engine_restarts": 0}

    # ------------------------------------------------------------------------------------ generate
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[RolloutSample]:
        self._check_ready(prompts, sampling)
        if self.backend.ensure_alive():
            self.stats["engine_restarts"] += 1
            self.weights_consistent = self.version < 0
            self._check_ready(prompts, sampling)
        requests = [generate_request(p, sampling, return_routed_experts=self.routing is not None,
                                     sampling_seed=(request_seed(sampling.seed, sampling.index_offset + i)
                                                    if self.deterministic else None))
                    for i, p in enumerate(prompts)]
        responses = self.backend.generate(requests) if requests else []
        if len(responses) != len(prompts):
            raise SGLangResponseError(f"{len(responses)} results for {len(prompts)} prompts")
        samples = [parse_generate_response(p, r, sampling, self.routing) for p, r in zip(prompts, responses)]
        for s in samples:
            self._check_version(s)
        self.stats["generate_calls"] += 1
        self.stats["sequences"] += len(samples)
        self.stats["generated_tokens"] += sum(len(s.tokens) for s in samples)
        return samples

    def _check_ready(self, prompts, sampling) -> None:
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if self.released:
            raise RuntimeError("engine memory is released; call resume_memory() before generate()")
        if not self.weights_consistent:
            raise RuntimeError("the SGLang engine's weights are not the last synced version (a sync failed midway "
                               "or the engine restarted from its checkpoint); call update_weights() again")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")

    def _check_version(self, sample: RolloutSample) -> None:
        if not self.backend.reports_version:
            sample.weight_version = self.version
        elif self.version >= 0 and sample.weight_version != self.version:
            raise SGLangResponseError(f"a sample was generated with weight version {sample.weight_version}, but the "
                                      f"adapter synced version {self.version}: a server restarted or another "
                                      "client updated its weights")

    # ------------------------------------------------------------------------------------- weights
    def update_weights(self, weights: Mapping[str, Payload], version: int, hashes: Mapping[str, str]) -> None:
        """Check digests, map to checkpoint names, send in buckets, audit. Nothing is sent if a check fails."""
        try:
            if self.released:
                raise WeightUpdateError("engine memory is released; call resume_memory() before update_weights()")
            if not isinstance(version, int) or version < 0:
                raise WeightUpdateError(f"version must be an int >= 0, got {version!r}")
            verify_digests(weights, hashes)
            mapped = {n: p for name, payload in weights.items() for n, p in self.name_map(name, payload)}
            wire = wire_tensors(mapped, self.input_scales)
        except (WeightUpdateError, WireFormatError) as e:
            self.stats["refused_updates"] += 1
            raise e if isinstance(e, WeightUpdateError) else WeightUpdateError(str(e)) from e
        buckets = split_buckets(wire, self.bucket_bytes)
        if self.backend.ensure_alive():
            self.stats["engine_restarts"] += 1
        self.weights_consistent = False  # until every bucket is in
        # FP4 layers need the release's post-load processing re-run after loading (custom_loader.py)
        self.backend.sync(buckets, version, reprocess=any(isinstance(p, FP4Tensor) for p in mapped.values()))
        self.weights_consistent = True
        self.version = version
        self.digests.update(hashes)
        self.stats["syncs"] += 1
        self.stats["sync_buckets"] += len(buckets)
        self.last_audit = {"digests_checked": len(hashes), "wire_tensors": len(wire), "buckets": len(buckets),
                           **self.backend.audit(version)}
        if self.last_audit.get("weight_version_ok") is False:
            raise WeightUpdateError(f"post-sync audit failed: servers report weight versions "
                                    f"{self.last_audit['weight_versions']}, expected {version}")
        if self.last_audit.get("checksums_agree") is False:
            raise WeightUpdateError(f"post-sync audit failed: servers hold different weights after the same update "
                                    f"(/weights_checker checksums {self.last_audit['engine_checksums']})")

    # ------------------------------------------------------------------------------ memory / status
    def release_memory(self) -> None:
        if not self.released:
            self.backend.release()
            self.released = True

    def resume_memory(self) -> None:
        if self.released:
            self.backend.resume()
            self.released = False

    def restart(self) -> None:
        """After a failure: a fresh colocated Engine, or launched servers brought back (bounded either way).
        The engine then holds the checkpoint's weights, so generation refuses until the next update_weights."""
        if hasattr(self.backend, "restart"):
            self.backend.restart()
        else:
            self.backend.ensure_alive()
        self.stats["engine_restarts"] += 1
        self.weights_consistent = False
        self.released = False

    def health(self) -> dict:
        q = self.quantization
        return {"engine": "sglang", "sglang_version": SGLANG_VERSION, "weight_version": self.version,
                "weights": self.cfg.rollout.weights, "quantization": getattr(q, "quantization", None),
                "scheme": getattr(q, "scheme", None), "memory": "released" if self.released else "resident",
                "weights_consistent": self.weights_consistent, "r3": self.routing is not None,
                "last_audit": dict(self.last_audit), **self.backend.status(), **self.stats}

    def shutdown(self) -> None:
        self.backend.shutdown()
