"""Where config rules live: each section checks its own fields (config.py), the rules across sections are
config_rules.py's (the RL loop's layouts aside: pipeline's check_rl_layout); every accepted field is read by the
code it configures."""
import ast
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from megatron_qrl.config import AQNConfig, ConfigError, DataConfig, ModelConfig, QRLConfig, TrainerConfig, from_dict
from megatron_qrl.config_rules import check_world_size, cross_section_errors

ROOT = Path(__file__).resolve().parents[1]
RULE_MODULES = {ROOT / "megatron_qrl" / "config.py", ROOT / "megatron_qrl" / "config_rules.py"}
RL_JOB_RULES = "check_rl_layout"
# fields no module outside config.py reads, and why each is still there
READ_BY_CONFIG_ITSELF = {
    "trace.num_cached_layers": "QRLConfig.cached_layers() turns it into the layer list every TRACE component reads",
    "lora.dropout": "accepted only as 0, so a PEFT-style lora_dropout fails with the reason instead of 'unknown "
                    "field' (docs/lora.md)",
}


def _sources():
    for path in sorted((ROOT / "megatron_qrl").rglob("*.py")) + sorted((ROOT / "launch").rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def _leaf_fields(model: type[BaseModel], prefix: str = ""):
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from _leaf_fields(field.annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", name


def test_every_config_field_is_read_outside_the_config():
    """An attribute, keyword or string key of the field's name in the code outside config.py: a field nothing
    reads would be accepted and do nothing in a run."""
    used = set()
    for path, tree in _sources():
        if path in RULE_MODULES:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                used.add(node.attr)
            elif isinstance(node, ast.keyword) and node.arg:
                used.add(node.arg)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                used.add(node.value)
    fields = dict(_leaf_fields(QRLConfig))
    unread = sorted(p for p, name in fields.items() if name not in used and p not in READ_BY_CONFIG_ITSELF)
    assert not unread, f"config fields nothing reads (implement or remove them): {unread}"
    assert set(READ_BY_CONFIG_ITSELF) <= set(fields), "READ_BY_CONFIG_ITSELF names a field that no longer exists"


def _raises_config_error(node) -> bool:
    return isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and \
        getattr(node.exc.func, "id", None) == "ConfigError"


def test_only_the_config_modules_and_the_rl_jobs_layout_check_raise_config_errors():
    """Other components' rules raise their own errors at their use (ConvertError, SGLangConfigError, ...); the
    one exception is the layouts the RL loop runs (pipeline's check_rl_layout, beside the job's placement)."""
    raising = []
    for path, tree in _sources():
        if path in RULE_MODULES:
            continue
        allowed = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == RL_JOB_RULES
                   for n in ast.walk(f)}
        raising += [f"{path.relative_to(ROOT)}:{n.lineno}" for n in ast.walk(tree)
                    if _raises_config_error(n) and id(n) not in allowed]
    assert not raising, f"config rules outside config.py / config_rules.py: {raising}"


@pytest.mark.parametrize("section,fields,needle", [
    (ModelConfig, {"num_query_groups": 3}, "model.num_query_groups (3) must divide model.num_attention_heads"),
    (ModelConfig, {"hidden_size": 130}, "or set model.kv_channels"),
    (ModelConfig, {"moe_router_topk": 9}, "model.moe_router_topk (9) must be <= model.num_experts (8)"),
    (TrainerConfig, {"min_lr": 1.0}, "trainer.min_lr (1.0) must be <= trainer.lr"),
    (AQNConfig, {"sigma_end": 1.0}, "aqn.sigma_end (1.0) must be <= aqn.sigma_start"),
    (DataConfig, {"task": "jsonl"}, "data.task=jsonl reads a local file"),
])
def test_a_section_checks_its_own_fields_without_the_rest_of_the_config(section, fields, needle):
    with pytest.raises(ValidationError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        section(**fields)


def test_section_problems_are_reported_together():
    with pytest.raises(ConfigError) as err:
        from_dict({"model": {"num_query_groups": 3, "moe_router_topk": 9}, "aqn": {"sigma_end": 1.0}})
    text = str(err.value)
    assert "model.num_query_groups" in text and "model.moe_router_topk" in text and "aqn.sigma_end" in text


def test_cross_section_rules_see_the_whole_config():
    cfg = QRLConfig()
    assert cross_section_errors(cfg) == []
    bad = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"tensor_parallel": 3})})
    errs = cross_section_errors(bad)
    assert any(e.startswith("trainer.tensor_parallel (3) must divide model.num_attention_heads") for e in errs), errs
    assert any("per TP shard" in e for e in errs), errs   # the FP4 block rule sees the TP shard


def test_the_trainer_layout_must_tile_the_trainer_ranks():
    tp2 = from_dict({"trainer": {"tensor_parallel": 2}})
    check_world_size(tp2, 4)
    with pytest.raises(ConfigError, match=r"\(2\) must divide the number of trainer ranks \(3\)"):
        check_world_size(tp2, 3)
    ep4 = from_dict({"trainer": {"expert_parallel": 4}})
    with pytest.raises(ConfigError, match=r"expert_tensor_parallel \(4\) must divide data\*tensor parallel \(2\)"):
        check_world_size(ep4, 2)
