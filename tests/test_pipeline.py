"""The RL loop's pieces: token alignment of the trainer batch, weight sync + AQN, checkpoint pointer."""
import pytest
import torch

from megatron_qrl.config import from_dict
from megatron_qrl.data import CharTokenizer, Sample
from megatron_qrl.pipeline import build_batch, latest_checkpoint, mark_latest, step_path
from megatron_qrl.rollout.protocol import RolloutSample

TINY = {"model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
                  "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 64, "ffn_hidden_size": 64,
                  "vocab_size": 64, "max_sequence_length": 64},
        "trainer": {"micro_batch_size": 4, "use_distributed_optimizer": False},
        "rollout": {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 6},
        "run": {"total_steps": 20}}


def _rollout(prompt, tokens, layers=2, k=2):
    n = len(prompt) + len(tokens) - 1
    return RolloutSample(prompt_ids=prompt, tokens=tokens, logprobs=-torch.arange(1, len(tokens) + 1).float(),
                         finish_reason="stop", routed_experts=torch.full((n, layers, k), 3, dtype=torch.int16))


def test_trainer_batch_alignment_rewards_and_advantages():
    tok = CharTokenizer()
    samples = [Sample("1+1=", "2"), Sample("1+1=", "2")]
    good, bad = tok.encode("2") + [tok.eos_id], tok.encode("35") + [tok.eos_id]
    p = tok.encode("1+1=", add_bos=True)
    rollouts = [_rollout(p, good), _rollout(p, bad)]
    b = build_batch(samples, rollouts, tok, group_size=2, normalize_std=True, reward_fn="arithmetic")
    assert b.rewards.tolist() == [1.0, 0.0]
    assert b.advantages[0] > 0 > b.advantages[1]
    P = len(p)
    assert b.tokens.shape == (2, P + 3)
    assert b.tokens[0, :P + 2].tolist() == p + good and b.tokens[0, P + 2] == tok.pad_id
    # response token j sits at position P + j: its rollout log-prob and its loss mask
    assert b.loss_mask[0].tolist() == [0.0] * P + [1.0, 1.0, 0.0]
    assert b.logp_rollout[1, P:P + 3].tolist() == [-1.0, -2.0, -3.0]
    assert b.logp_rollout[0, :P].abs().sum() == 0
    # R3 ids: the engine's rows (P+T-1 forwarded positions), then valid filler ids 0..k-1
    assert b.r3_expert_ids.shape == (2, P + 3, 2, 2)
    assert (b.r3_expert_ids[0, :P + 1] == 3).all() and b.r3_expert_ids[0, P + 1:].tolist() == [[[0, 1]] * 2] * 2


def test_latest_pointer_is_atomic_and_ignores_missing_dirs(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    path = step_path(tmp_path, 5)
    path.mkdir(parents=True)
    mark_latest(tmp_path, path)
    assert latest_checkpoint(tmp_path) == path
    path.rmdir()
    assert latest_checkpoint(tmp_path) is None


@pytest.fixture(scope="module")
def setup():
    from megatron_qrl.pipeline import RunSetup

    cfg = from_dict({**TINY, "aqn": {"enabled": True, "sigma_start": 0.05, "sigma_end": 0.01, "stages": 4}})
    return RunSetup.build(cfg)


def test_rollout_only_aqn_sync_leaves_trainer_untouched_and_never_accumulates(setup):
    from megatron_qrl.models import aqn_norms
    from megatron_qrl.pipeline import sync_weights
    from megatron_qrl.pipeline.sync import unwrap

    s = setup
    before = {n: p.detach().clone() for c in unwrap(s.trainer.model) for n, p in c.named_parameters()}
    m1 = sync_weights(s.engine_ready(), s.trainer, s.cfg, step=5, version=1)  # stage 1: sigma_start
    assert m1["sync/hash_ok"] == 1.0 and m1["aqn/sigma"] == pytest.approx(0.05)
    after = {n: p.detach() for c in unwrap(s.trainer.model) for n, p in c.named_parameters()}
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert all(n.aqn_noise.abs().sum() == 0 for n in aqn_norms(unwrap(s.trainer.model)))
    noise1 = [n.aqn_noise.clone() for n in aqn_norms(s.engine.model)]
    assert noise1 and all(0.02 < z.std() < 0.08 for z in noise1)
    # the engine's norm weights are the trainer's (synced) weights; noise lives beside them
    eng_w = {n: p for n, p in s.engine.model.named_parameters() if n.endswith("layer_norm_weight") or "norm" in n}
    assert all(torch.equal(eng_w[n], before[n]) for n in eng_w)
    sync_weights(s.engine_ready(), s.trainer, s.cfg, step=5, version=2)  # same step -> same draw, replaced
    assert all(torch.equal(a, b.aqn_noise) for a, b in zip(noise1, aqn_norms(s.engine.model)))
    m0 = sync_weights(s.engine_ready(), s.trainer, s.cfg, step=0, version=3)  # stage 0: noise-free
    assert m0["aqn/sigma"] == 0.0 and all(n.aqn_noise.abs().sum() == 0 for n in aqn_norms(s.engine.model))
