"""The frozen reference policy (weight swap, bit-exact restore, offload) and the KL step of the loop (loss
term vs reward penalty), with a small torch model standing in for the trainer and hand-computed numbers."""
import copy
import math
from types import SimpleNamespace

import pytest
import torch

from megatron_qrl.config import from_dict
from megatron_qrl.pipeline.reference_kl import NoKL, ReferenceKL, kl_metrics, kl_reward_penalty, reference_kl
from megatron_qrl.pipeline.rollout_batch import RolloutBatch
from megatron_qrl.rl import grpo_advantages
from megatron_qrl.trainer.reference import ReferencePolicy


class TinyTrainer:
    """Trainer.logprobs' contract on a linear 'language model': logp[:, t] = log p(tokens[t] | tokens[t-1])."""

    def __init__(self):
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5))
        self.net[0].weight.requires_grad_(False)           # frozen, like a LoRA base: not in the store
        self.model = [self.net]
        self.routers = [SimpleNamespace(agreement_hits=7, agreement_total=9)]

    @torch.no_grad()
    def logprobs(self, batch):
        tok = batch["tokens"]
        logits = self.net(tok[:, :-1]).log_softmax(-1)
        out = torch.zeros(tok.shape)
        out[:, 1:] = logits.gather(-1, tok[:, 1:, None])[..., 0]
        for r in self.routers:     # a replayed forward would count router agreement
            r.agreement_hits += 100
        return out


def _batch():
    return {"tokens": torch.tensor([[0, 1, 2, 3], [4, 3, 2, 1]])}


@pytest.mark.parametrize("offload", [False, True])
def test_reference_is_the_snapshot_and_the_policy_comes_back_bit_exact(offload):
    tr = TinyTrainer()
    initial = copy.deepcopy(tr.net)
    ref = ReferencePolicy(tr, offload=offload)
    assert ref.nbytes == 4 * (3 * 5 + 5)                  # trainable parameters only (the Linear)
    with torch.no_grad():                                  # "training" moves the policy away
        tr.net[1].weight.add_(0.3)
        tr.net[1].bias.mul_(-2.0)
    policy = [p.detach().clone() for p in tr.net.parameters()]
    from megatron_qrl.models.fp4_linear import _WEIGHT_EPOCH
    epoch = _WEIGHT_EPOCH[0]
    got = ref.logprobs(_batch())
    want = TinyTrainer.logprobs(SimpleNamespace(net=initial, routers=[]), _batch())
    assert torch.equal(got, want)
    assert not torch.equal(got, tr.logprobs(_batch()))
    assert all(torch.equal(a, b) for a, b in zip(tr.net.parameters(), policy))   # restored bit for bit
    assert _WEIGHT_EPOCH[0] == epoch + 2                   # FP4 weight caches dropped at both swaps
    assert (tr.routers[0].agreement_hits, tr.routers[0].agreement_total) != (7, 9)  # the extra call above
    tr.routers[0].agreement_hits, tr.routers[0].agreement_total = 7, 9
    ref.logprobs(_batch())
    assert (tr.routers[0].agreement_hits, tr.routers[0].agreement_total) == (7, 9)  # the reference's routing


def test_a_failing_forward_still_restores_the_policy():
    tr = TinyTrainer()
    ref = ReferencePolicy(tr)
    with torch.no_grad():
        tr.net[1].weight.add_(1.0)
    policy = [p.detach().clone() for p in tr.net.parameters()]
    with pytest.raises(RuntimeError, match="out of bounds"):
        ref.logprobs({"tokens": torch.tensor([[0, 9]])})   # token id 9 is out of the vocabulary
    assert all(torch.equal(a, b) for a, b in zip(tr.net.parameters(), policy))


# ------------------------------------------------------------------------------- the loop's KL step
def _rollout_batch(rewards=(1.0, 0.0, 1.0, 1.0)):
    B, T = 4, 3
    mask = torch.tensor([[0, 1, 1], [0, 1, 0], [0, 1, 1], [0, 0, 0]], dtype=torch.float32)
    r = torch.tensor(rewards)
    return RolloutBatch([None] * B, [None] * B, [""] * B, r, grpo_advantages(r, 2), torch.zeros(B, T, dtype=torch.long),
                        mask, torch.zeros(B, T), None, [1] * B)


class FixedReference:
    def __init__(self, logp):
        self.logp = logp

    def logprobs(self, batch):
        return self.logp


LOGP_OLD = torch.zeros(4, 3)
LOGP_REF = torch.tensor([[9.0, 0.5, -0.5], [9.0, 0.2, 9.0], [0.0, 1.0, 0.0], [9.0, 9.0, 9.0]])  # 9: off the mask


def test_kl_metrics_hand_computed():
    m = kl_metrics(LOGP_REF, LOGP_OLD, _rollout_batch().loss_mask, "k2")
    l = [0.5, -0.5, 0.2, 1.0, 0.0]          # l = logp_ref - logp on the 5 valid tokens
    assert m["kl/ref_k1"] == pytest.approx(sum(-x for x in l) / 5)
    assert m["kl/ref_k2"] == pytest.approx(sum(x * x / 2 for x in l) / 5)
    assert m["kl/ref_k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in l) / 5)
    assert m["kl/ref_mean"] == m["kl/ref_k2"]


def test_loss_mode_carries_the_reference_log_probs():
    cfg = from_dict({"rollout": {"group_size": 2}, "rl": {"kl_coef": 0.1}})
    batch, m = ReferenceKL(FixedReference(LOGP_REF), cfg).apply(_rollout_batch(), LOGP_OLD)
    assert torch.equal(batch.logp_ref, LOGP_REF) and torch.equal(batch.advantages, _rollout_batch().advantages)
    assert {"kl/ref_mean", "kl/ref_k1", "kl/ref_k2", "kl/ref_k3", "time/ref_logprobs_s"} <= set(m)


def test_reward_mode_penalises_rewards_and_recomputes_the_advantages():
    cfg = from_dict({"rollout": {"group_size": 2}, "rl": {"kl_coef": 0.5, "kl_mode": "reward", "kl_estimator": "k1"}})
    batch, m = ReferenceKL(FixedReference(LOGP_REF), cfg).apply(_rollout_batch(), LOGP_OLD)
    # k1 = -l summed per response: row 0 -(0.5 - 0.5) = 0, row 1 -0.2, row 2 -1, row 3 (no token) 0
    penalty = [0.0, 0.5 * -0.2, 0.5 * -1.0, 0.0]
    assert kl_reward_penalty(LOGP_REF, LOGP_OLD, batch.loss_mask, "k1", 0.5).tolist() == pytest.approx(penalty)
    shaped = [1.0 - penalty[0], 0.0 - penalty[1], 1.0 - penalty[2], 1.0 - penalty[3]]
    assert batch.train_rewards.tolist() == pytest.approx(shaped)
    assert batch.rewards.tolist() == [1.0, 0.0, 1.0, 1.0]         # the verifiers' rewards stay for logging
    assert batch.advantages.tolist() == pytest.approx(grpo_advantages(torch.tensor(shaped), 2).tolist())
    assert batch.advantages[2] != 0                                # the KL breaks the tie of group 1
    assert batch.logp_ref is None and m["kl/reward_penalty_mean"] == pytest.approx(sum(penalty) / 4)
    # the penalty starts from the shaped rewards when overlong shaping produced them
    shaped_batch = _rollout_batch()
    shaped_batch.train_rewards = torch.tensor([0.5, 0.0, 1.0, 1.0])
    out, _ = ReferenceKL(FixedReference(LOGP_REF), cfg).apply(shaped_batch, LOGP_OLD)
    assert out.train_rewards.tolist() == pytest.approx([0.5, 0.1, 1.5, 1.0])


def test_kl_off_builds_nothing():
    s = SimpleNamespace(cfg=from_dict({}), trainer=None)   # no trainer, prompts or output dir needed: untouched
    kl = reference_kl(s, start=5)
    assert isinstance(kl, NoKL)
    batch = _rollout_batch()
    out, m = kl.apply(batch, LOGP_OLD)
    assert out is batch and m == {}
