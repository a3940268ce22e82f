"""DAPO pieces: the group filter, the soft overlong penalty, overlong filtering and the dynamic-sampling batch
builder (refills, trimming, the retry limit, counts), with a scripted engine and hand-computed rewards."""
from types import SimpleNamespace

import pytest
import torch

from megatron_qrl.config import ConfigError, from_dict
from megatron_qrl.data import CharTokenizer, Sample
from megatron_qrl.pipeline import batch_collector, build_batch
from megatron_qrl.pipeline.batch_sampling import DynamicSampling, OneShot
from megatron_qrl.rl import grpo_advantages, informative_groups, overlong_penalty
from megatron_qrl.rollout.protocol import RolloutSample

G = 2


def test_informative_groups():
    assert informative_groups([1, 1, 0, 1, 0.5, 0.5], 2).tolist() == [False, True, False]
    assert informative_groups([0.0, 0.0, 0.0], 3).tolist() == [False]
    with pytest.raises(ValueError, match="group_size=2"):
        informative_groups([1.0, 0.0, 1.0], 2)


def test_soft_overlong_penalty_hand_computed():
    # L_max = 8, buffer 4: no penalty up to 4 tokens, then -(n - 4)/4, -1 at the limit (factor 0.5 scales it)
    got = overlong_penalty([1, 4, 5, 6, 8, 9], max_len=8, buffer_len=4, factor=0.5).tolist()
    assert got == pytest.approx([0.0, 0.0, -0.125, -0.25, -0.5, -0.5])
    assert overlong_penalty([3, 8], 8, 0).tolist() == [0.0, 0.0]   # off
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        overlong_penalty([3], 4, 5)


# ------------------------------------------------------------------------------------ scripted engine
class ScriptedRollouts:
    """generate() answers prompt k's j-th response with the digit script[k][j] (length: 1 token + EOS; a
    negative digit d means a truncated response of max_new_tokens tokens scoring -d - 1)."""

    def __init__(self, tok, max_new_tokens):
        self.tok, self.max_new = tok, max_new_tokens
        self.first_indices = []

    def generate(self, prompts, step, first_index=0):
        self.first_indices.append(first_index)
        samples = [p for p in prompts for _ in range(G)]
        outs = []
        for i, sample in enumerate(samples):
            digit = sample.meta["script"][i % G]
            ids = self.tok.encode(sample.prompt, add_bos=True)
            if digit >= 0:
                toks, reason = self.tok.encode(str(digit)) + [self.tok.eos_id], "stop"
            else:
                toks, reason = self.tok.encode(str(-digit - 1)) * self.max_new, "length"
                toks = toks[:self.max_new]
            outs.append(RolloutSample(ids, toks, torch.full((len(toks),), -0.5), reason))
        return samples, outs, {"rollout/s": 1.0}


def _reward(response, sample):
    """A response's first character is its reward (the scripts use 0 and 1)."""
    return float(response[:1] or 0)


def _setup(scripts, **rl):
    """A fake RunSetup whose prompt stream yields batches of 2 prompts with the given reward scripts."""
    tok = CharTokenizer()
    batches = iter([[Sample(f"{b}{k}=", "", meta={"script": s}) for k, s in enumerate(batch)]
                    for b, batch in enumerate(scripts)])
    cfg = from_dict({"rollout": {"group_size": G, "prompts_per_step": 2, "max_new_tokens": 4},
                     "rl": {"dynamic_sampling": {"enabled": True, "max_generate_calls": 3}, **rl}})
    s = SimpleNamespace(prompts=batches, tokenizer=tok, reward_fn=_reward)
    return cfg, s, ScriptedRollouts(tok, 4)


def test_dynamic_sampling_refills_until_the_batch_is_full():
    cfg, s, r = _setup([[[1, 1], [0, 1]], [[0, 0], [1, 0]], [[0, 1], [0, 1]]])
    batch, m = batch_collector(cfg)(s, r, step=0)
    assert batch.rewards.tolist() == [0.0, 1.0, 1.0, 0.0]            # group (0,1) of call 1, (1,0) of call 2
    assert batch.advantages.tolist() == pytest.approx(grpo_advantages(batch.rewards, G).tolist())
    assert r.first_indices == [0, 4]                                  # call 2's responses: sample indices 4..7
    assert m["dynamic_sampling/generate_calls"] == 2 and m["dynamic_sampling/extra_generate_calls"] == 1
    assert m["dynamic_sampling/dropped_groups"] == 2 and m["dynamic_sampling/kept_groups"] == 2
    assert m["dynamic_sampling/batch_full"] == 1.0
    assert m["dynamic_sampling/reward_mean_generated"] == pytest.approx(4 / 8)
    assert m["rollout/s"] == 2.0 and m["rollout/tokens_per_s"] == pytest.approx(16 / 2.0)   # 8 x (digit + EOS)
    assert next(s.prompts)[0].prompt == "20="                         # exactly two prompt batches were drawn


def test_an_overfull_call_is_trimmed_in_generation_order():
    cfg, s, r = _setup([[[1, 1], [0, 1]], [[1, 0], [0, 1]]])
    batch, m = batch_collector(cfg)(s, r, step=0)
    assert [x.prompt for x in batch.samples] == ["01=", "01=", "10=", "10="]
    assert m["dynamic_sampling/kept_groups"] == 2 and m["dynamic_sampling/dropped_groups"] == 1


def test_the_retry_limit_trains_on_fewer_groups_or_on_the_last_call():
    cfg, s, r = _setup([[[1, 1], [0, 0]], [[0, 0], [0, 1]], [[1, 1], [1, 1]]])
    batch, m = batch_collector(cfg)(s, r, step=0)
    assert len(batch.samples) == G and batch.rewards.tolist() == [0.0, 1.0]   # one group after 3 calls
    assert m["dynamic_sampling/generate_calls"] == 3 and m["dynamic_sampling/batch_full"] == 0.0
    assert m["dynamic_sampling/kept_groups"] == 1 and m["dynamic_sampling/dropped_groups"] == 5
    cfg, s, r = _setup([[[1, 1], [0, 0]], [[0, 0], [0, 0]], [[1, 1], [1, 1]]])
    batch, m = batch_collector(cfg)(s, r, step=0)
    assert [x.prompt for x in batch.samples] == ["20=", "20=", "21=", "21="]   # nothing kept: the last call
    assert batch.advantages.abs().sum() == 0 and m["dynamic_sampling/kept_groups"] == 0


def test_overlong_shaping_feeds_the_advantages_and_the_filter():
    # a group of two correct answers, one truncated: equal verifier rewards, different shaped rewards
    cfg, s, r = _setup([[[1, -2], [0, 0]], [[1, 1], [0, 1]]], overlong_buffer_len=2, overlong_penalty_factor=0.5,
                       mask_truncated=True)
    batch, m = DynamicSampling(cfg)(s, r, step=0)
    assert batch.rewards.tolist() == [1.0, 1.0, 0.0, 1.0]              # the verifiers' rewards (logged)
    # 4 = max_new_tokens tokens with buffer 2: penalty -0.5 * (4 - 2) / 2 = -0.5
    assert batch.train_rewards.tolist() == [1.0, 0.5, 0.0, 1.0]
    assert batch.advantages.tolist() == pytest.approx(grpo_advantages(batch.train_rewards, G).tolist())
    assert m["overlong/penalty_mean"] == pytest.approx(-0.5 / 4) and m["overlong/masked_frac"] == 0.25
    assert batch.loss_mask[1].sum() == 0 and batch.loss_mask[0].sum() == 2   # truncated: no loss (filtering)


def test_one_shot_is_the_loop_without_dynamic_sampling():
    cfg, s, r = _setup([[[1, 1], [0, 1]]], dynamic_sampling={"enabled": False})
    collect = batch_collector(cfg)
    assert isinstance(collect, OneShot)
    batch, m = collect(s, r, step=3)
    assert m == {"rollout/s": 1.0}                                     # no extra metrics when the options are off
    assert batch.rewards.tolist() == [1.0, 1.0, 0.0, 1.0] and batch.train_rewards is None
    cfg2, s2, r2 = _setup([[[1, 1], [0, 1]]])
    samples, outs, _ = r2.generate(next(s2.prompts), 3)
    ref = build_batch(samples, outs, s2.tokenizer, G, True, _reward)
    for name in ("rewards", "advantages", "tokens", "loss_mask", "logp_rollout"):
        assert torch.equal(getattr(batch, name), getattr(ref, name)), name


def test_config_checks_name_the_fields():
    with pytest.raises(ConfigError, match=r"rl\.dynamic_sampling\.enabled needs rollout\.group_size >= 2"):
        from_dict({"rl": {"dynamic_sampling": {"enabled": True}}, "rollout": {"group_size": 1}})
    with pytest.raises(ConfigError, match=r"rollout\.placement=colocated or rollout\.engine=sglang"):
        from_dict({"rl": {"dynamic_sampling": {"enabled": True}}, "rollout": {"placement": "disaggregated"}})
    with pytest.raises(ConfigError, match=r"rl\.overlong_buffer_len \(16\) must be < rollout\.max_new_tokens"):
        from_dict({"rl": {"overlong_buffer_len": 16}, "rollout": {"max_new_tokens": 16}})
    with pytest.raises(ConfigError, match=r"rl\.dynamic_sampling\.max_generate_calls"):
        from_dict({"rl": {"dynamic_sampling": {"max_generate_calls": 0}}})
