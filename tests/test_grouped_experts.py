"""Grouped FP4-QAT experts, device-side TRACE replay and device digests equal their references on CPU.

One launch (tests/dist/grouped_experts.py, one rank, fp32) measures every section; the tests assert on its
JSON. On CPU fp32 the grouped path and the per-expert reference compute the same function with the same
operations, so log-probs, losses and gradients agree exactly (the tolerances below only absorb a future
BLAS that blocks the grouped GEMM differently); tools/gpu_trainer.sh runs the same driver on an H200 in bf16.
"""
import json
from pathlib import Path

import pytest

from launch_ranks import run_ranks

DIST = Path(__file__).parent / "dist"
ATOL = 1e-5      # fp32 round-off, should a BLAS block the grouped GEMM differently
GRAD_RTOL = 1e-5


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    out = tmp_path_factory.mktemp("grouped_experts") / "result.json"
    run_ranks(1, DIST / "grouped_experts.py", out, "cpu", timeout=600)
    data = json.loads(out.read_text())
    errors = {k: v["error"] for k, v in data.items() if isinstance(v, dict) and "error" in v}
    assert data["summary"]["ok"], data["summary"]
    assert not errors, json.dumps({k: data[k].get("traceback") for k in errors}, indent=1)
    return data


def test_grouped_gemm_equals_the_per_expert_loop(res):
    g = res["gemm"]
    assert g["grouped_mm_available"]          # torch._grouped_mm runs forward and backward here
    for tag in ("align1_grouped", "align8_loop", "align8_grouped"):   # align 8: CUDA's padded group layout
        assert max(g[tag].values()) < 1e-6, (tag, g[tag])


def test_one_launch_over_all_experts_gives_each_experts_bytes(res):
    c = res["codec"]
    assert c["rows_nvfp4"] == 0.0 and c["rows_mxfp4"] == 0.0
    assert c["weights_nvfp4_bytes_equal"] and c["weights_mxfp4_bytes_equal"]


@pytest.mark.parametrize("case", ["qat_w4a4", "qat_w4a16", "qat_mxfp4", "qat_off", "qat_w4a4_padded"])
def test_grouped_experts_match_the_per_expert_reference(res, case):
    r = res["megatron"][case]
    assert r["classes"] == ["QATSequentialMLP", "QATGroupedMLP"] and r["grouped_mm"]
    assert r["logp"] < ATOL and r["loss_rel"] < 1e-6, r
    assert r["grad_rel"] < GRAD_RTOL and r["expert_grad_rel"] < GRAD_RTOL and r["n_grads"] > 10, r
    assert r["logp_after"] < ATOL and r["update_effect"] > 0.1, r   # the same update, and it really moves


def test_device_trace_replay_equals_the_host_reference(res):
    t = res["trace"]
    assert set(t["cache_sites"]) == {"fc1", "fc2", "qkv", "proj"} and t["cache_rows"] > 0
    host = t["sequential_host"]
    assert host["missing_rows"] > 0 and host["code_mismatch_before"] > 0   # completion and measurement exercised
    for k in ("grouped_device", "sequential_device"):
        d = t[k]
        assert d["logp_vs_host"] == 0.0
        for m in ("guided_rows", "missing_rows", "code_mismatch_before", "code_mismatch_after", "fallback", "elements"):
            assert d[m] == host[m], (k, m, d[m], host[m])


def test_replaying_the_per_expert_capture_leaves_no_code_mismatch(res):
    r = res["trace"]["replay_of_per_expert_capture"]
    assert r["code_mismatch_after"] == 0.0 and r["fallback"] == 0 and r["elements"] > 0


def test_device_digests(res):
    d = res["digests"]
    assert d["equals_reference"] and d["device_equals_cpu"] and d["every_flipped_bit_detected"]
    assert d["pack_weights_nvfp4_equal"] and d["pack_weights_mxfp4_equal"]
    assert d["payload_digests_nvfp4_device_equals_cpu"] and d["payload_digests_mxfp4_device_equals_cpu"]
    assert d["flipped_byte_refused"]


def test_fused_guided_kernel_counts_mismatches_like_the_reference(res):
    k = res["kernel"]
    assert k["values_diff"] == 0.0 and k["fallback"][0] == k["fallback"][1] > 0 and k["mismatch"][0] == k["mismatch"][1]


def test_weight_sync_reuses_the_qat_quantizers_bytes(res):
    s = res["sync"]
    assert s["reused"] == s["fp4_payloads"] > 0 and s["reused_bytes_equal_pack_weight"]
    assert s["digests_recomputed_equal"] and s["forward_reuses_sync_quantization"]


def test_batched_row_global_scales_equal_each_entrys():
    import torch

    from megatron_qrl.trace.device_guides import _row_global_scales
    from megatron_qrl.trace.synthetic import make_rollout

    cache = make_rollout(num_samples=6, seq_len=12, prompt_len=4).build()
    entries = list(cache.entries.values())
    assert len({e.index_width for e in entries}) > 1        # several index widths in one batch
    assert torch.equal(_row_global_scales(entries), torch.cat([e.row_global_scales() for e in entries]))


def test_device_guide_tables_hold_every_entry_in_key_order():
    import torch

    from megatron_qrl.trace.device_guides import _stack_tables
    from megatron_qrl.trace.synthetic import make_rollout

    cache = make_rollout(num_samples=6, seq_len=12, prompt_len=4).build()
    tables = _stack_tables(cache, torch.device("cpu"), 8)
    n = cache.n_tokens
    for (site, routed), t in tables.items():
        keys = [k for k in cache.keys() if (k.site, k.routed) == (site, routed)]
        want = torch.cat([(k.layer * 9 + k.expert + 1) * n + cache.rowset_tokens(cache.entry(k).rowset) for k in keys])
        assert torch.equal(t.keys, want) and bool((t.keys[1:] > t.keys[:-1]).all())      # searchsorted needs order
        assert torch.equal(t.bits[:-1], torch.cat([cache.entry(k).bits for k in keys]))  # + the zero "missing" row
        assert t.bits.shape[0] == t.missing_row + 1 and not t.bits[-1].any()


def test_grouped_linear_without_rows_gives_every_expert_a_zero_gradient():
    import torch

    from megatron_qrl.models.grouped_experts import GroupLayout, grouped_linear

    w = torch.randn(3, 8, 16, requires_grad=True)
    x = torch.zeros(0, 16, requires_grad=True)
    y = grouped_linear(x, w, GroupLayout.build(torch.zeros(3, dtype=torch.int64), 0, 3, x.device))
    y.sum().backward()
    assert y.shape == (0, 8) and w.grad is not None and not w.grad.any()
