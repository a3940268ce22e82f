"""TRACE storage: the per-step budget planner and the host/disk store."""
import re

import pytest
import torch

from megatron_qrl.config import from_dict
from megatron_qrl.trace import CorruptCacheError, TraceBudgetError, TraceStore, plan
from megatron_qrl.trace.synthetic import make_rollout

from one_thread import one_intra_op_thread  # noqa: F401 (an autouse fixture)


def _cfg(**trace):
    return from_dict({"model": {"num_layers": 8, "hidden_size": 128, "moe_ffn_hidden_size": 128, "num_experts": 8,
                                "moe_router_topk": 2},
                      "trace": {"num_cached_layers": 8, **trace}})


def test_plan_error_names_the_layer_count_that_fits():
    tokens = 100_000
    per_layer = plan(_cfg(memory_budget_mb=10_000), tokens).bytes_per_layer
    budget_mb = 3.5 * per_layer / 2 ** 20
    with pytest.raises(TraceBudgetError) as err:
        plan(_cfg(memory_budget_mb=budget_mb), tokens)
    msg = str(err.value)
    fit = int(re.search(r"trace\.num_cached_layers=(\d+)", msg).group(1))
    assert fit == 3
    assert "trace.memory_budget_mb=" in msg and "trace.spill_dir" in msg and "8 cached layers" in msg
    ok = plan(_cfg(memory_budget_mb=budget_mb, num_cached_layers=fit), tokens)
    assert ok.tier == "host" and ok.bytes_per_step <= ok.budget_bytes
    with pytest.raises(TraceBudgetError):
        plan(_cfg(memory_budget_mb=budget_mb, num_cached_layers=fit + 1), tokens)


def test_plan_spills_when_a_spill_dir_is_set(tmp_path):
    p = plan(_cfg(memory_budget_mb=1, spill_dir=str(tmp_path)), 100_000)
    assert p.tier == "disk" and p.bytes_per_step > p.budget_bytes
    with pytest.raises(TraceBudgetError, match="not even one layer"):
        plan(_cfg(memory_budget_mb=0.01), 100_000)


def test_plan_estimate_matches_a_built_cache():
    ro = make_rollout(num_samples=16, seq_len=48, prompt_len=16, layers=(2, 3), routed_sites={"fc1": 64, "fc2": 32},
                      num_experts=8, topk=2)
    cache = ro.build()
    cfg = from_dict({"model": {"num_layers": 4, "hidden_size": 64, "moe_ffn_hidden_size": 32, "num_experts": 8,
                               "moe_router_topk": 2},
                     "rollout": {"max_new_tokens": ro.seq_len - ro.prompt_len}})
    assert cfg.cached_layers() == [2, 3]
    est = plan(cfg, ro.num_samples * ro.seq_len).bytes_per_step
    assert abs(est - cache.nbytes) / cache.nbytes < 0.10, (est, cache.nbytes)


def test_store_keeps_host_bytes_within_budget_and_spills(tmp_path):
    cache = make_rollout(num_samples=4, seq_len=12, prompt_len=4, layers=(1,)).build(weight_version=1, step=2)
    budget_mb = 1.5 * cache.nbytes / 2 ** 20
    store = TraceStore(budget_mb, spill_dir=str(tmp_path / "spill"))
    assert store.put("step2/a", cache) == "host"
    assert store.put("step2/b", cache) == "disk"
    assert store.host_bytes == cache.nbytes and store.disk_bytes == cache.nbytes
    assert store.get("step2/a").same_content(cache) and store.get("step2/b").same_content(cache)
    assert store.pop("step2/a").same_content(cache) and "step2/a" not in store
    path = next((tmp_path / "spill").glob("*.qrltrace"))
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptCacheError):
        store.get("step2/b")
    store.drop("step2/b")
    assert store.names() == [] and not list((tmp_path / "spill").glob("*.qrltrace"))
    tight = TraceStore(budget_mb)
    tight.put("a", cache)
    with pytest.raises(TraceBudgetError, match="trace.spill_dir"):
        tight.put("b", cache)
