"""Invalid configurations through the real entry point (`qrl train --config ... overrides`): each one fails
before any process group starts (torch.distributed.init_process_group is made to fail loudly if reached), with a
message naming the field and the fix. docs/RELIABILITY.md carries this table (test_doc_lists_every_row)."""
import pytest
import torch.distributed as dist

from megatron_qrl.cli import main

from .helpers import ROOT

TINY = str(ROOT / "configs/tiny_cpu.yaml")
# (overrides, field named, fix named)
ROWS = [
    (["trainer.tensor_parallel=3"], "trainer.tensor_parallel", "choose a divisor"),
    (["trainer.expert_parallel=3"], "trainer.expert_parallel", "choose a divisor"),
    (["trainer.pipeline_parallel=3"], "trainer.pipeline_parallel", "must divide model.num_layers"),
    (["model.num_query_groups=3"], "model.num_query_groups", "must divide model.num_attention_heads"),
    (["model.hidden_size=130", "quant.format=bf16"], "model.hidden_size", "or set model.kv_channels"),
    (["model.hidden_size=72", "model.num_attention_heads=4", "model.num_query_groups=2"], "model.hidden_size",
     "pad it or set quant.format=bf16"),
    (["model.moe_router_topk=9"], "model.moe_router_topk", "must be <= model.num_experts"),
    (["model.num_experts=0", "trainer.expert_parallel=2"], "trainer.expert_parallel", "or trainer.expert_parallel=1"),
    (["trainer.tensor_parallel=2", "trainer.sequence_parallel=false"], "trainer.sequence_parallel",
     "set trainer.sequence_parallel=true"),
    (["trace.num_cached_layers=9"], "trace.num_cached_layers", "must be <= model.num_layers"),
    (["r3.enabled=false"], "r3.enabled", "set r3.enabled=true"),
    (["rollout.weights=bf16"], "rollout.weights", "set rollout.weights=nvfp4"),
    (["rollout.scheme=w4a16"], "rollout.scheme", "set rollout.scheme=w4a4"),
    (["rollout.engine=sglang"], "rollout.engine", "set trace.enabled=false"),
    (["rollout.max_new_tokens=500"], "rollout.max_new_tokens", "raise the latter"),
    (["rollout.top_p=0"], "rollout.top_p", "greater than 0"),
    (["rollout.max_generate_retries=-1"], "rollout.max_generate_retries", "greater than or equal to 0"),
    (["rl.is_method=xyz"], "rl.is_method", "'none', 'tis', 'mis', 'icepop' or 'ais'"),
    (["rl.icepop_low=3"], "rl.icepop_low", "set e.g. rl.icepop_low=0.5"),
    (["trainer.lr=-1"], "trainer.lr", "greater than 0"),
    (["trainer.min_lr=1"], "trainer.min_lr", "must be <= trainer.lr"),
    (["aqn.sigma_end=1"], "aqn.sigma_end", "must be <= aqn.sigma_start"),
    (["aqn.stages=2"], "aqn.stages", "greater than or equal to 3"),
    (["data.task=jsonl"], "data.task", "set data.path="),
    (["run.max_nonfinite_steps=0"], "run.max_nonfinite_steps", "greater than or equal to 1"),
    (["model.typo_field=1"], "model.typo_field", "check the spelling against docs/configuration.md"),
    (["trainer.tensor_parallel"], "trainer.tensor_parallel", "section.field=value"),
    (["lora.dropout=0.1"], "lora.dropout", "set lora.dropout=0"),
    (["rl.kl_estimator=abs"], "rl.kl_estimator", "choose k1, k2 or k3"),
    (["rl.kl_coef=-0.1"], "rl.kl_coef", "greater than or equal to 0"),
    (["rl.loss_agg_mode=sequence-mean"], "rl.loss_agg_mode", "'token-mean', 'seq-mean-token-mean' or"),
    (["rl.dynamic_sampling.enabled=true", "rollout.group_size=1"], "rl.dynamic_sampling.enabled",
     "needs rollout.group_size >= 2"),
    (["rl.overlong_buffer_len=16"], "rl.overlong_buffer_len", "lower it (0 = off)"),
    (["rl.dynamic_sampling.enabled=true", "rollout.placement=disaggregated"], "rl.dynamic_sampling.enabled",
     "use rollout.placement=colocated or rollout.engine=sglang"),
]


@pytest.fixture(autouse=True)
def no_process_group(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a process group was started before the configuration was rejected")

    monkeypatch.setattr(dist, "init_process_group", refuse)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)


@pytest.mark.parametrize("overrides,field,fix", ROWS, ids=[" ".join(r[0]) for r in ROWS])
def test_invalid_config_fails_before_process_groups_naming_field_and_fix(overrides, field, fix, tmp_path):
    with pytest.raises(ValueError) as err:  # ConfigError is a ValueError
        main(["train", "--config", TINY, f"run.output_dir={tmp_path}", *overrides])
    msg = str(err.value)
    assert field in msg and fix in msg, msg


def test_layout_that_cannot_tile_the_world_fails_before_process_groups(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")   # 3 trainer ranks + 1 engine rank
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    with pytest.raises(ValueError, match=r"trainer.tensor_parallel\*trainer.pipeline_parallel \(2\) must divide "
                                         r"the number of trainer ranks \(3\); change the layout or the process count"):
        main(["train", "--config", TINY, "run.output_dir=/nonexistent/never-written", "trainer.tensor_parallel=2",
              "rollout.placement=disaggregated"])


def test_missing_config_file_names_the_fix():
    with pytest.raises(ValueError, match="does not exist; pass --config configs/tiny_cpu.yaml"):
        main(["train", "--config", "/nonexistent.yaml"])


def test_doc_lists_every_row():
    doc = (ROOT / "docs/RELIABILITY.md").read_text()
    missing = [" ".join(o) for o, _, _ in ROWS if f"`{' '.join(o)}`" not in doc]
    assert not missing, f"docs/RELIABILITY.md lacks rows for {missing}"
