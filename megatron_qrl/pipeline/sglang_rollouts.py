"""rollout.engine=sglang in the RL loop: which ranks hold an SGLang engine, the weight sync into it, and the
trainer ranks' Rollouts when the SGLang servers run outside the job.

colocated      every rank builds an in-process sglang.Engine on its own GPU (base_gpu_id = this rank's CUDA
               device) and generates its data-parallel share through ColocatedRollouts, exactly where the
               embedded engine would sit (data parallel only: check_rl_layout). Each rank packs its own
               unsharded trainer weights, so a sync needs no communication.
disaggregated  the servers are `rollout.sglang_server_urls` (started by the user, docs/sglang.md), not ranks
               of this job: every job rank trains (platform.Placement). Trainer rank 0 alone talks to SGLang:
               it sends the weights (trainer_payload gathers a sharded trainer's), generates the whole batch
               through the router / servers, and broadcasts the samples to the other trainer ranks.

What a sync sends: the codec's FP4 bytes and plain tensors under Megatron names with their digests;
SGLangEngine.update_weights checks the digests on exactly these payloads, maps the names to Hugging Face
(rollout/sglang/names.py, row splits only) and sends buckets. AQN: SGLang's norms have no noise buffer, so
the step's draw Z goes into the payload instead -- the two AQN norms of each layer are sent as w + Z (the
embedded engine's effective weight, same seed, same draw order) and their digests are recomputed.
TRACE is refused by the adapter (trace.enabled with rollout.engine=sglang fails config validation).
"""
from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist

from megatron_qrl.rollout.weights import payload_digest, payload_nbytes

from .weight_sync import aqn_seed, holds_digests, local_payload, set_trainer_aqn, trainer_payload


def build_sglang_run_engine(cfg, rank: int):
    """This rank's SGLangEngine, or None (disaggregated: only trainer rank 0 talks to the servers)."""
    from megatron_qrl.rollout.sglang import build_sglang_engine
    from megatron_qrl.rollout.sglang.names import qwen3_moe_name_map

    if cfg.rollout.placement == "disaggregated" and rank != 0:
        return None
    gpu = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return build_sglang_engine(cfg, name_map=qwen3_moe_name_map(cfg.model), base_gpu_id=gpu)


# ------------------------------------------------------------------------------------------ weights
def add_aqn_noise(weights: dict, hashes: dict, cfg, sigma: float, seed: int) -> None:
    """The engine's AQN draw folded into the sent norm weights: w + Z for every (layer, AQN norm), drawn in
    models.set_aqn_noise's order from the same seed; digests of the changed payloads recomputed."""
    from megatron_qrl.models.aqn_norm import AQN_ROLES
    from megatron_qrl.rl.aqn import aqn_noise

    if sigma <= 0:
        return
    generator = torch.Generator().manual_seed(int(seed))
    for layer in range(cfg.model.num_layers):
        for role in AQN_ROLES:
            z = aqn_noise(cfg.model.hidden_size, sigma, generator=generator)
            name = f"decoder.layers.{layer}.{role}.weight"
            w = weights[name]
            weights[name] = w + z.to(device=w.device, dtype=w.dtype)
            hashes[name] = payload_digest(weights[name])


def _install(engine, weights: dict, hashes: dict, version: int, sigma: float, t0: float) -> dict:
    engine.update_weights(weights, version, hashes)
    audit = engine.last_audit
    return {"sync/s": time.perf_counter() - t0, "sync/hash_ok": holds_digests(engine.digests, hashes),
            "sync/tensors": float(len(hashes)), "sync/wire_tensors": float(audit.get("wire_tensors", 0)),
            "sync/buckets": float(audit.get("buckets", 0)),
            "sync/bytes": float(sum(payload_nbytes(w) for w in weights.values())),
            "aqn/sigma": sigma}


def sync_sglang(engine, trainer, cfg, step: int, version: int) -> dict:
    """weight_sync.sync_weights for rollout.engine=sglang (also the re-sync after an engine restart).

    colocated: pack this rank's weights, add the AQN draw, install. disaggregated (trainer rank 0, restart
    path only): re-send the step's retained update -- the trainer has not changed since the step's sync."""
    t0 = time.perf_counter()
    sigma = set_trainer_aqn(trainer, cfg, step)
    if cfg.rollout.placement == "disaggregated":
        if engine.retained_update is None:
            raise RuntimeError("no retained weight update to re-send to the SGLang servers: a disaggregated "
                               "engine is synced by SGLangServerRollouts.sync (all trainer ranks), not here")
        weights, hashes, _ = engine.retained_update
        return _install(engine, weights, hashes, version, sigma, t0)
    weights, hashes = local_payload(trainer, cfg)
    add_aqn_noise(weights, hashes, cfg, sigma, aqn_seed(cfg.run.seed, step))
    return _install(engine, weights, hashes, version, sigma, t0)


# ------------------------------------------------------------------------------------- disaggregated
class SGLangServerRollouts:
    """The loop's Rollouts when SGLang servers run outside the job (see the module docstring)."""

    def __init__(self, s):
        self.s = s

    def sync(self, step: int, cfg=None) -> dict:
        s, cfg = self.s, cfg or self.s.cfg
        t0 = time.perf_counter()
        sigma = set_trainer_aqn(s.trainer, cfg, step)
        weights, hashes = trainer_payload(s.trainer, cfg)        # collective over the trainer ranks
        if dist.get_rank() != 0:
            return {"aqn/sigma": sigma}
        add_aqn_noise(weights, hashes, cfg, sigma, aqn_seed(cfg.run.seed, step))
        s.engine.retained_update = (weights, hashes, step)      # for a restart during this step's generation
        return _install(s.engine, weights, hashes, step, sigma, t0)

    def generate(self, prompts: list, step: int, first_index: int = 0):
        from .rollout_batch import encode_prompts
        from .rollout_service import broadcast_object

        s = self.s
        t0 = time.perf_counter()
        samples = [p for p in prompts for _ in range(s.cfg.rollout.group_size)]
        mine = samples if dist.get_rank() == 0 else []               # rank 0 asks SGLang for the whole batch
        rollouts = s.guard.generate(encode_prompts(s.tokenizer, mine) if mine else [], s.sampling(step, first_index),
                                    step)
        if dist.get_world_size() > 1:
            rollouts = broadcast_object(rollouts if dist.get_rank() == 0 else None, src=0)
        return samples, rollouts, {"rollout/s": time.perf_counter() - t0}

    def hand_over(self, batch, step: int) -> None:
        """Nothing to hand over: SGLang records no TRACE bits (config validation refuses trace.enabled)."""

    def idle(self) -> None:
        if self.s.engine is not None:
            self.s.engine.retained_update = None                     # the trainer's turn: drop the payload

    def evaluate(self, step: int) -> dict:
        from .evaluate import evaluate
        from .rollout_service import broadcast_object
        from .weight_sync import noise_free

        s = self.s
        self.sync(step, noise_free(s.cfg))   # the weights after this step's updates, no AQN: as `qrl eval`
        m: Optional[dict] = None
        if dist.get_rank() == 0:
            m = evaluate(s.engine, s.tokenizer, s.eval_set, s.cfg.rollout.max_new_tokens, s.reward_fn,
                         s.cfg.data.reward_time_limit_s)
        self.idle()                          # the evaluation's payload is not kept for a restart either
        return broadcast_object(m, src=0) if dist.get_world_size() > 1 else m

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.s.engine is not None:
            self.s.engine.shutdown()     # launched servers stop; external servers are left running
        return None
