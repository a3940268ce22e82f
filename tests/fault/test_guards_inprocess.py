"""The step guard on a real Megatron trainer (one process): a NaN/Inf step leaves weights, Adam state, LR schedule
and the trainer step bit-identical; a finite step changes them; a failed engine is restarted and the retried batch
equals an undisturbed generate; checkpoint checksums catch a flipped byte."""
import json

import pytest
import torch

from megatron_qrl.config import from_dict

TINY = {"model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
                  "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 64, "ffn_hidden_size": 64,
                  "vocab_size": 64, "max_sequence_length": 64},
        "trainer": {"micro_batch_size": 4, "use_distributed_optimizer": False, "lr": 1e-3},
        "rollout": {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 6, "max_generate_retries": 1},
        "trace": {"enabled": False}, "run": {"total_steps": 20, "max_nonfinite_steps": 2}}


@pytest.fixture(scope="module")
def s():
    from megatron_qrl.pipeline import RunSetup

    setup = RunSetup.build(from_dict(TINY))
    _update(setup, _batch(setup, 0), 0)  # one finite update first, so Adam has state to compare
    return setup


def _state(s):
    params = {n: p.detach().clone() for n, p in s.trainer.model[0].module.named_parameters()}
    adam = {}
    for i, sub in enumerate(s.trainer.optimizer.chained_optimizers):
        for j, st in enumerate(sub.optimizer.state.values()):
            adam.update({(i, j, k): v.clone() for k, v in st.items() if torch.is_tensor(v)})
    return params, adam, s.trainer.step, s.trainer.optimizer.param_groups[0]["lr"]


def _batch(s, step):
    from megatron_qrl.pipeline import build_batch, generate_shard, sync_weights

    sync_weights(s.engine_ready(), s.trainer, s.cfg, step, version=step)
    samples, rollouts = generate_shard(s, next(s.prompts), step)
    return build_batch(samples, rollouts, s.tokenizer, s.cfg.rollout.group_size, True, s.reward_fn)


def _update(s, batch, step):
    from megatron_qrl.pipeline import grpo_loss, trainer_batch
    from megatron_qrl.rl import is_weights

    s.guard.check_batch(batch, step)
    batch.advantages[batch.advantages == 0] = 0.5  # a tiny batch may have all-equal rewards: force a gradient
    logp_old = s.trainer.logprobs(trainer_batch(batch))
    weights, _ = is_weights(logp_old, batch.logp_rollout, batch.advantages, batch.loss_mask, s.cfg.rl.is_method,
                            s.cfg.rl)
    stats = s.trainer.train_step(trainer_batch(batch, logp_old, weights), grpo_loss(s.cfg.rl))
    return stats, s.guard.end_step(stats)


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a) and a.keys() == b.keys()


@pytest.mark.parametrize("kind", ["nan_reward", "nan_loss", "nan_grad"])
def test_nonfinite_step_is_skipped_and_leaves_the_state_bit_identical(s, kind, monkeypatch):
    step = {"nan_reward": 1, "nan_loss": 2, "nan_grad": 3}[kind]
    batch = _batch(s, step)
    before = _state(s)
    monkeypatch.setenv("QRL_FAULT_INJECT", f"{kind}@{step}")
    stats, fault = _update(s, batch, step)
    after = _state(s)
    assert fault["fault/nonfinite_skipped"] == 1.0 and stats["update_successful"] == 0.0
    assert _same(before[0], after[0]), "weights changed on a skipped step"
    assert before[1] and _same(before[1], after[1]), "Adam state changed on a skipped step"
    assert before[2:] == after[2:], "trainer step / LR schedule advanced on a skipped step"
    assert all(torch.isfinite(p).all() for p in after[0].values())
    monkeypatch.delenv("QRL_FAULT_INJECT")
    stats, fault = _update(s, _batch(s, step + 10), step + 10)  # a finite step updates again, streak resets
    assert fault["fault/nonfinite_skipped"] == 0.0 and fault["fault/nonfinite_in_row"] == 0.0
    assert stats["update_successful"] == 1.0 and not _same(after[0], _state(s)[0])
    assert s.trainer.step == after[2] + 1


def test_too_many_nonfinite_steps_in_a_row_checkpoint_then_stop(s, tmp_path, monkeypatch):
    from megatron_qrl.pipeline import save_checkpoint
    from megatron_qrl.pipeline.guards import NonFiniteStop

    monkeypatch.setattr(s.cfg.run, "output_dir", str(tmp_path))
    monkeypatch.setenv("QRL_FAULT_INJECT", "nan_grad@30,nan_grad@31,nan_grad@32")
    for step in (30, 31):
        _update(s, _batch(s, step), step)
        s.guard.stop_if_exhausted(save_checkpoint, step + 1)  # 1, 2 in a row: max_nonfinite_steps=2 allows it
    _update(s, _batch(s, 32), 32)
    with pytest.raises(NonFiniteStop, match=r"3 RL steps in a row .* run.max_nonfinite_steps=2") as err:
        s.guard.stop_if_exhausted(save_checkpoint, 33)
    assert err.value.code == 3
    ckpt = tmp_path / "checkpoints" / "step_000033"
    assert (ckpt / "manifest.json").is_file() and str(ckpt) in str(err.value)
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_000033"
    s.guard.in_row = 0


def test_failed_engine_is_restarted_and_the_batch_retried_identically(s, monkeypatch):
    from megatron_qrl.pipeline import encode_prompts, sync_weights
    from megatron_qrl.pipeline.guards import EngineFailure

    prompts = encode_prompts(s.tokenizer, [p for p in next(s.prompts) for _ in range(2)])
    sync_weights(s.engine_ready(), s.trainer, s.cfg, 40, version=40)
    clean = s.guard.generate(prompts, s.sampling(40), 40)
    engine, restarts = s.engine, s.guard.engine_restarts
    monkeypatch.setenv("QRL_FAULT_INJECT", "engine_crash@40")
    retried = s.guard.generate(prompts, s.sampling(40), 40)
    assert s.engine is not engine and s.guard.engine_restarts == restarts + 1  # a fresh engine
    assert [r.tokens for r in retried] == [r.tokens for r in clean]
    assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(retried, clean))
    monkeypatch.setenv("QRL_FAULT_INJECT", "engine_crash@41x5")  # more failures than max_generate_retries=1
    with pytest.raises(EngineFailure, match=r"failed 2 times .*rollout.max_generate_retries=1"):
        s.guard.generate(prompts, s.sampling(41), 41)


def test_a_prompt_longer_than_the_context_is_an_input_error_and_never_restarts_the_engine(s):
    from megatron_qrl.errors import PromptTooLong
    from megatron_qrl.pipeline import encode_prompts

    prompts = encode_prompts(s.tokenizer, next(s.prompts))
    prompts[1] = prompts[1] * 40   # 40x the prompt: far beyond max_sequence_length - max_new_tokens
    engine, restarts = s.engine, s.guard.engine_restarts
    with pytest.raises(PromptTooLong, match=r"1 prompt\(s\) of this batch are longer than the 58 tokens .* raise "
                                            r"model.max_sequence_length \(64\)"):
        s.guard.generate(prompts, s.sampling(42), 42)
    assert s.engine is engine and s.guard.engine_restarts == restarts


def test_checkpoint_checksums_catch_a_flipped_byte_and_a_missing_file(s, tmp_path):
    from megatron_qrl.trainer.checkpoint import CheckpointCorrupt

    path = tmp_path / "ck"
    s.trainer.save(str(path), {"step": 1})
    manifest = json.loads((path / "manifest.json").read_text())
    assert set(manifest["checksums"]) == set(manifest["files"]) and manifest["files"]
    s.trainer.load(str(path))  # intact: loads
    big = max(manifest["files"], key=lambda n: manifest["checksums"][n]["size"])
    data = bytearray((path / big).read_bytes())
    data[len(data) // 2] ^= 0x01
    (path / big).write_bytes(bytes(data))
    before = _state(s)[0]
    with pytest.raises(CheckpointCorrupt, match=rf"{big}: crc32 .* != "):
        s.trainer.load(str(path))
    assert _same(before, _state(s)[0]), "a corrupt checkpoint touched the model"
    (path / big).unlink()
    with pytest.raises(CheckpointCorrupt, match=rf"{big}: missing"):
        s.trainer.load(str(path))
    (path / "manifest.json").write_text('{"format": "megatron-qrl-dist-ckpt-v1", "files": [')
    with pytest.raises(CheckpointCorrupt, match="not valid JSON"):
        s.trainer.load(str(path))


def test_resume_skips_a_corrupt_checkpoint_and_a_partial_one(s, tmp_path, monkeypatch):
    from megatron_qrl.pipeline import resume_or_warm_start, save_checkpoint

    monkeypatch.setattr(s.cfg.run, "output_dir", str(tmp_path))
    ckpts = tmp_path / "checkpoints"
    save_checkpoint(s, 50)
    save_checkpoint(s, 51)
    (ckpts / ".step_000052.tmp-123").mkdir()  # a killed save: files, no manifest, never a candidate
    (ckpts / ".step_000052.tmp-123" / "__0_0.distcp").write_bytes(b"partial")
    victim = ckpts / "step_000051" / "__0_0.distcp"
    data = bytearray(victim.read_bytes())
    data[100] ^= 0xFF
    victim.write_bytes(bytes(data))
    s.extra.pop("corrupt_checkpoints", None)
    assert resume_or_warm_start(s) == 50  # the newest *intact* checkpoint
    assert s.extra["corrupt_checkpoints"] == [str(ckpts / "step_000051")]
    save_checkpoint(s, 51)  # the corrupt one is rewritten, the orphan removed
    assert not (ckpts / ".step_000052.tmp-123").exists()
    s.extra.pop("corrupt_checkpoints")
    assert resume_or_warm_start(s) == 51
    for step in (50, 51):
        (ckpts / f"step_{step:06d}" / "__0_0.distcp").write_bytes(b"garbage")
    with pytest.raises(RuntimeError, match="every checkpoint .* is corrupt .* run.resume=false"):
        resume_or_warm_start(s)
