"""Where rollouts come from, as the loop sees it: one interface, two placements.

`Rollouts` (what launch/train.py calls on trainer ranks):
    sync(step) -> metrics                       trainer weights (FP4 bytes + digests) to the engines, AQN draw
    generate(prompts, step, first_index=0) -> (samples, rollouts, metrics)   every trainer rank gets the
                                                whole batch; first_index: the global sample index of its first
                                                response (a step's later generate calls, dynamic sampling)
    hand_over(batch, step)                      the engines' records of the batch to the trainer: TRACE caches
                                                sealed by the engines' recorders, one trace.exchange to every
                                                trainer rank's replay (colocated and disaggregated alike)
    idle() / evaluate(step) -> metrics

ColocatedRollouts: every rank holds an engine and generates its data-parallel share (single node, CPU).
RemoteRollouts + serve_rollouts: rollout.placement=disaggregated. Trainer ranks 0..T-1 never hold an
engine; engine ranks T..N-1 run `serve_rollouts`, a loop that mirrors the trainer's step by step over the
default group: (1) weights: trainer rank 0 broadcasts the digests and a manifest, then the codec's bytes
as flat buckets (pipeline/weight_transport.py) to the engines (group {0} + engines), engines install them
(digest-checked) and report the audit; (2) each engine generates its
contiguous share of the prompt groups (same seeds and sample indices as one engine would use); (3) samples and rollouts
(without TRACE captures: a handle each) go to every rank; (4) each engine's recorder seals the TRACE cache of
its samples and `megatron_qrl.trace.exchange` ships every trainer rank the samples it trains, which its
replay loads. Engines do not keep the
schedule themselves: trainer rank 0 sends each command (generate; eval = install the weights after the
step's updates without AQN noise and let engine 0 score the held-out set; save = join the collective
checkpoint write with no state of their own; stop), so a checkpoint the trainer writes off schedule (the non-finite
guard's last one) and the end of the run reach them too.
"""
from __future__ import annotations

import io
import time
from typing import Optional

import torch
import torch.distributed as dist

from megatron_qrl import fault_inject
from megatron_qrl.platform.distributed import weight_sync_group
from megatron_qrl.rollout.weights import payload_nbytes
from megatron_qrl.trace.transport import comm_device

from .evaluate import evaluate
from .weight_sync import (aqn_seed, holds_digests, noise_free, set_trainer_aqn, step_aqn_sigma, sync_weights,
                          trainer_payload)
from .weight_transport import manifest, receive_weights, send_weights

# ----------------------------------------------------------------------------------------- helpers


def to_bytes(obj) -> bytes:
    """torch.save, not pickle: pickle cannot serialize the float8 TRACE scales (torch 2.13)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def from_bytes(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


def broadcast_object(obj, src: int, group=None):
    """to_bytes(obj) from `src` to the group as a uint8 tensor (NCCL moves tensors only)."""
    device = comm_device(group)
    if dist.get_rank() == src:
        data = torch.frombuffer(bytearray(to_bytes(obj)), dtype=torch.uint8).to(device)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    else:
        size = torch.empty(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src, group=group)
    if dist.get_rank() != src:
        data = torch.empty(int(size), dtype=torch.uint8, device=device)
    dist.broadcast(data, src, group=group)
    return obj if dist.get_rank() == src else from_bytes(data.cpu().numpy().tobytes())


def gather_from_engines(payload, place):
    """all_gather_object over the default group: engines contribute `payload`, trainers None; returns the
    engines' payloads in engine order on every rank."""
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, to_bytes(payload))
    return [from_bytes(parts[r]) for r in place.engine_ranks]


def engine_share(num_prompts: int, engine_index: int, num_engines: int) -> tuple[int, int]:
    """[first, stop) prompt indices engine `engine_index` generates (contiguous, like data parallel)."""
    per = -(-num_prompts // num_engines)
    return min(num_prompts, engine_index * per), min(num_prompts, (engine_index + 1) * per)


def trace_active(s) -> bool:
    """Whether this run records and replays TRACE (the trainer ranks hold a replay, the engines record)."""
    return bool(s.cfg.trace.enabled and s.cfg.cached_layers())


def exchange_trace(s, place, cache, batch, step: int, num_samples: int, build_s: float) -> None:
    """TRACE's one transport: every rank joins trace.exchange with the cache its engine sealed (None: no
    engine here); a trainer rank's replay loads what it received for `batch`."""
    from megatron_qrl.trace import TraceMetrics, exchange

    metrics = TraceMetrics()
    t0 = time.perf_counter()
    received = exchange(cache, trace_specs(s.cfg, place, num_samples), metrics=metrics)
    transfer_s = time.perf_counter() - t0
    if s.trainer is not None:
        s.trainer.trace.load(received, batch, step, step, {"trace/build_s": build_s, "trace/transfer_s": transfer_s},
                             metrics)


def trace_specs(cfg, place, num_samples: int) -> dict:
    """rank -> ShardSpec: each trainer rank receives the samples its data-parallel split trains (full
    hidden width: under tensor parallelism the trainer's MicroBatchGuides slices row-parallel sites) and,
    under expert parallelism, its own experts' rows for every sample of its EP group."""
    from megatron_qrl.trace import ShardSpec

    t = cfg.trainer
    dp = place.num_trainers // (t.tensor_parallel * t.pipeline_parallel)
    # Megatron's rank order tp-cp-ep-dp-pp (cp = 1): rank = tp_rank + tp * (dp_rank + dp * pp_rank)
    return {r: ShardSpec.for_rank(num_samples, dp_rank=(r // t.tensor_parallel) % dp, dp_size=dp,
                                  micro_batch_size=t.micro_batch_size, tp_rank=r % t.tensor_parallel,
                                  tp_size=t.tensor_parallel, num_experts=cfg.model.num_experts,
                                  ep_size=t.expert_parallel, etp_size=t.expert_tensor_parallel)
            for r in range(place.num_trainers)}


# ------------------------------------------------------------------------------------- colocated
class ColocatedRollouts:
    """Every rank runs an engine over its data-parallel share (setup.generate_shard)."""

    def __init__(self, s):
        self.s = s

    def sync(self, step: int) -> dict:
        return sync_weights(self.s.engine_ready(), self.s.trainer, self.s.cfg, step, version=step)

    def generate(self, prompts: list, step: int, first_index: int = 0):
        from .setup import generate_shard

        t0 = time.perf_counter()
        samples, rollouts = generate_shard(self.s, prompts, step, first_index)
        return samples, rollouts, {"rollout/s": time.perf_counter() - t0}

    def hand_over(self, batch, step: int) -> None:
        """Every rank's engine seals its samples of the batch; the exchange gives each trainer rank its part."""
        if not trace_active(self.s):
            return
        t0 = time.perf_counter()
        cache = self.s.engine.trace_recorder.seal([r.trace_handle for r in batch.rollouts], step)
        exchange_trace(self.s, self.s.placement, cache, batch, step, len(batch.rollouts), time.perf_counter() - t0)

    def idle(self) -> None:
        self.s.engine_idle()

    def evaluate(self, step: int) -> dict:
        """Held-out accuracy of the weights after this step's updates, without AQN noise: exactly what
        `qrl eval` reports for the checkpoint written after this step (same FP4 bytes, greedy decoding)."""
        s = self.s
        t0 = time.perf_counter()
        sync_weights(s.engine_ready(), s.trainer, noise_free(s.cfg), step, version=step)
        out = evaluate(s.engine, s.tokenizer, s.eval_set, s.cfg.rollout.max_new_tokens, s.reward_fn,
                       s.cfg.data.reward_time_limit_s)
        return {**out, "time/eval_s": time.perf_counter() - t0}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


# ---------------------------------------------------------------------------------- disaggregated
class RemoteRollouts:
    """The trainer ranks' side of a disaggregated job (see the module docstring)."""

    def __init__(self, s, place):
        self.s, self.place = s, place
        self.group = weight_sync_group()

    def sync(self, step: int) -> dict:
        return self._push_weights("generate", step, self.s.cfg)

    def _push_weights(self, cmd: str, step: int, cfg) -> dict:
        """The command, then the trainer's weights (AQN as `cfg` says) to the engines, and their audit."""
        s = self.s
        t0 = time.perf_counter()
        sigma = set_trainer_aqn(s.trainer, cfg, step)
        weights, hashes = trainer_payload(s.trainer, cfg)        # gathers a sharded trainer's weights
        if dist.get_rank() != 0:
            return {"aqn/sigma": sigma}
        t1 = time.perf_counter()
        device = comm_device(self.group)
        spec = manifest(weights)
        broadcast_object({"cmd": cmd, "step": step, "version": step, "weights": spec, "hashes": hashes}, src=0,
                         group=self.group)
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

    def generate(self, prompts: list, step: int, first_index: int = 0):
        if first_index:   # config validation refuses rl.dynamic_sampling here
            raise ValueError("disaggregated engine ranks generate one batch per step (no dynamic sampling)")
        parts = gather_from_engines(None, self.place)
        samples = [x for p in parts for x in p["samples"]]
        rollouts = [x for p in parts for x in p["rollouts"]]
        self._build_s = max(p["trace_build_s"] for p in parts)
        return samples, rollouts, {"rollout/s": max(p["generate_s"] for p in parts)}

    def hand_over(self, batch, step: int) -> None:
        """The engine ranks' TRACE caches (sealed before they sent the samples) through the exchange."""
        if trace_active(self.s):
            exchange_trace(self.s, self.place, None, batch, step, len(batch.rollouts), self._build_s)

    def idle(self) -> None:
        pass

    def evaluate(self, step: int) -> dict:
        """As ColocatedRollouts.evaluate: the weights after this step's updates, no AQN noise (engine 0 scores)."""
        t0 = time.perf_counter()
        self._push_weights("eval", step, noise_free(self.s.cfg))
        return {**gather_from_engines(None, self.place)[0], "time/eval_s": time.perf_counter() - t0}

    def announce_save(self, step: int) -> None:
        """Tell the engine ranks to join the collective checkpoint write of `step` (trainer rank 0 sends)."""
        if dist.get_rank() == 0:
            broadcast_object({"cmd": "save", "step": step}, src=0, group=self.group)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        """End of the run, or a stop at a step boundary (SystemExit, e.g. the non-finite guard's): release the
        engine ranks from their command loop. After any other exception the engines may sit in another
        collective, so nothing is sent: the launcher (torchrun) tears the job down."""
        if dist.get_rank() == 0 and (exc_type is None or issubclass(exc_type, SystemExit)):
            broadcast_object({"cmd": "stop"}, src=0, group=self.group)


def serve_rollouts(s, place) -> None:
    """The engine ranks' loop of a disaggregated job: commands from trainer rank 0 until "stop".

    generate: install the weights (digest-checked) and this step's AQN draw, generate this engine's share of
    the prompt groups (restarting a failed engine and retrying, at most rollout.max_generate_retries times),
    score the held-out set when asked (engine 0), seal the TRACE cache of the share, send samples and rollouts
    (with handles, without captures) to every rank, ship the cache. save: join the collective checkpoint
    write. stop: return.
    """
    from megatron_qrl.trace import without_captures

    from .setup import save_checkpoint

    cfg = s.cfg
    group = weight_sync_group()
    me = place.engine_index(dist.get_rank())
    G = cfg.rollout.group_size
    while True:
        msg = broadcast_object(None, src=0, group=group)
        if msg["cmd"] == "stop":
            return
        if msg["cmd"] == "save":
            save_checkpoint(s, msg["step"])
            continue
        step = msg["step"]
        msg["weights"] = receive_weights(msg["weights"], 0, group, comm_device(group))
        ok = _install(s.engine, msg, cfg if msg["cmd"] == "generate" else noise_free(cfg))
        dist.all_reduce(torch.tensor([ok], device=comm_device(group)), op=dist.ReduceOp.MIN, group=group)
        if msg["cmd"] == "eval":   # the weights after the step's updates: engine 0 scores the held-out set
            gather_from_engines(evaluate(s.engine, s.tokenizer, s.eval_set, cfg.rollout.max_new_tokens, s.reward_fn,
                                         cfg.data.reward_time_limit_s) if me == 0 else None, place)
            continue
        prompts = next(s.prompts)
        first, stop = engine_share(len(prompts), me, len(place.engine_ranks))
        samples = [p for p in prompts[first:stop] for _ in range(G)]
        t0 = time.perf_counter()
        rollouts = _generate_with_restarts(s, msg, samples, first * G) if samples else []
        generate_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        traced = trace_active(s)
        # batch position = sample index: engine ranks draw one batch per step (no dynamic sampling)
        cache = s.engine.trace_recorder.seal(range(first * G, stop * G), step, first * G) if traced else None
        build_s = time.perf_counter() - t0
        gather_from_engines({"samples": samples, "rollouts": without_captures(rollouts), "generate_s": generate_s,
                             "trace_build_s": build_s}, place)
        if traced:
            exchange_trace(s, place, cache, None, step, len(prompts) * G, build_s)


def _install(engine, msg: dict, cfg) -> float:
    """Weights (digest-checked) and the step's AQN draw; returns 1.0 when the engine holds exactly the digests."""
    engine.update_weights(msg["weights"], msg["version"], msg["hashes"])
    engine.set_aqn_noise(step_aqn_sigma(cfg, msg["step"]), aqn_seed(cfg.run.seed, msg["step"]))
    return holds_digests(engine.store.digests, msg["hashes"])


def _generate_with_restarts(s, msg: dict, samples: list, index_offset: int) -> list:
    """generate(); on an exception a fresh engine gets the same weights and AQN draw and the batch is
    generated again (same seeds, so the same tokens), at most rollout.max_generate_retries times."""
    import logging

    from .rollout_batch import encode_prompts

    from .prompt_limits import check_encoded

    retries = s.cfg.rollout.max_generate_retries
    check_encoded(encode_prompts(s.tokenizer, samples), s.cfg)   # an input error: a restart cannot fix it
    for attempt in range(retries + 1):
        try:
            if fault_inject.fires("engine_crash", msg["step"], dist.get_rank()):
                raise RuntimeError("injected engine failure (QRL_FAULT_INJECT)")
            return s.engine.generate(encode_prompts(s.tokenizer, samples), s.sampling(msg["step"], index_offset))
        except Exception as err:  # noqa: BLE001 - any engine failure is retried on a fresh engine
            if attempt == retries:
                raise RuntimeError(f"engine rank {dist.get_rank()}: generate failed {retries + 1} times at step "
                                   f"{msg['step']}; last error: {err!r}") from err
            logging.getLogger(__name__).warning("engine rank %d: generate failed at step %d (%r); restarting the "
                                                "engine and retrying", dist.get_rank(), msg["step"], err)
            s.restart_engine()
            _install(s.engine, msg, s.cfg)
    return []


def build_rollouts(s, place) -> Optional[object]:
    """The loop's rollout interface for this rank (None on a disaggregated job's engine ranks)."""
    if s.cfg.rollout.engine == "sglang" and s.cfg.rollout.placement == "disaggregated":
        from .sglang_rollouts import SGLangServerRollouts   # servers outside the job; every rank trains

        return SGLangServerRollouts(s)
    if not place.disaggregated:
        return ColocatedRollouts(s)
    return RemoteRollouts(s, place) if place.is_trainer(dist.get_rank()) else None
