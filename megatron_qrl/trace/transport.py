"""Shipping cache pieces from engine ranks to the trainer ranks that need them (torch.distributed).

What a trainer rank needs (`ShardSpec`):
- data parallel: dense/attention sites for its own samples (`samples`);
- expert parallel: routed-expert entries only for the experts it owns (`experts`), for every sample
  whose tokens its EP group dispatches to it (`expert_samples`: the samples of all DP ranks in its EP
  group -- Megatron's alltoall dispatcher sends tokens across the group);
- tensor parallel: only its K-slice of row-parallel sites, whose input is sharded along K:
  `proj` (attention output), dense `fc2`, `shared_fc2` by TP, routed-expert `fc2` by expert-TP.
  Column-parallel sites (`qkv`, `fc1`, `shared_fc1`, routed `fc1`) see the whole K (replicated input,
  or all-gathered under sequence parallelism) and are not sliced;
- pipeline parallel: only its stage's layers (`layers`).
Sequence parallelism is not used to trim rows (a TP rank receives its samples' full sequences).

Colocated (engine and trainer share ranks, each rank's engine produced exactly its own samples and no
EP/TP cut applies): `local_shard` slices locally, nothing moves. Otherwise `exchange` is one collective
over a group holding engines and trainers: every rank with a cache slices it per destination spec and
serializes each piece on the communication device, then two all_to_all_single calls move sizes and bytes
(gloo on CPU; NCCL on GPU, with the buffers on the current CUDA device, so a GPU cache never visits the
host). Receivers verify each piece's checksum where it arrived and merge the pieces. A spec that keeps
the whole cache (one trainer rank) sends the cache as it is, without rebuilding it.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_qrl.trainer.batch import rows_per_dp_rank  # the trainer's padding rule (no Megatron import)

from .cache import EntryCut, EntryKey, TraceCache, TraceEntry
from .errors import CorruptCacheError
from .integrity import check_checksum
from .serialize import from_bytes, to_bytes

ROW_PARALLEL_SITES = frozenset({"proj", "fc2", "shared_fc2"})


def _ids(values) -> Optional[tuple[int, ...]]:
    return None if values is None else tuple(sorted(set(int(v) for v in values)))


@dataclass(frozen=True)
class ShardSpec:
    """The part of a step's cache one trainer rank needs; None fields keep everything."""

    samples: Optional[tuple[int, ...]] = None         # dense/attention sites
    expert_samples: Optional[tuple[int, ...]] = None  # routed-expert sites
    experts: Optional[tuple[int, ...]] = None         # routed experts owned
    layers: Optional[tuple[int, int]] = None          # [first, stop) layers of the pipeline stage
    tp_rank: int = 0
    tp_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1

    def __post_init__(self):
        for name in ("samples", "expert_samples", "experts"):
            object.__setattr__(self, name, _ids(getattr(self, name)))
        if self.layers is not None:
            object.__setattr__(self, "layers", (int(self.layers[0]), int(self.layers[1])))
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.etp_rank < self.etp_size):
            raise ValueError(f"ShardSpec: tp_rank {self.tp_rank}/{self.tp_size}, etp_rank "
                             f"{self.etp_rank}/{self.etp_size} out of range")

    def k_range(self, key: EntryKey, k_full: int) -> Optional[tuple[int, int]]:
        """Full-K columns this rank quantizes at `key`, or None when the site is not K-sharded."""
        if key.site not in ROW_PARALLEL_SITES:
            return None
        rank, size = (self.etp_rank, self.etp_size) if key.routed else (self.tp_rank, self.tp_size)
        if size == 1:
            return None
        if k_full % size:
            raise ValueError(f"{key.site_name}: K={k_full} does not split over {size} tensor-parallel ranks")
        width = k_full // size
        return rank * width, (rank + 1) * width

    def wants(self, key: EntryKey) -> bool:
        if self.layers is not None and not self.layers[0] <= key.layer < self.layers[1]:
            return False
        return not (key.routed and self.experts is not None and key.expert not in self.experts)

    def cut_for(self, cache: TraceCache):
        """The per-entry cut (TraceCache.subset) that realises this spec on `cache`."""
        samples_of_token = cache.tokens()[0]
        masks: dict[Optional[tuple], Optional[torch.Tensor]] = {}

        def mask(ids):
            if ids is None:
                return None
            if ids not in masks:
                masks[ids] = torch.isin(samples_of_token, torch.tensor(ids, dtype=torch.int64))
            return masks[ids]

        def cut(key: EntryKey, entry: TraceEntry) -> Optional[EntryCut]:
            if not self.wants(key):
                return None
            ids = self.expert_samples if key.routed else self.samples
            return EntryCut(mask(ids), self.k_range(key, entry.k_full))
        return cut

    def keeps_whole(self, cache: TraceCache) -> bool:
        """Whether cut_for(cache) keeps every entry with all its rows and columns (one trainer rank)."""
        if not all(self.wants(k) and self.k_range(k, e.k_full) is None for k, e in cache.entries.items()):
            return False
        wanted = {self.expert_samples if k.routed else self.samples for k in cache.entries} - {None}
        if not wanted:
            return True
        present = torch.unique(cache.tokens()[0])
        return all(bool(torch.isin(present, torch.tensor(ids, dtype=torch.int64)).all()) for ids in wanted)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "ShardSpec":
        d = json.loads(text)
        return cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items()})

    @classmethod
    def for_rank(cls, num_samples: int, *, dp_rank: int = 0, dp_size: int = 1, micro_batch_size: int = 1,
                 tp_rank: int = 0, tp_size: int = 1, num_experts: int = 0, ep_size: int = 1, etp_rank: int = 0,
                 etp_size: int = 1, expert_owner: Optional[Sequence[int]] = None, ep_rank: Optional[int] = None,
                 ep_dp_ranks: Optional[Sequence[int]] = None, layers: Optional[tuple[int, int]] = None,
                 samples: Optional[Sequence[int]] = None) -> "ShardSpec":
        """The spec of one trainer rank from its parallel coordinates.

        samples default to the trainer's data-parallel split (trainer.batch: contiguous slices of the
        batch padded to dp * micro_batch_size). Under EP, the EP group's DP ranks and this rank's EP rank
        default to Megatron's rank order (tp-cp-ep-dp-pp, cp=1) computed from (dp_rank, tp_rank);
        expert_owner[e] is the EP rank owning expert e (default: contiguous blocks).
        """
        own = list(dp_samples(num_samples, dp_rank, dp_size, micro_batch_size)) if samples is None else samples
        if ep_size == 1 or not num_experts:
            return cls(samples=own, expert_samples=own, layers=layers, tp_rank=tp_rank, tp_size=tp_size,
                       etp_rank=etp_rank, etp_size=etp_size)
        g_ep_rank, group_dp = megatron_ep_group(dp_rank, tp_rank, tp_size, ep_size, etp_size)
        ep_rank = g_ep_rank if ep_rank is None else ep_rank
        group_dp = group_dp if ep_dp_ranks is None else list(ep_dp_ranks)
        if num_experts % ep_size:
            raise ValueError(f"{num_experts} experts do not split over expert_parallel={ep_size}")
        owner = list(expert_owner) if expert_owner is not None else \
            [e // (num_experts // ep_size) for e in range(num_experts)]
        experts = [e for e, r in enumerate(owner) if r == ep_rank]
        expert_samples = sorted({s for d in group_dp for s in dp_samples(num_samples, d, dp_size, micro_batch_size)})
        return cls(samples=own, expert_samples=expert_samples, experts=experts, layers=layers, tp_rank=tp_rank,
                   tp_size=tp_size, etp_rank=etp_rank, etp_size=etp_size)


def dp_samples(num_samples: int, dp_rank: int, dp_size: int, micro_batch_size: int = 1) -> range:
    """The samples data-parallel rank dp_rank trains (trainer.batch.shard's split)."""
    per_rank = rows_per_dp_rank(num_samples, dp_size, micro_batch_size)
    return range(min(num_samples, dp_rank * per_rank), min(num_samples, (dp_rank + 1) * per_rank))


def megatron_ep_group(dp_rank: int, tp_rank: int, tp_size: int, ep_size: int, etp_size: int = 1
                      ) -> tuple[int, list[int]]:
    """(this rank's EP rank, DP ranks in its EP group) in Megatron's default order, one pipeline stage.

    Dense order: g = tp_rank + tp_size * dp_rank; expert order: g = etp_rank + etp * (ep_rank + ep * edp).
    """
    g = tp_rank + tp_size * dp_rank
    etp_rank, rest = g % etp_size, g // etp_size
    ep_rank, edp = rest % ep_size, rest // ep_size
    members = [etp_rank + etp_size * (e + ep_size * edp) for e in range(ep_size)]
    return ep_rank, sorted({m // tp_size for m in members})


def select(cache: TraceCache, spec: ShardSpec) -> TraceCache:
    """The part of `cache` a rank with `spec` needs: the cache itself when the spec keeps all of it (no
    rebuild, no re-hash: one trainer rank), else a new sealed cache."""
    if spec.keeps_whole(cache):
        return cache
    return cache.subset(spec.cut_for(cache))


def local_shard(cache: TraceCache, spec: ShardSpec, metrics=None) -> TraceCache:
    """Colocated mode: slice locally, no communication."""
    check_checksum(cache)
    start = time.perf_counter()
    piece = select(cache, spec)
    if metrics is not None:
        metrics.add_transfer(time.perf_counter() - start, piece.nbytes)
    return piece


def comm_device(group=None) -> torch.device:
    """Where a collective's buffers must live: the current CUDA device for NCCL, the CPU for gloo."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def exchange(local: Optional[TraceCache], specs: Mapping[int, ShardSpec], group=None,
             metrics=None) -> Optional[TraceCache]:
    """Collective over `group`: each rank holding a cache sends every rank r in `specs` its
    select(cache, specs[r]); returns the merged pieces this rank received (None if it is not in specs).

    Engines pass their cache (trainer-only ranks pass None); specs (group ranks -> ShardSpec) must be
    the same on every rank (compute them from the layout, or use gather_specs).
    """
    world, me = dist.get_world_size(group), dist.get_rank(group)
    device = comm_device(group)
    blobs = [torch.zeros(0, dtype=torch.uint8, device=device)] * world
    if local is not None:
        check_checksum(local)   # never forward a corrupted cache under a fresh checksum
        for dst, spec in specs.items():
            blobs[dst] = to_bytes(select(local, spec), device=device)   # a CUDA cache never visits the host
    send_sizes = torch.tensor([b.numel() for b in blobs], dtype=torch.int64, device=device)
    recv_sizes = torch.empty_like(send_sizes)
    send = torch.cat(blobs)
    start = time.perf_counter()
    dist.all_to_all_single(recv_sizes, send_sizes, group=group)
    in_sizes = recv_sizes.tolist()
    recv = torch.empty(sum(in_sizes), dtype=torch.uint8, device=device)
    dist.all_to_all_single(recv, send, in_sizes, send_sizes.tolist(), group=group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    if metrics is not None:
        metrics.add_transfer(seconds, recv.numel(), send.numel())
    if me not in specs:
        return None
    pieces = []
    for src, part in enumerate(torch.split(recv, in_sizes)):
        if part.numel():
            try:
                pieces.append(from_bytes(part, verify=True))
            except CorruptCacheError as err:
                raise CorruptCacheError(f"TRACE piece from rank {src}: {err}") from None
    if not pieces:
        return None
    return TraceCache.merge(pieces)


def gather_specs(spec: Optional[ShardSpec], group=None) -> dict[int, ShardSpec]:
    """Every rank's spec (None for ranks that receive nothing), gathered as size-prefixed bytes."""
    device = comm_device(group)
    world = dist.get_world_size(group)
    data = spec.to_json().encode() if spec is not None else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s) for s in sizes)
    buf = torch.zeros(max(1, longest), dtype=torch.uint8)
    buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf[:0]
    bufs = [torch.empty(max(1, longest), dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(bufs, buf.to(device), group=group)
    out = {}
    for r, (s, b) in enumerate(zip(sizes, bufs)):
        if int(s):
            out[r] = ShardSpec.from_json(bytes(b[:int(s)].cpu().numpy()).decode())
    return out


def send_cache(cache: TraceCache, dst: int, group=None) -> int:
    """Point-to-point: size (int64) then bytes; returns the bytes sent."""
    device = comm_device(group)
    blob = to_bytes(cache, device=device)
    dist.send(torch.tensor([blob.numel()], dtype=torch.int64, device=device), dst, group=group)
    dist.send(blob, dst, group=group)
    return blob.numel()


def recv_cache(src: int, group=None) -> TraceCache:
    """Counterpart of send_cache; the checksum is verified."""
    device = comm_device(group)
    size = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(size, src, group=group)
    blob = torch.empty(int(size), dtype=torch.uint8, device=device)
    dist.recv(blob, src, group=group)
    return from_bytes(blob, verify=True)
