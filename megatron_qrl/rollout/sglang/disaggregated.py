"""Disaggregated placement: SGLang servers on their own GPUs, generation through a router.

Generation: one `/generate` request per prompt, sent concurrently to the router (sglang_router) or,
without one, round-robin to the servers. Weights: the trainer (rank 0) and every engine rank form
SGLang's update group once; each bucket is then one `/update_weights_from_distributed` call per server
(load_format "flattened_bucket") while the trainer broadcasts the bucket's bytes. The last bucket carries
`weight_version`, which every later generate result reports in meta_info and `/model_info` returns: the
post-sync audit compares it on every server. FP4 updates are framed by the reload loaders (custom_loader.py): an
empty `/update_weights_from_tensor` call before the buckets and one after, which carries the version.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from .custom_loader import BEGIN_FP4_UPDATE, END_FP4_UPDATE, empty_serialized_named_tensors
from .launcher import EngineStartError, ServerProcess
from .server_client import DEFAULT_GROUP, ServerClient
from .update_group import broadcast_bucket, close_update_group, open_update_group
from .wire import BucketMeta, WireTensor, flatten_bucket

FLATTENED_BUCKET = "flattened_bucket"


class ServerBackend:
    """Router + servers over HTTP, plus the trainer's end of the update group."""

    reports_version = True

    def __init__(self, servers: list[ServerClient], router: Optional[ServerClient] = None, *, tp_size: int = 1,
                 master_address: str = "127.0.0.1", master_port: int = 29600, group_backend: str = "nccl",
                 group_name: str = DEFAULT_GROUP, processes: Optional[list[ServerProcess]] = None,
                 max_concurrency: int = 256, checksum_audit: bool = True):
        if not servers:
            raise ValueError("the disaggregated SGLang engine needs at least one server URL "
                             "(rollout.sglang_server_urls)")
        self.servers = servers
        self.router = router
        self.tp_size = tp_size
        self.master_address, self.master_port = master_address, master_port
        self.group_backend, self.group_name = group_backend, group_name
        self.processes = processes or []
        self.checksum_audit = checksum_audit
        self.pool = ThreadPoolExecutor(max_workers=max(max_concurrency, len(servers)))
        self.pg = None

    # ------------------------------------------------------------------------------------ generation
    def generate(self, requests: list[dict]) -> list[dict]:
        targets = [self.router or self.servers[i % len(self.servers)] for i in range(len(requests))]
        futures = [self.pool.submit(client.generate, body) for client, body in zip(targets, requests)]
        return [f.result() for f in futures]

    # ---------------------------------------------------------------------------------------- weights
    @property
    def world_size(self) -> int:
        return 1 + self.tp_size * len(self.servers)

    def connect(self) -> None:
        """Form the update group: every server joins (rank_offset 1 + i*tp) while the trainer hosts rank 0."""
        futures = [self.pool.submit(s.init_weights_update_group, self.master_address, self.master_port,
                                    1 + i * self.tp_size, self.world_size, self.group_name, self.group_backend)
                   for i, s in enumerate(self.servers)]
        self.pg = open_update_group(self.master_address, self.master_port, self.world_size, 0, self.group_name,
                                    self.group_backend)
        for f in futures:
            f.result()

    def disconnect(self) -> None:
        for s in self.servers:
            if s.is_healthy():
                try:
                    s.destroy_weights_update_group(self.group_name)
                except RuntimeError:
                    pass
        close_update_group(self.pg)
        self.pg = None

    def _broadcast_device(self):
        import torch

        return torch.device("cuda", torch.cuda.current_device()) if self.group_backend == "nccl" else None

    def sync(self, buckets: list[list[WireTensor]], version: int, reprocess: bool = False) -> None:
        """reprocess (FP4 payloads): the buckets are framed by the FP4 reload loaders (custom_loader.py, empty
        /update_weights_from_tensor calls); the end call flushes the cache and carries weight_version, so a server
        reports the version only once its layers are re-processed."""
        if self.pg is None:
            self.connect()
        device = self._broadcast_device()
        if reprocess:
            self._frame(BEGIN_FP4_UPDATE, flush_cache=False, weight_version=None)
        for i, bucket in enumerate(buckets):
            last = not reprocess and i == len(buckets) - 1
            meta = BucketMeta.of(bucket)
            flat = flatten_bucket(bucket, device)
            futures = [self.pool.submit(s.update_weights_from_distributed, meta.names, meta.dtypes, meta.shapes,
                                        group_name=self.group_name, flush_cache=last,
                                        weight_version=str(version) if last else None, load_format=FLATTENED_BUCKET)
                       for s in self.servers]
            broadcast_bucket(flat, self.pg)
            for f in futures:
                f.result()
        if reprocess:
            self._frame(END_FP4_UPDATE, flush_cache=True, weight_version=str(version))

    def _frame(self, loader: str, *, flush_cache: bool, weight_version) -> None:
        payload = empty_serialized_named_tensors(self.tp_size)
        futures = [self.pool.submit(s.update_weights_from_tensor, payload, load_format=loader, flush_cache=flush_cache,
                                    weight_version=weight_version) for s in self.servers]
        for f in futures:
            f.result()

    def checksums(self) -> dict[str, Optional[str]]:
        return {s.url: s.weights_checksum() for s in self.servers}

    def audit(self, version: int) -> dict:
        """Every server reports the version the last bucket carried (/model_info weight_version) and, with
        checksum_audit, the release's checksum of its installed weights, which must agree across servers."""
        seen = {s.url: str(s.model_info().get("weight_version")) for s in self.servers}
        report = {"weight_version_ok": all(v == str(version) for v in seen.values()), "weight_versions": seen}
        if self.checksum_audit:
            sums = self.checksums()
            report.update(engine_checksums=sums, checksums_agree=len(set(sums.values())) == 1)
        return report

    # ------------------------------------------------------------------------------- memory / health
    def release(self) -> None:
        """Nothing to free: disaggregated engines own their GPUs."""

    def resume(self) -> None:
        """Nothing to re-acquire (see release)."""

    def ensure_alive(self) -> bool:
        """Restart dead servers we launched (bounded); True if any restarted (their weights are the checkpoint's)."""
        restarted = False
        for p in self.processes:
            restarted |= p.ensure_alive()
        unmanaged = self.servers[len(self.processes):]
        down = [s.url for s in unmanaged if not s.is_healthy()]
        if down:
            raise EngineStartError(f"SGLang server(s) {down} do not answer /health and were not started by the "
                                   "adapter, so it cannot restart them")
        if restarted and self.pg is not None:
            self.disconnect()  # the group lost a member: rebuild it at the next sync
        return restarted

    def status(self) -> dict:
        return {"placement": "disaggregated", "router": self.router.url if self.router else None,
                "servers": [{"url": s.url, "healthy": s.is_healthy()} for s in self.servers],
                "restarts": sum(p.restarts for p in self.processes), "update_group": self.pg is not None}

    def shutdown(self) -> None:
        for p in self.processes:
            p.stop()
        self.pool.shutdown(wait=False)
