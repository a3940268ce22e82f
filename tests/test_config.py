"""Config: YAML + dotted overrides, and invalid combinations that fail with the field and the fix."""
import pytest

from megatron_qrl.config import ConfigError, QRLConfig, apply_overrides, from_dict, load_config


def test_overrides_parse_yaml_scalars(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  num_layers: 4\ntrainer:\n  lr: 0.001\n")
    cfg = load_config(p, ["trainer.tensor_parallel=2", "rl.is_method=tis", "trace.enabled=false",
                          "model.hidden_size=256"])
    assert cfg.trainer.tensor_parallel == 2 and cfg.rl.is_method == "tis" and cfg.trace.enabled is False
    assert cfg.model.hidden_size == 256 and cfg.trainer.lr == 0.001


INVALID = [
    (["trainer.tensor_parallel=3"], "trainer.tensor_parallel"),
    (["trainer.expert_parallel=3"], "trainer.expert_parallel"),
    (["trainer.pipeline_parallel=3"], "trainer.pipeline_parallel"),
    (["model.num_query_groups=3"], "model.num_query_groups"),
    (["trace.num_cached_layers=9"], "trace.num_cached_layers"),
    (["model.moe_router_topk=9"], "model.moe_router_topk"),
    (["r3.enabled=false"], "r3.enabled=true"),
    (["rollout.weights=bf16"], "rollout.weights=nvfp4"),
    (["rl.is_method=xyz"], "rl.is_method"),
    (["trainer.lr=-1"], "trainer.lr"),
    (["model.hidden_size=120", "model.num_attention_heads=4"], "model.hidden_size"),
    (["aqn.sigma_end=1"], "aqn.sigma_end"),
    (["rl.icepop_low=3"], "rl.icepop_low"),
    (["data.task=jsonl"], "data.path"),
    (["model.num_experts=0", "trainer.expert_parallel=2"], "trainer.expert_parallel"),
    (["trainer.tensor_parallel=2", "trainer.sequence_parallel=false"], "trainer.sequence_parallel"),
    (["rollout.max_new_tokens=500"], "model.max_sequence_length"),
    (["model.typo_field=1"], "model.typo_field: unknown field"),
    (["rollout.engine=sglang"], "trace.enabled=false"),
    (["trainer.min_lr=1"], "trainer.min_lr"),
    (["aqn.stages=2"], "aqn.stages"),
    (["rollout.top_p=0"], "rollout.top_p"),
]


@pytest.mark.parametrize("overrides,needle", INVALID, ids=[o[0] for o, _ in INVALID])
def test_invalid_config_names_field_and_fix(overrides, needle):
    with pytest.raises(ConfigError) as err:
        from_dict(apply_overrides({}, overrides))
    assert needle in str(err.value)


def test_world_size_check_before_process_groups():
    cfg = from_dict(apply_overrides({}, ["trainer.tensor_parallel=2"]))
    cfg.check_world_size(2)
    with pytest.raises(ConfigError, match="must divide the number of trainer ranks"):
        cfg.check_world_size(3)


def test_cached_layers_default_to_deeper_half():
    assert QRLConfig().cached_layers() == [2, 3]
    assert from_dict(apply_overrides({}, ["trace.num_cached_layers=1"])).cached_layers() == [3]


def test_missing_file_and_bad_override():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent.yaml")
    with pytest.raises(ConfigError, match="section.field=value"):
        load_config(None, ["trainer.tensor_parallel"])
