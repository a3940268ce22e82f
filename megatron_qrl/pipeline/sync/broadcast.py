"""Broadcast FP4 sync (rollout.placement=disaggregated): trainer rank 0 -> the engine ranks.

Every trainer rank joins the payload gather (a sharded trainer's weights, pipeline/gather_weights.py);
trainer rank 0 broadcasts the digests and a manifest, then the codec's bytes as flat buckets
(pipeline/weight_transport.py) over the group {trainer rank 0} + engine ranks; each engine installs them
(digest-checked), draws the step's AQN noise and reports its digest audit (an all-reduce MIN).
`BroadcastSync` is the trainer ranks' side, `BroadcastReceiver` the engine ranks'.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_qrl.quant.wire import payload_nbytes
from megatron_qrl.trace.transport import comm_device

from ..weight_transport import manifest, receive_weights, send_weights
from ..wire import broadcast_object
from .base import aqn_config, draw_engine_aqn, holds_digests, set_trainer_aqn
from .payload import trainer_payload


@dataclass(frozen=True)
class WeightsHeader:
    """What precedes the buckets: the manifest, the digests, the weight version and AQN's step and switch."""

    step: int
    version: int
    aqn: bool
    manifest: list
    hashes: dict


class BroadcastSync:
    """The trainer ranks' WeightSync of a disaggregated job (rank 0 sends; see the module docstring)."""

    def __init__(self, cfg, trainer, group):
        self.cfg, self.trainer, self.group = cfg, trainer, group

    def push(self, step: int, *, version: Optional[int] = None, aqn: bool = True) -> dict:
        cfg = aqn_config(self.cfg, aqn)
        t0 = time.perf_counter()
        sigma = set_trainer_aqn(self.trainer, cfg, step)
        weights, hashes = trainer_payload(self.trainer, cfg)        # gathers a sharded trainer's weights
        if dist.get_rank() != 0:
            return {"aqn/sigma": sigma}
        t1 = time.perf_counter()
        device = comm_device(self.group)
        spec = manifest(weights)
        header = WeightsHeader(step, step if version is None else version, aqn, spec, hashes)
        broadcast_object(header, src=0, group=self.group)
        sent = send_weights(weights, spec, 0, self.group, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t2 = time.perf_counter()
        ok = torch.ones(1, device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)   # the engines' digest audits
        t3 = time.perf_counter()
        return {"sync/s": t3 - t0, "sync/pack_s": t1 - t0, "sync/send_s": t2 - t1, "sync/install_s": t3 - t2,
                "sync/hash_ok": float(ok.item()), "sync/tensors": float(len(hashes)),
                "sync/bytes": float(sum(payload_nbytes(w) for w in weights.values())),
                "sync/wire_bytes": float(sent), "aqn/sigma": sigma}

    def repush(self, step: int) -> dict:
        raise RuntimeError("a disaggregated trainer holds no engine to restart: engine ranks restart their own "
                           "and reinstall the received update (BroadcastReceiver.reinstall)")


class BroadcastReceiver:
    """An engine rank's side: receive the update, install it with its AQN draw, report the audit. The last
    update is kept so that a restarted engine gets the same bytes and draw (`reinstall`)."""

    def __init__(self, cfg, group):
        self.cfg, self.group = cfg, group
        self.header: Optional[WeightsHeader] = None
        self.weights: Optional[dict] = None

    def receive(self, engine) -> None:
        """Collective with BroadcastSync.push on trainer rank 0."""
        self.header = broadcast_object(None, src=0, group=self.group)
        self.weights = receive_weights(self.header.manifest, 0, self.group, comm_device(self.group))
        ok = self.reinstall(engine)
        dist.all_reduce(torch.tensor([ok], device=comm_device(self.group)), op=dist.ReduceOp.MIN, group=self.group)

    def reinstall(self, engine) -> float:
        """The received weights (digest-checked) and their AQN draw into `engine`; 1.0 when it holds exactly
        the digests that were sent."""
        h = self.header
        engine.update_weights(self.weights, h.version, h.hashes)
        draw_engine_aqn(engine, aqn_config(self.cfg, h.aqn), h.step)
        return holds_digests(engine.store.digests, h.hashes)
