"""Shipped configs, analytic model sizes, and the trainer's batch sharding (no Megatron import needed)."""
import shutil
from pathlib import Path

import pytest
import torch

from megatron_qrl.config import ConfigError, load_config
from megatron_qrl.models.sizes import count_parameters
from megatron_qrl.trainer.batch import BatchError, replay_ids_for_router, shard, token_logprobs

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.mark.parametrize("name, world, total, active", [
    ("tiny_cpu", 1, (1e6, 5e6), (3e5, 1e6)),
    ("single_h200", 1, (2e8, 9e8), (1e8, 4e8)),
    ("qwen3_30b_a3b", 32, (29e9, 32e9), (3.0e9, 3.6e9)),
    ("qwen3_235b_a22b", 128, (230e9, 240e9), (21e9, 23e9)),
])
def test_shipped_configs_load_and_fit_their_layout(name, world, total, active, tmp_path):
    overrides = []
    if name == "qwen3_30b_a3b":   # a model.hf_path recipe: a directory with the release's config.json
        shutil.copy(FIXTURES / "qwen3_30b_a3b_config.json", tmp_path / "config.json")
        overrides = [f"model.hf_path={tmp_path}"]
    cfg = load_config(CONFIGS / f"{name}.yaml", overrides)
    n = count_parameters(cfg)
    assert total[0] < n["total"] < total[1] and active[0] < n["active"] < active[1], n
    cfg.check_world_size(world)  # the rank count the config's comment documents
    if world > 1:
        with pytest.raises(ConfigError, match="trainer.tensor_parallel"):
            cfg.check_world_size(world - 1)


def test_qwen3_30b_a3b_recipe_is_the_release(tmp_path):
    """The recipe's model comes from config.json alone; its placeholder path fails with the fix."""
    shutil.copy(FIXTURES / "qwen3_30b_a3b_config.json", tmp_path / "config.json")
    m = load_config(CONFIGS / "qwen3_30b_a3b.yaml", [f"model.hf_path={tmp_path}"]).model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.kv_channels, m.num_experts,
            m.moe_router_topk, m.moe_ffn_hidden_size, m.vocab_size, m.rotary_base, m.max_sequence_length,
            m.untie_embeddings_and_output_weights) == (48, 2048, 32, 4, 128, 128, 8, 768, 151936, 1000000, 8192, True)
    with pytest.raises(ConfigError, match="model.hf_path '/path/to/Qwen3-30B-A3B' is not a directory"):
        load_config(CONFIGS / "qwen3_30b_a3b.yaml")


def test_tiny_cpu_is_the_documented_toy():
    m = load_config(CONFIGS / "tiny_cpu.yaml").model
    assert (m.num_layers, m.hidden_size, m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.vocab_size,
            m.max_sequence_length) == (4, 128, 8, 2, 128, 64, 128)


def _batch(B=5, T=6):
    tokens = torch.arange(B * T).reshape(B, T) % 50
    return {"tokens": tokens, "loss_mask": torch.ones(B, T), "adv": torch.arange(B).float(),
            "r3_expert_ids": torch.zeros(B, T, 2, 2, dtype=torch.long), "note": "kept"}


def test_shard_pads_and_splits_across_data_parallel_ranks():
    b = _batch()
    parts = [shard(b, r, 2, micro_batch_size=2, seq_multiple=4) for r in range(2)]
    assert parts[0].padded_size == 8 and parts[0].padded_seq_len == 8 and parts[0].global_size == 5
    mbs = parts[0].micro_batches + parts[1].micro_batches
    ids = torch.cat([mb["sample_ids"] for mb in mbs])
    assert ids.tolist() == [0, 1, 2, 3, 4, -1, -1, -1]  # contiguous DP slices, padding marked -1
    assert float(sum(mb["sample_mask"].sum() for mb in mbs)) == 5
    assert all(mb["tokens"].shape == (2, 8) and mb["loss_mask"][:, 6:].sum() == 0 for mb in mbs)
    assert all(mb["num_global_tokens"] == 30 and mb["num_global_samples"] == 5 and mb["note"] == "kept" for mb in mbs)
    assert torch.equal(torch.cat([mb["adv"] for mb in mbs])[:5], b["adv"])
    assert mbs[0]["position_ids"].tolist()[0] == list(range(8))


def test_bad_batches_name_the_key():
    with pytest.raises(BatchError, match="tokens"):
        shard({"loss_mask": torch.ones(2, 3)}, 0, 1, 1)
    with pytest.raises(BatchError, match="position_ids"):  # left padding cannot work with Megatron's RoPE
        shard({"tokens": torch.zeros(2, 3, dtype=torch.long), "position_ids": torch.tensor([[0, 0, 1]] * 2)}, 0, 1, 1)
    with pytest.raises(BatchError, match="r3_expert_ids"):
        shard({"tokens": torch.zeros(2, 3, dtype=torch.long), "r3_expert_ids": torch.zeros(2, 3)}, 0, 1, 1)


def test_replay_ids_follow_megatron_token_order():
    ids = torch.arange(2 * 4 * 1).reshape(2, 4, 1)  # [mb=2, T=4, k=1]: value = b*4 + t
    # [s, b] flattened; under sequence parallelism rank r keeps its sequence shard
    assert replay_ids_for_router(ids, 0, 1, False).flatten().tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert replay_ids_for_router(ids, 1, 2, True).flatten().tolist() == [2, 6, 3, 7]


def test_token_logprobs_are_token_aligned():
    nll = torch.tensor([[1.0, 2.0, 3.0]])
    assert token_logprobs(nll).tolist() == [[0.0, -1.0, -2.0]]
