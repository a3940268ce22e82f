"""R3 rollout routing replay (METHODS.md section 6) as a Megatron TopKRouter subclass.

The router still computes its logits (so its weight gets gradients through the probabilities), but
when replay ids [tokens, topk] are set for the current micro-batch the top-k *selection* is replaced by
those ids. Probabilities follow Megatron's own normalisation for the chosen ids (we hand the ids to
Megatron's routing through its `router_replay.get_replay_topk` hook):
- softmax score, moe_router_pre_softmax=False (Qwen3-MoE's default): probs = softmax over the logits
  gathered at the replayed ids (renormalised over the k chosen experts);
- pre-softmax: probs = softmax over all experts, gathered at the ids;
- sigmoid: sigmoid scores at the ids, normalised to sum 1 when topk > 1.
Each replayed forward records `agreement`: the fraction of the tokens*k slots whose own top-k set
contained the replayed expert (logged as r3/router_agreement).

Without replay ids the router behaves exactly like Megatron's TopKRouter and remembers the ids it chose
(`last_topk_ids`, [tokens, topk]) so the rollout engine can return them from the same model code.
Token order is Megatron's: [seq, batch] flattened (seq-major), and under sequence parallelism the
local sequence shard only; `megatron_qrl.trainer.batch.replay_ids_for_router` does that slicing.
"""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.moe.router import TopKRouter


class _ReplayHook:
    """Implements the `get_replay_topk` interface Megatron's topk routing calls into."""

    def __init__(self, router: "R3TopKRouter"):
        self.router = router
        self.layer_number = None

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        r = self.router
        own_vals, own_ids = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        ids = r.replay_ids
        if ids is None:
            r.last_topk_ids = own_ids.detach()
            return own_vals, own_ids
        on_host = ids.device.type == "cpu"
        ids = ids.to(device=scores.device, dtype=torch.long)
        if ids.shape != own_ids.shape:
            raise ValueError(f"R3 replay ids for layer {r.layer_index} have shape {tuple(ids.shape)}, the "
                             f"router sees {tuple(own_ids.shape)} [tokens, topk] (tokens are [seq, batch] "
                             "flattened, sequence-parallel shard only)")
        # the range check reads the ids: free for host ids; device ids were checked once per batch by the
        # trainer (Trainer._shard), so no host sync per router and micro-batch
        if on_host and (int(ids.min()) < 0 or int(ids.max()) >= scores.shape[1]):
            raise ValueError(f"R3 replay ids for layer {r.layer_index} must lie in [0, {scores.shape[1]})")
        with torch.no_grad():   # agreement counts stay on the device until pop_router_agreement
            own_mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, own_ids, True)
            hits = own_mask.gather(1, ids)
            if r.replay_counted is None:
                r.agreement_hits = r.agreement_hits + hits.sum()
                r.agreement_total = r.agreement_total + hits.numel()
            else:   # only tokens the engine routed (no padding)
                counted = r.replay_counted
                r.agreement_hits = r.agreement_hits + (hits & counted[:, None]).sum()
                r.agreement_total = r.agreement_total + counted.sum() * hits.shape[1]
        r.last_topk_ids = ids
        return scores.gather(1, ids), ids


class R3TopKRouter(TopKRouter):
    """TopKRouter whose top-k selection can be replaced by rollout ids for the current micro-batch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.layer_index = -1                      # global 0-based, set by assign_sites
        self.replay_ids: Optional[torch.Tensor] = None
        self.replay_counted: Optional[torch.Tensor] = None   # bool [tokens]: slots agreement counts
        self.last_topk_ids: Optional[torch.Tensor] = None
        self.agreement_hits = 0
        self.agreement_total = 0
        self.router_replay = _ReplayHook(self)

    def set_replay(self, ids: Optional[torch.Tensor], counted: Optional[torch.Tensor] = None) -> None:
        """Replay these [tokens, topk] expert ids in the next forwards (None: route normally); `counted`
        (bool [tokens]) limits the agreement statistic to real, engine-routed tokens."""
        self.replay_ids = ids
        self.replay_counted = counted if ids is not None else None


def r3_routers(model) -> list[R3TopKRouter]:
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [m for c in chunks for m in c.modules() if isinstance(m, R3TopKRouter)]


def clear_replay(model) -> None:
    for r in r3_routers(model):
        r.set_replay(None)


def pop_router_agreement(model) -> tuple:
    """(matching slots, replayed slots) summed over this rank's routers since the last call (ints or device
    tensors: read them once, e.g. with the all-reduce the trainer does); resets."""
    hits = total = 0
    for r in r3_routers(model):
        hits, total = hits + r.agreement_hits, total + r.agreement_total
        r.agreement_hits = r.agreement_total = 0
    return hits, total
