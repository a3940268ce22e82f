"""`rollout.engine=sglang` inside the RL loop (launch/train.py's train(), in-process, one CPU rank).

SGLANG DOES NOT RUN HERE and nothing below counts as having run it. What stands in for SGLang records
what the adapter hands it: a fake in-process `sglang.Engine` (colocated; the adapter's real
ColocatedBackend drives it) and a fake HTTP transport plus a recorder in place of the NCCL broadcast
(disaggregated; the adapter's real ServerBackend drives them). Both answer generate calls with canned,
well-formed results. The point is the loop's side of the wiring: RunSetup builds the adapter, every sync
sends the trainer's FP4 bytes under the Hugging Face names and shapes the served Qwen3-MoE expects, in
buckets, with digests that match what arrives, AQN folded into the norms, and the loop trains on the
samples that come back.
"""
from __future__ import annotations

import base64

import pytest
import torch

from megatron_qrl.config import load_config
from megatron_qrl.convert import qwen3_moe
from megatron_qrl.data import CharTokenizer
from megatron_qrl.rollout.sglang.custom_loader import BEGIN_FP4_UPDATE, CUSTOM_WEIGHT_LOADERS, END_FP4_UPDATE
from megatron_qrl.quant import FP4Tensor, payload_digest

OVERRIDES = ["rollout.engine=sglang", "trace.enabled=false", "rollout.sglang_model_path=/ckpt/tiny-nvfp4",
             "run.sft_steps=0", "run.total_steps=2", "run.eval_every=2", "run.checkpoint_every=0",
             "data.eval_size=4", "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=8",
             "rollout.weight_sync_bucket_mb=0.25", "aqn.enabled=true", "aqn.sigma_start=0.05",
             "aqn.sigma_end=0.01", "run.wandb_mode=disabled", "trainer.micro_batch_size=8"]
EOS = CharTokenizer().eos_id


def canned_result(prompt: list[int], version: str, layers: int, topk: int, experts: int) -> dict:
    """A finished generate result in the pinned release's shape; length varies with the prompt."""
    tokens = [CharTokenizer().encode("7")[0]] * (len(prompt) % 3) + [EOS]
    rows = len(prompt) + len(tokens) - 1
    ids = (torch.arange(rows * layers * topk, dtype=torch.int32) % experts).reshape(rows, layers, topk)
    return {"output_ids": tokens,
            "meta_info": {"finish_reason": {"type": "stop", "matched": EOS},
                          "output_token_logprobs": [[-0.5, t, None] for t in tokens], "weight_version": version,
                          "routed_experts": base64.b64encode(ids.numpy().tobytes()).decode()}}


def run_loop(tmp_path, monkeypatch, overrides, adapter_options, after_build):
    """train(cfg) with build_sglang_engine given test-only options; returns (metrics, RunSetup, cfg)."""
    import megatron_qrl.rollout.sglang as sglang_pkg
    from megatron_qrl.launch.train import train
    from megatron_qrl.pipeline import RunSetup
    from megatron_qrl.platform.distributed import teardown

    cfg = load_config("configs/tiny_cpu.yaml", [f"run.output_dir={tmp_path}", *OVERRIDES, *overrides])
    real = sglang_pkg.build_sglang_engine

    def build(*args, **kwargs):
        engine = real(*args, **{**kwargs, **adapter_options})
        after_build(engine)
        return engine

    monkeypatch.setattr(sglang_pkg, "build_sglang_engine", build)
    captured = {}
    original = RunSetup.build.__func__
    monkeypatch.setattr(RunSetup, "build", classmethod(lambda cls, c: captured.setdefault("s", original(cls, c))))
    try:
        last = train(cfg)
    finally:
        teardown()
    return last, captured["s"], cfg


def expected_wire_names(cfg) -> dict:
    """HF name -> dtype of every tensor one sync must send (routed experts in ModelOpt NVFP4, rest as is)."""
    out = {}
    for rule in qwen3_moe.tensor_rules(cfg.model):
        for name in rule.hf:
            if ".mlp.experts." in name:   # quant.targets=routed_experts: the FP4 linears
                base = name.removesuffix(".weight")
                out.update({f"{base}.weight": torch.uint8, f"{base}.weight_scale": torch.float8_e4m3fn,
                            f"{base}.weight_scale_2": torch.float32})
            else:
                out[name] = torch.float32
    return out


def check_bytes_against_digests(cfg, received: dict, digests: dict) -> None:
    """Rebuild every Megatron payload from the HF tensors that arrived; its digest must be the one sent."""
    m = cfg.model
    for rule in qwen3_moe.tensor_rules(m):
        if rule.hf[0] + "_scale" in received:
            parts = [received[n] for n in rule.hf]
            scales = [received[n.removesuffix(".weight") + ".weight_scale"].view(torch.uint8) for n in rule.hf]
            g = [received[n.removesuffix(".weight") + ".weight_scale_2"] for n in rule.hf]
            assert all(torch.equal(x, g[0]) for x in g)
            payload = FP4Tensor("nvfp4", qwen3_moe.merge(rule, parts, m),
                                qwen3_moe.merge(rule, scales, m).view(torch.float8_e4m3fn), g[0])
        else:
            payload = qwen3_moe.merge(rule, [received[n] for n in rule.hf], m)
        assert payload_digest(payload) == digests[rule.mcore], rule.mcore


# ------------------------------------------------------------------------------------------- colocated
class FakeInProcessEngine:
    """Stands in for sglang.Engine: records calls, answers generate with canned results. Not SGLang."""

    def __init__(self, layers, topk, experts, **server_args):
        self.server_args, self.calls, self.syncs, self.prompts, self.frames = server_args, [], [[]], [], []
        self.shape = (layers, topk, experts)

    def generate(self, input_ids, sampling_params, return_logprob, logprob_start_len, return_routed_experts):
        self.calls.append("generate")
        assert return_logprob and logprob_start_len == -1 and return_routed_experts
        self.prompts.append([list(p) for p in input_ids])
        return [canned_result(p, "default", *self.shape) for p in input_ids]

    def update_weights_from_tensor(self, named_tensors, load_format, flush_cache):
        """Buckets (load_format None) go to syncs; the FP4 reload's framing calls (empty) to frames."""
        self.calls.append("update")
        if load_format is None:
            self.syncs[-1].append(([(n, t.clone()) for n, t in named_tensors], flush_cache))
        else:
            assert named_tensors == []
            self.frames.append((load_format, flush_cache))
        if flush_cache:
            self.syncs.append([])
        return True, "Success"

    def release_memory_occupation(self, tags):
        self.calls.append("release")

    def resume_memory_occupation(self, tags):
        self.calls.append("resume")

    def shutdown(self):
        self.calls.append("shutdown")


def test_colocated_loop_syncs_hf_named_fp4_buckets_and_trains_on_the_samples(tmp_path, monkeypatch):
    holder = {}

    def factory(**server_args):
        m = holder["cfg_model"]
        holder["engine"] = FakeInProcessEngine(m.num_layers, m.moe_router_topk, m.num_experts, **server_args)
        return holder["engine"]

    holder["cfg_model"] = load_config("configs/tiny_cpu.yaml", []).model
    last, s, cfg = run_loop(tmp_path, monkeypatch, [],
                            {"capability": (10, 0), "engine_factory": factory, "device": "cpu"}, lambda e: None)
    fake = holder["engine"]
    args = fake.server_args
    assert args["quantization"] == "modelopt_fp4" and args["enable_memory_saver"] and args["base_gpu_id"] == 0
    assert args["enable_return_routed_experts"] and args["model_path"] == "/ckpt/tiny-nvfp4"

    syncs = fake.syncs[:-1]
    assert len(syncs) == 3   # one full update per RL step, and the evaluation's after the last step (AQN off)
    assert args["custom_weight_loader"] == CUSTOM_WEIGHT_LOADERS
    # FP4 payloads: each update is framed by the reload loaders; the cache is flushed by the end call only
    assert fake.frames == [(BEGIN_FP4_UPDATE, False), (END_FP4_UPDATE, True)] * 3
    want = expected_wire_names(cfg)
    bucket_bytes = cfg.rollout.weight_sync_bucket_mb * 2 ** 20
    for buckets in syncs:
        assert len(buckets) > 1 and [f for _, f in buckets] == [False] * len(buckets)
        received = {n: t for bucket, _ in buckets for n, t in bucket}
        assert {n: t.dtype for n, t in received.items()} == want
        for bucket, _ in buckets:
            assert len(bucket) == 1 or sum(t.numel() * t.element_size() for _, t in bucket) <= bucket_bytes
        H, F = cfg.model.hidden_size, cfg.model.moe_ffn_hidden_size
        assert received["model.layers.3.mlp.experts.7.gate_proj.weight"].shape == (F, H // 2)
        assert received["model.layers.3.mlp.experts.7.down_proj.weight_scale"].shape == (H, F // 16)
        assert received["model.layers.0.self_attn.k_proj.weight"].shape == (cfg.model.num_query_groups
                                                                           * cfg.model.head_dim, H)
    check_bytes_against_digests(cfg, {n: t for bucket, _ in syncs[-1] for n, t in bucket}, s.engine.digests)
    assert s.engine.version == 1 and s.engine.stats["syncs"] == 3

    # the loop consumed the canned samples: 2 prompts x 4 per step, their lengths, the eval on the last step
    assert [len(p) for p in fake.prompts] == [8, 8, cfg.data.eval_size]
    lens = [len(p) % 3 + 1 for p in fake.prompts[1]]
    assert last["response/len_mean"] == pytest.approx(sum(lens) / len(lens))
    assert last["sync/hash_ok"] == 1.0 and last["sync/buckets"] == len(syncs[-1])
    assert "eval/accuracy" in last and torch.isfinite(torch.tensor(last["train/loss"]))
    # the engine's memory is given back for every trainer turn and taken again before the next sync/generate
    assert fake.calls.count("release") == 2 and fake.calls.count("resume") >= 2

    # AQN: the norms sent are the embedded engine's effective weights w + Z for the same step and seed
    from megatron_qrl.models import set_aqn_noise
    from megatron_qrl.models.aqn_norm import aqn_norms
    from megatron_qrl.pipeline.sync.sglang import add_aqn_noise
    from megatron_qrl.pipeline.sync import aqn_seed, local_payload, step_aqn_sigma, unwrap

    chunks = unwrap(s.trainer.model)
    sigma, seed = step_aqn_sigma(cfg, 1), aqn_seed(cfg.run.seed, 1)
    assert sigma > 0
    set_aqn_noise(chunks, sigma, generator=torch.Generator().manual_seed(seed))
    weights, hashes = local_payload(s.trainer, cfg)
    add_aqn_noise(weights, hashes, cfg, sigma, seed)
    names = {id(m): n for n, m in chunks[0].named_modules()}
    norms = aqn_norms(chunks)
    assert len(norms) == 2 * cfg.model.num_layers
    for norm in norms:
        name = names[id(norm)] + ".weight"
        assert torch.equal(weights[name], norm.effective_weight()) and hashes[name] == payload_digest(weights[name])


# --------------------------------------------------------------------------------------- disaggregated
class FakeServers:
    """Stands in for SGLang servers behind HTTP (answers like the release's handlers) and records the bytes the
    trainer would broadcast to them over NCCL. Not SGLang; no update group is formed."""

    def __init__(self, layers, topk, experts):
        self.calls, self.flats, self.version = [], [], "default"
        self.shape = (layers, topk, experts)

    def request(self, method, url, body, timeout):
        path = "/" + url.split("/", 3)[3]
        self.calls.append((path, body))
        if path == "/generate":
            return canned_result(body["input_ids"], self.version, *self.shape)
        if path in ("/update_weights_from_distributed", "/update_weights_from_tensor") and "weight_version" in body:
            self.version = body["weight_version"]
        if path == "/model_info":
            return {"weight_version": self.version}
        if path == "/server_info":
            return {"quantization": "modelopt_fp4", "custom_weight_loader": CUSTOM_WEIGHT_LOADERS}
        if path == "/weights_checker":
            return {"success": True, "per_engine_checksum": "same"}
        return {"success": True, "message": "ok"}


def test_disaggregated_loop_sends_buckets_to_the_servers_from_trainer_rank_0(tmp_path, monkeypatch):
    import megatron_qrl.rollout.sglang.disaggregated as disagg
    from megatron_qrl.rollout.sglang.wire import BucketMeta, unflatten_bucket

    m = load_config("configs/tiny_cpu.yaml", []).model
    servers = FakeServers(m.num_layers, m.moe_router_topk, m.num_experts)
    monkeypatch.setattr(disagg, "open_update_group", lambda *a, **k: "group")
    monkeypatch.setattr(disagg, "close_update_group", lambda pg: None)
    monkeypatch.setattr(disagg, "broadcast_bucket", lambda flat, pg: servers.flats.append(flat.clone()))

    def cpu_group(engine):
        engine.backend.group_backend = "gloo"     # tensors stay on the CPU; the broadcast itself is recorded

    last, s, cfg = run_loop(tmp_path, monkeypatch, ["rollout.placement=disaggregated",
                                                    "rollout.sglang_server_urls=[http://fake:30000]"],
                            {"transport": servers}, cpu_group)
    paths = [p for p, _ in servers.calls]
    assert paths.count("/init_weights_update_group") == 1
    init = next(b for p, b in servers.calls if p == "/init_weights_update_group")
    assert (init["rank_offset"], init["world_size"]) == (1, 2)
    updates = [b for p, b in servers.calls if p == "/update_weights_from_distributed"]
    assert len(updates) == len(servers.flats) and all(u["load_format"] == "flattened_bucket" for u in updates)
    assert not any(u["flush_cache"] or "weight_version" in u for u in updates)
    # FP4 payloads: every update is framed by the reload loaders; the end call flushes and carries the version:
    # step 0, step 1, and the evaluation after step 1's updates (same version, AQN off)
    frames = [(i, b) for i, (p, b) in enumerate(servers.calls) if p == "/update_weights_from_tensor"]
    assert [(b["load_format"], b["flush_cache"], b.get("weight_version")) for _, b in frames] == \
        [(BEGIN_FP4_UPDATE, False, None), (END_FP4_UPDATE, True, "0"), (BEGIN_FP4_UPDATE, False, None),
         (END_FP4_UPDATE, True, "1"), (BEGIN_FP4_UPDATE, False, None), (END_FP4_UPDATE, True, "1")]
    bucket_calls = [i for i, (p, _) in enumerate(servers.calls) if p == "/update_weights_from_distributed"]
    first_sync = [i for i in bucket_calls if frames[0][0] < i < frames[1][0]]
    assert len(first_sync) > 1 and not [i for i in bucket_calls if frames[1][0] < i < frames[2][0]]

    last_sync = [j for j, i in enumerate(bucket_calls) if frames[-2][0] < i < frames[-1][0]]
    received = {}
    for i in last_sync:
        meta = BucketMeta(updates[i]["names"], updates[i]["dtypes"], updates[i]["shapes"])
        received.update({t.name: t.tensor for t in unflatten_bucket(servers.flats[i], meta)})
    assert {n: t.dtype for n, t in received.items()} == expected_wire_names(cfg)
    check_bytes_against_digests(cfg, received, s.engine.digests)

    generates = [b for p, b in servers.calls if p == "/generate"]
    assert len(generates) == 2 * 8 + cfg.data.eval_size
    assert all(b["return_routed_experts"] and b["return_logprob"] for b in generates)
    assert paths.count("/model_info") == 3 and paths.count("/weights_checker") == 3   # post-sync audits
    assert last["sync/hash_ok"] == 1.0 and "eval/accuracy" in last
    assert s.engine.retained_update is None          # the payload is dropped for the trainer's turn


def test_a_crashed_colocated_engine_is_rebuilt_and_resynced_before_the_retry(tmp_path, monkeypatch):
    """engine_crash at step 1: the guard restarts the adapter's in-process Engine (a new fake from the factory)
    and the loop re-sends the step's weights to it before generating the batch again."""
    m = load_config("configs/tiny_cpu.yaml", []).model
    engines = []

    def factory(**server_args):
        engines.append(FakeInProcessEngine(m.num_layers, m.moe_router_topk, m.num_experts, **server_args))
        return engines[-1]

    monkeypatch.setenv("QRL_FAULT_INJECT", "engine_crash@1")
    last, s, cfg = run_loop(tmp_path, monkeypatch, ["run.eval_every=0"],
                            {"capability": (10, 0), "engine_factory": factory, "device": "cpu"}, lambda e: None)
    assert len(engines) == 2 and engines[0].calls[-1] == "shutdown"
    first, second = engines
    assert len(first.syncs[:-1]) == 2 and len(first.prompts) == 1      # step 0 generated; step 1 crashed
    assert second.calls[0] == "update" and second.calls.index("generate") > second.calls.index("update")
    assert len(second.syncs[:-1]) == 1 and len(second.prompts) == 1    # full re-sync, then the retried batch
    assert last["fault/engine_restarts"] == 1.0 and s.engine.version == 1 and s.engine.stats["engine_restarts"] == 1
