"""Unit tests of the SGLang adapter's own logic (payloads, parsing, buckets, quantization choice, sync,
TRACE refusal, restarts). Fakes here only record what the adapter sends; SGLang itself never runs."""
from __future__ import annotations

import base64
import json
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from megatron_qrl.config import apply_overrides, from_dict
from megatron_qrl.quant import pack_weight, payload_digest
from megatron_qrl.rollout import RolloutEngine, SamplingParams, WeightUpdateError
from megatron_qrl.rollout.sglang import (RoutingLayout, SGLangConfigError, SGLangEngine, SGLangResponseError,
                                         TraceUnsupportedError, UnsupportedQuantization, build_sglang_engine,
                                         choose_engine_quantization, generate_request, parse_generate_response)
from megatron_qrl.rollout.sglang.launch_args import launch_server_argv
from megatron_qrl.rollout.sglang.launcher import EngineStartError, ServerProcess
from megatron_qrl.rollout.sglang.payloads import decode_routed_experts, sglang_sampling_params
from megatron_qrl.rollout.sglang.wire import (BucketMeta, WireFormatError, WireTensor, flatten_bucket,
                                              modelopt_tensors, split_buckets, unflatten_bucket, wire_tensors)

FIXTURES = Path(__file__).parent / "fixtures" / "sglang"
LAYOUT = RoutingLayout(num_hidden_layers=2, topk=2, num_experts=4, moe_layers=(0, 1))


def cfg_with(*overrides):
    return from_dict(apply_overrides({}, ["rollout.engine=sglang", "trace.enabled=false",
                                          "rollout.sglang_model_path=/ckpt", *overrides]))


def fixture_response() -> dict:
    return json.loads((FIXTURES / "generate_response.json").read_text())


# ----------------------------------------------------------------------------------- payloads
def test_sampling_params_translate_to_sglang_conventions():
    sp = sglang_sampling_params(SamplingParams(temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=12))
    assert sp == {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "max_new_tokens": 12, "stop_token_ids": [],
                  "ignore_eos": True}
    sp = sglang_sampling_params(SamplingParams(top_k=5, stop_token_ids=(2, 3)), sampling_seed=11)
    assert sp["top_k"] == 5 and sp["stop_token_ids"] == [2, 3] and sp["ignore_eos"] is False
    assert sp["sampling_seed"] == 11


def test_generate_request_asks_for_output_logprobs_and_routing():
    body = generate_request([5, 6, 7], SamplingParams(max_new_tokens=4), return_routed_experts=True)
    assert body["input_ids"] == [5, 6, 7] and body["return_logprob"] is True
    assert body["logprob_start_len"] == -1 and body["return_routed_experts"] is True
    assert json.loads(json.dumps(body)) == body  # plain JSON


def test_parse_fixture_response_into_a_rollout_sample():
    s = parse_generate_response([5, 6, 7], fixture_response(), SamplingParams(stop_token_ids=(2,)), LAYOUT)
    assert s.tokens == [9, 2] and s.finish_reason == "stop" and s.weight_version == 7
    assert torch.equal(s.logprobs, torch.tensor([-0.25, -1.5]))
    assert s.routed_experts.dtype == torch.int16 and s.routed_experts.shape == (4, 2, 2) == (s.num_forwarded, 2, 2)
    r, l, j = torch.meshgrid(torch.arange(4), torch.arange(2), torch.arange(2), indexing="ij")
    assert torch.equal(s.routed_experts.long(), (r + 2 * l + j) % 4)


def test_routed_experts_keep_only_moe_layers():
    resp = fixture_response()
    ids = decode_routed_experts(resp["meta_info"]["routed_experts"], 4,
                                RoutingLayout(num_hidden_layers=2, topk=2, num_experts=4, moe_layers=(1,)))
    assert ids.shape == (4, 1, 2) and ids[0, 0].tolist() == [2, 3]


@pytest.mark.parametrize("mutate,match", [
    (lambda r: r["meta_info"].update(finish_reason={"type": "abort", "message": "oom", "status_code": 500}), "aborted"),
    (lambda r: r["meta_info"].update(finish_reason={"type": "stop", "matched": "NaN happened"}), "NaN"),
    (lambda r: r["meta_info"].update(finish_reason=None), "unfinished"),
    (lambda r: r["meta_info"]["output_token_logprobs"].pop(), "output_token_logprobs for 2 output ids"),
    (lambda r: r["meta_info"]["output_token_logprobs"][0].__setitem__(1, 4), "does not score output id 9"),
    (lambda r: r["meta_info"].pop("routed_experts"), "--enable-return-routed-experts"),
    (lambda r: r["meta_info"].update(routed_experts=base64.b64encode(b"\0" * 12).decode()), "expected int32"),
    (lambda r: r["meta_info"].update(routed_experts="%%%"), "not base64"),
    (lambda r: r.pop("output_ids"), "not a generate result"),
])
def test_parse_refuses_misaligned_or_failed_responses(mutate, match):
    resp = fixture_response()
    mutate(resp)
    with pytest.raises(SGLangResponseError, match=match):
        parse_generate_response([5, 6, 7], resp, SamplingParams(stop_token_ids=(2,)), LAYOUT)


def test_expert_ids_out_of_range_are_refused():
    ids = torch.full((4, 2, 2), 9, dtype=torch.int32)
    with pytest.raises(SGLangResponseError, match="outside"):
        decode_routed_experts(base64.b64encode(ids.numpy().tobytes()).decode(), 4, LAYOUT)


# ------------------------------------------------------------------------------------ wire / buckets
def test_fp4_weight_travels_as_modelopt_tensors_of_the_codec_bytes():
    w = torch.randn(16, 64)
    fp4 = pack_weight(w, "nvfp4")
    parts = modelopt_tensors("model.layers.0.mlp.experts.3.up_proj.weight", fp4, input_scale=torch.tensor(0.5))
    by_name = {p.name.rsplit(".", 1)[1]: p for p in parts}
    assert [p.name for p in parts] == [f"model.layers.0.mlp.experts.3.up_proj.{s}"
                                       for s in ("weight", "weight_scale", "weight_scale_2", "input_scale")]
    assert by_name["weight"].tensor.dtype == torch.uint8 and by_name["weight"].tensor.shape == (16, 32)
    assert torch.equal(by_name["weight"].tensor, fp4.packed)
    scale = by_name["weight_scale"].tensor
    assert scale.dtype == torch.float8_e4m3fn and scale.shape == (16, 4) and torch.equal(scale.view(torch.uint8),
                                                                                     fp4.scales.view(torch.uint8))
    assert by_name["weight_scale_2"].tensor.shape == () and by_name["weight_scale_2"].dtype_name == "float32"
    assert by_name["weight_scale"].dtype_name == "float8_e4m3fn" and hasattr(torch, "float8_e4m3fn")


def test_mxfp4_and_misnamed_payloads_are_refused():
    with pytest.raises(WireFormatError, match="nvfp4"):
        modelopt_tensors("a.weight", pack_weight(torch.randn(4, 64), "mxfp4"))
    with pytest.raises(WireFormatError, match="'.weight'"):
        modelopt_tensors("a.bias", pack_weight(torch.randn(4, 64), "nvfp4"))


def test_buckets_respect_the_size_keep_order_and_isolate_big_tensors():
    ts = [WireTensor(f"t{i}", torch.zeros(n, dtype=torch.uint8)) for i, n in enumerate([40, 30, 50, 200, 10, 10])]
    buckets = split_buckets(ts, 100)
    assert [[t.name for t in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"]]
    assert [t for b in buckets for t in b] == ts
    assert all(sum(t.nbytes for t in b) <= 100 for b in buckets if len(b) > 1)
    with pytest.raises(ValueError):
        split_buckets(ts, 0)


def test_flattened_bucket_round_trips_mixed_dtypes():
    fp4 = pack_weight(torch.randn(8, 32), "nvfp4")
    bucket = wire_tensors({"x.weight": fp4, "n.weight": torch.randn(5, dtype=torch.bfloat16),
                           "e.weight": torch.randn(2, 3)})
    with pytest.raises(WireFormatError, match="aligned_order"):  # uint8 codes first would misalign the rest
        unflatten_bucket(flatten_bucket(bucket), BucketMeta.of(bucket))
    bucket = split_buckets(bucket, 1 << 20)[0]
    assert [t.tensor.element_size() for t in bucket] == [4, 4, 2, 1, 1]
    flat = flatten_bucket(bucket)
    assert flat.dtype == torch.uint8 and flat.numel() == sum(t.nbytes for t in bucket)
    back = unflatten_bucket(flat, BucketMeta.of(bucket))
    for a, b in zip(bucket, back):
        assert a.name == b.name and a.tensor.dtype == b.tensor.dtype and a.tensor.shape == b.tensor.shape
        assert torch.equal(a.tensor.view(torch.uint8) if a.tensor.dim() else a.tensor.reshape(1).view(torch.uint8),
                           b.tensor.view(torch.uint8) if b.tensor.dim() else b.tensor.reshape(1).view(torch.uint8))
    with pytest.raises(WireFormatError):
        unflatten_bucket(flat[:-1], BucketMeta.of(bucket))


def _broadcast_worker(rank, port, nbytes_holder):
    from megatron_qrl.rollout.sglang.update_group import (broadcast_bucket, close_update_group, open_update_group,
                                                          receive_bucket)

    pg = open_update_group("127.0.0.1", port, 2, rank=rank, backend="gloo", timeout_s=60)
    torch.manual_seed(0)
    bucket = wire_tensors({"x.weight": pack_weight(torch.randn(8, 32), "nvfp4"), "n.weight": torch.ones(3)})
    if rank == 0:
        broadcast_bucket(flatten_bucket(bucket), pg)
    else:  # mirrors the release's flattened-bucket receiver: empty uint8 of the total size, rebuilt from metadata
        meta = BucketMeta.of(bucket)
        got = unflatten_bucket(receive_bucket(sum(t.nbytes for t in bucket), pg), meta)
        assert [payload_digest(t.tensor) for t in got] == [payload_digest(t.tensor) for t in bucket]
    close_update_group(pg)


def test_update_group_broadcasts_a_bucket_between_two_processes():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    mp.start_processes(_broadcast_worker, args=(port, None), nprocs=2, start_method="fork")


# ---------------------------------------------------------------------------------- quantization
@pytest.mark.parametrize("cap,weights,scheme,quant,run", [
    ((10, 0), "nvfp4", "w4a4", "modelopt_fp4", "w4a4"),
    ((12, 0), "nvfp4", "w4a4", "modelopt_fp4", "w4a4"),
    ((10, 0), "nvfp4", "w4a16", "modelopt_fp4", "w4a16"),
    ((9, 0), "nvfp4", "w4a16", "modelopt_fp4", "w4a16"),
    (8.0, "nvfp4", "w4a16", "modelopt_fp4", "w4a16"),
    ((9, 0), "mxfp4", "w4a16", "mxfp4", "w4a16"),
    ((9, 0), "bf16", "w4a4", None, "w16a16"),
    ((7, 5), "bf16", "w4a16", None, "w16a16"),
])
def test_quantization_by_compute_capability(cap, weights, scheme, quant, run):
    q = choose_engine_quantization(cap, weights, scheme)
    assert (q.quantization, q.scheme) == (quant, run)
    if run == "w4a16" and weights == "nvfp4":
        assert q.server_args == {"fp4_gemm_runner_backend": "marlin", "moe_runner_backend": "marlin"}


@pytest.mark.parametrize("cap,weights,scheme,match", [
    ((9, 0), "nvfp4", "w4a4", "Blackwell"),
    ((10, 0), "mxfp4", "w4a4", "no MXFP4 W4A4"),
    ((7, 5), "nvfp4", "w4a16", ">= 8.0"),
])
def test_impossible_quantizations_are_refused_with_the_fix(cap, weights, scheme, match):
    with pytest.raises(UnsupportedQuantization, match=match):
        choose_engine_quantization(cap, weights, scheme)


def test_launch_argv_spells_booleans_as_flags():
    argv = launch_server_argv({"model_path": "/m", "enable_return_routed_experts": True, "enable_memory_saver": False,
                               "fp4_gemm_runner_backend": "marlin", "quantization": None}, "0.0.0.0", 30001, "py")
    assert argv == ["py", "-m", "sglang.launch_server", "--model-path", "/m", "--enable-return-routed-experts",
                    "--fp4-gemm-backend", "marlin", "--host", "0.0.0.0", "--port", "30001"]


# ------------------------------------------------------------------------------------ the engine
class FakeBackend:
    """Records what SGLangEngine asks of a backend; answers with the fixture. Not SGLang."""

    reports_version = True

    def __init__(self, versions_ok=True):
        self.synced, self.generated, self.released, self.versions_ok = [], [], 0, versions_ok
        self.reported_version = "7"
        self.restart_next = False

    def generate(self, requests):
        self.generated.append(requests)
        out = []
        for body in requests:
            r = fixture_response()
            r["meta_info"]["weight_version"] = self.reported_version
            r["meta_info"]["routed_experts"] = base64.b64encode(
                torch.zeros(len(body["input_ids"]) + 1, 4, 2, dtype=torch.int32).numpy().tobytes()).decode()
            out.append(r)
        return out

    def sync(self, buckets, version, reprocess=False):
        self.synced.append((buckets, version))
        self.reprocess = reprocess

    def audit(self, version):
        return {"weight_version_ok": self.versions_ok, "weight_versions": {"http://h": str(version)}}

    def release(self):
        self.released += 1

    def resume(self):
        self.released -= 1

    def ensure_alive(self):
        restarted, self.restart_next = self.restart_next, False
        return restarted

    def status(self):
        return {"placement": "fake"}

    def shutdown(self):
        pass


def make_engine(backend=None, *overrides):
    cfg = cfg_with("rollout.weight_sync_bucket_mb=0.001", *overrides)
    return SGLangEngine(cfg, backend or FakeBackend(), routing=RoutingLayout.from_model_config(cfg.model))


def update(seed=0):
    torch.manual_seed(seed)
    weights = {"model.layers.0.mlp.experts.0.down_proj.weight": pack_weight(torch.randn(32, 64), "nvfp4"),
               "model.norm.weight": torch.randn(64)}
    return weights, {n: payload_digest(p) for n, p in weights.items()}


def test_engine_satisfies_the_rollout_protocol_and_syncs_in_buckets():
    backend = FakeBackend()
    engine = make_engine(backend)
    assert isinstance(engine, RolloutEngine)
    weights, hashes = update()
    engine.update_weights(weights, 7, hashes)
    buckets, version = backend.synced[0]
    assert version == 7 and len(buckets) > 1  # 1 KiB buckets
    assert backend.reprocess  # an FP4 payload: the backend frames the update with the FP4 reload loaders
    names = sorted(t.name for b in buckets for t in b)
    assert names == ["model.layers.0.mlp.experts.0.down_proj." + s for s in ("weight", "weight_scale",
                                                                             "weight_scale_2")] + ["model.norm.weight"]
    assert engine.version == 7 and engine.digests == hashes and engine.last_audit["weight_version_ok"]
    samples = engine.generate([[5, 6, 7], [1, 2, 3]], SamplingParams(stop_token_ids=(2,)))
    assert [s.weight_version for s in samples] == [7, 7] and samples[0].routed_experts.shape == (4, 4, 2)
    assert engine.health()["weight_version"] == 7


def test_a_bad_digest_refuses_the_whole_update_before_anything_is_sent():
    backend = FakeBackend()
    engine = make_engine(backend)
    weights, hashes = update()
    hashes["model.norm.weight"] = payload_digest(torch.zeros(64))
    with pytest.raises(WeightUpdateError, match="digest mismatch"):
        engine.update_weights(weights, 1, hashes)
    with pytest.raises(WeightUpdateError, match="no digest"):
        engine.update_weights(weights, 1, {})
    weights["x.weight"] = pack_weight(torch.randn(4, 64), "mxfp4")
    with pytest.raises(WeightUpdateError, match="nvfp4"):
        engine.update_weights(weights, 1, {n: payload_digest(p) for n, p in weights.items()})
    assert backend.synced == [] and engine.version == -1 and engine.stats["refused_updates"] == 3


def test_audit_failure_and_stale_samples_are_errors():
    engine = make_engine(FakeBackend(versions_ok=False))
    with pytest.raises(WeightUpdateError, match="audit"):
        engine.update_weights(*update()[:1], 3, update()[1])
    backend = FakeBackend()
    engine = make_engine(backend)
    engine.update_weights(update()[0], 8, update()[1])
    with pytest.raises(SGLangResponseError, match="weight version 7"):
        engine.generate([[5, 6, 7]], SamplingParams())


def test_restart_makes_weights_stale_until_the_next_sync():
    backend = FakeBackend()
    engine = make_engine(backend)
    engine.update_weights(update()[0], 7, update()[1])
    backend.restart_next = True
    with pytest.raises(RuntimeError, match="call update_weights"):
        engine.generate([[5, 6, 7]], SamplingParams())
    engine.update_weights(update()[0], 7, update()[1])
    assert engine.generate([[5, 6, 7]], SamplingParams())[0].weight_version == 7
    assert engine.stats["engine_restarts"] == 1


def test_release_blocks_generation_and_updates_until_resume():
    backend = FakeBackend()
    engine = make_engine(backend)
    engine.release_memory()
    engine.release_memory()
    assert backend.released == 1 and engine.health()["memory"] == "released"
    with pytest.raises(RuntimeError, match="resume_memory"):
        engine.generate([[1]], SamplingParams())
    with pytest.raises(WeightUpdateError, match="resume_memory"):
        engine.update_weights(update()[0], 1, update()[1])
    engine.resume_memory()
    assert backend.released == 0


def test_trace_is_refused_with_an_explanation():
    cfg = from_dict(apply_overrides({}, ["rollout.engine=embedded"]))
    assert cfg.trace.enabled
    with pytest.raises(TraceUnsupportedError, match="trace.enabled=false"):
        SGLangEngine(cfg, FakeBackend())
    with pytest.raises(TraceUnsupportedError, match="fused kernels"):
        build_sglang_engine(cfg, capability=(10, 0))


def test_build_names_the_missing_settings():
    cfg = from_dict(apply_overrides({}, ["rollout.engine=sglang", "trace.enabled=false"]))
    with pytest.raises(SGLangConfigError, match="rollout.sglang_model_path"):
        build_sglang_engine(cfg, capability=(10, 0))
    with pytest.raises(SGLangConfigError, match="rollout.sglang_server_urls"):
        build_sglang_engine(cfg_with("rollout.placement=disaggregated"), capability=(10, 0))
    with pytest.raises(UnsupportedQuantization, match="w4a16"):
        build_sglang_engine(cfg_with(), capability=(9, 0))  # default scheme w4a4 on Hopper


def test_the_adapter_imports_and_builds_without_sglang_installed():
    import importlib.util

    assert importlib.util.find_spec("sglang") is None  # this environment has no SGLang at all
    engine = build_sglang_engine(cfg_with(), capability=(10, 0))  # colocated: the Engine is built lazily
    assert "sglang" not in sys.modules and engine.backend.status()["started"] is False


# ---------------------------------------------------------------------------------- server process
def test_server_process_restarts_a_dead_server_a_bounded_number_of_times(tmp_path):
    health = {"ok": True}
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    p = ServerProcess(argv, lambda: health["ok"], tmp_path / "s.log", max_restarts=1, startup_timeout_s=20,
                      poll_s=0.05)
    p.start()
    try:
        assert p.ensure_alive() is False
        first = p.proc.pid
        p.proc.kill()
        p.proc.wait()
        assert p.ensure_alive() is True and p.proc.pid != first and p.restarts == 1
        p.proc.kill()
        p.proc.wait()
        with pytest.raises(EngineStartError, match="already restarted 1"):
            p.ensure_alive()
    finally:
        p.stop()


def test_server_process_reports_a_crash_during_startup(tmp_path):
    p = ServerProcess([sys.executable, "-c", "raise SystemExit(3)"], lambda: False, tmp_path / "s.log",
                      startup_timeout_s=20, poll_s=0.05)
    with pytest.raises(EngineStartError, match="exited with code 3"):
        p.start()


def test_the_gpu_smoke_script_parses_its_arguments():
    import subprocess

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "tools/sglang_smoke.py", "--help"], cwd=root, capture_output=True, text=True)
    assert r.returncode == 0 and "--model-path" in r.stdout and "--num-layers" in r.stdout, r.stderr


def test_the_smoke_script_syncs_whole_layers_of_the_checkpoint(tmp_path):
    import importlib.util

    from safetensors.torch import save_file

    spec = importlib.util.spec_from_file_location("sglang_smoke", Path(__file__).resolve().parents[1] / "tools"
                                                  / "sglang_smoke.py")
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    tensors = {}
    for layer in (0, 1):
        for base in ("self_attn.q_proj", "self_attn.k_proj", "mlp.experts.0.down_proj", "mlp.experts.1.up_proj"):
            b = f"model.layers.{layer}.{base}"
            tensors.update({b + ".weight": torch.zeros(64, 16, dtype=torch.uint8),
                            b + ".weight_scale": torch.zeros(64, 2, dtype=torch.float8_e4m3fn),
                            b + ".weight_scale_2": torch.ones(())})
        tensors[f"model.layers.{layer}.input_layernorm.weight"] = torch.ones(32)
    save_file(dict(list(tensors.items())[:20]), str(tmp_path / "model-1.safetensors"))  # layers span two shards
    save_file(dict(list(tensors.items())[20:]), str(tmp_path / "model-2.safetensors"))
    picked = smoke.checkpoint_fp4_layers(tmp_path, 1)
    assert sorted(picked) == sorted(f"model.layers.0.{b}.weight" for b in (
        "self_attn.q_proj", "self_attn.k_proj", "mlp.experts.0.down_proj", "mlp.experts.1.up_proj"))
    assert len(smoke.checkpoint_fp4_layers(tmp_path, 2)) == 8


def test_disaggregated_audit_compares_versions_and_checksums_across_servers():
    from megatron_qrl.rollout.sglang.disaggregated import ServerBackend
    from megatron_qrl.rollout.sglang.server_client import ServerClient

    class Transport:  # per-server answers; records nothing SGLang-specific
        def __init__(self, sums):
            self.sums = sums

        def request(self, method, url, body, timeout):
            host = url.split("/")[2]
            if url.endswith("/model_info"):
                return {"weight_version": "4"}
            return {"success": True, "per_engine_checksum": self.sums[host]}

    def backend(sums):
        t = Transport(sums)
        return ServerBackend([ServerClient(f"http://{h}", t) for h in sums], group_backend="gloo")

    ok = backend({"a:1": "x", "b:1": "x"}).audit(4)
    assert ok["weight_version_ok"] and ok["checksums_agree"]
    engine = make_engine(backend({"a:1": "x", "b:1": "y"}))
    engine.backend.sync = lambda buckets, version, reprocess=False: None  # no update group: the audit is under test
    with pytest.raises(WeightUpdateError, match="different weights"):
        engine.update_weights(update()[0], 4, update()[1])


def test_only_updates_with_fp4_payloads_ask_for_reprocessing():
    backend = FakeBackend()
    engine = make_engine(backend)
    norm = {"model.norm.weight": torch.randn(64)}
    engine.update_weights(norm, 1, {n: payload_digest(p) for n, p in norm.items()})
    assert backend.reprocess is False


class FramingEngine:
    """Records Engine.update_weights_from_tensor calls. Not SGLang."""

    def __init__(self, **kw):
        self.calls = []

    def update_weights_from_tensor(self, named_tensors, load_format, flush_cache):
        self.calls.append((len(named_tensors), load_format, flush_cache))
        return True, "Success"


def test_colocated_fp4_sync_is_framed_by_the_reload_loaders_and_flushes_after_the_end():
    from megatron_qrl.rollout.sglang.colocated import ColocatedBackend
    from megatron_qrl.rollout.sglang.custom_loader import BEGIN_FP4_UPDATE, END_FP4_UPDATE
    from megatron_qrl.rollout.sglang.wire import split_buckets, wire_tensors

    backend = ColocatedBackend({}, engine_factory=FramingEngine, device="cpu")
    buckets = split_buckets(wire_tensors(update()[0]), 64)
    backend.sync(buckets, 1, reprocess=True)
    calls = backend.engine.calls
    assert calls[0] == (0, BEGIN_FP4_UPDATE, False) and calls[-1] == (0, END_FP4_UPDATE, True)
    assert [c[1:] for c in calls[1:-1]] == [(None, False)] * len(buckets) and all(c[0] for c in calls[1:-1])
    backend.engine.calls.clear()
    backend.sync(buckets, 2, reprocess=False)
    assert [c[1:] for c in backend.engine.calls] == [(None, False)] * (len(buckets) - 1) + [(None, True)]


def test_disaggregated_fp4_sync_frames_every_server_and_reports_the_version_at_the_end(monkeypatch):
    import megatron_qrl.rollout.sglang.disaggregated as disagg
    from megatron_qrl.rollout.sglang.custom_loader import BEGIN_FP4_UPDATE, END_FP4_UPDATE
    from megatron_qrl.rollout.sglang.server_client import ServerClient
    from megatron_qrl.rollout.sglang.wire import split_buckets, wire_tensors

    calls = []

    class Transport:
        def request(self, method, url, body, timeout):
            calls.append((url.split("/", 3)[2], "/" + url.split("/", 3)[3], body))
            return {"success": True}

    monkeypatch.setattr(disagg, "open_update_group", lambda *a, **k: "group")
    monkeypatch.setattr(disagg, "broadcast_bucket", lambda flat, pg: None)
    servers = [ServerClient(f"http://h{i}:1", Transport()) for i in range(2)]
    backend = disagg.ServerBackend(servers, tp_size=2, group_backend="gloo")
    buckets = split_buckets(wire_tensors(update()[0]), 64)
    backend.sync(buckets, 5, reprocess=True)
    for host in ("h0:1", "h1:1"):
        mine = [(p, b) for h, p, b in calls if h == host and p != "/init_weights_update_group"]
        assert [p for p, _ in mine] == (["/update_weights_from_tensor"] + ["/update_weights_from_distributed"]
                                        * len(buckets) + ["/update_weights_from_tensor"])
        begin, end = mine[0][1], mine[-1][1]
        assert begin["load_format"] == BEGIN_FP4_UPDATE and not begin["flush_cache"] and "weight_version" not in begin
        assert end["load_format"] == END_FP4_UPDATE and end["flush_cache"] and end["weight_version"] == "5"
        assert len(begin["serialized_named_tensors"]) == 2  # one (empty) payload per TP rank
        assert not any(b["flush_cache"] or "weight_version" in b for _, b in mine[1:-1])


def test_nvfp4_engines_register_the_reload_loaders_and_external_servers_must_have_them():
    from megatron_qrl.rollout.sglang.custom_loader import CUSTOM_WEIGHT_LOADERS
    from megatron_qrl.rollout.sglang.launch_args import engine_server_args

    cfg = cfg_with()
    args = engine_server_args(cfg.rollout, choose_engine_quantization((9, 0), "nvfp4", "w4a16"), routed_experts=False,
                              colocated=False)
    assert args["custom_weight_loader"] == CUSTOM_WEIGHT_LOADERS
    argv = launch_server_argv(args, "h", 1)
    i = argv.index("--custom-weight-loader")
    assert argv[i + 1:i + 1 + len(CUSTOM_WEIGHT_LOADERS)] == CUSTOM_WEIGHT_LOADERS
    bf16 = engine_server_args(cfg.rollout, choose_engine_quantization((9, 0), "bf16", "w4a16"), routed_experts=False,
                              colocated=False)
    assert "custom_weight_loader" not in bf16

    class Transport:
        def __init__(self, loaders):
            self.loaders = loaders

        def request(self, method, url, body, timeout):
            return {"quantization": "modelopt_fp4", "custom_weight_loader": self.loaders}

    overrides = ["rollout.placement=disaggregated", "rollout.sglang_server_urls=[http://h:30000]",
                 "rollout.scheme=w4a16"]
    with pytest.raises(SGLangConfigError, match="--custom-weight-loader"):
        build_sglang_engine(cfg_with(*overrides), transport=Transport([]))
    assert build_sglang_engine(cfg_with(*overrides), transport=Transport(CUSTOM_WEIGHT_LOADERS)) is not None
