"""The SGLang adapter against the pinned release's source (downloaded wheel, read with ast, never imported).

SGLang cannot run here, so these tests check the contract instead: every Engine method and keyword the
adapter calls, every HTTP route and body key it sends, every ServerArgs field / CLI flag it starts engines
with, every quantization name it picks, and the response fields it parses exist in sglang==SGLANG_VERSION.
The recording engine / transport below only capture what the adapter *would* send; they are not SGLang.
A failed download FAILS these tests (no skip): they are the only evidence the adapter matches SGLang.
"""
from __future__ import annotations

import ast
import base64
import itertools

import pytest
import torch

from megatron_qrl.config import apply_overrides, from_dict
from megatron_qrl.quant import pack_weight, payload_digest
from megatron_qrl.rollout import SamplingParams
from megatron_qrl.rollout.sglang import build_sglang_engine, choose_engine_quantization
from megatron_qrl.rollout.sglang.colocated import ColocatedBackend
from megatron_qrl.rollout.sglang.custom_loader import (CUSTOM_WEIGHT_LOADERS, END_FP4_UPDATE,
                                                       empty_serialized_named_tensors)
from megatron_qrl.rollout.sglang.disaggregated import FLATTENED_BUCKET
from megatron_qrl.rollout.sglang.launch_args import engine_server_args, launch_server_argv
from megatron_qrl.rollout.sglang.payloads import ORIGINAL_LOGPROB_ENV, generate_request
from megatron_qrl.rollout.sglang.quantization import UnsupportedQuantization
from megatron_qrl.rollout.sglang.release import SGLANG_VERSION
from megatron_qrl.rollout.sglang.server_client import ServerClient
from megatron_qrl.rollout.sglang.wire import BucketMeta, split_buckets, wire_tensors
from sglang_release_ast import class_node as _class, release, tree as _tree  # noqa: F401 (release: a fixture)


# ------------------------------------------------------------------------------------ ast readers
def class_fields(release, path, name) -> set[str]:
    """Annotated attributes of a dataclass / msgspec Struct body."""
    return {n.target.id for n in _class(_tree(release, path), name).body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def method_params(release, path, cls, method) -> set[str]:
    for n in _class(_tree(release, path), cls).body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == method:
            a = n.args
            return {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs} - {"self"}
    raise AssertionError(f"{cls}.{method} not found in {path}")


def module_literal(release, path, name):
    for n in _tree(release, path).body:
        if isinstance(n, (ast.Assign, ast.AnnAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return n.value
    raise AssertionError(f"{name} not assigned at module level in {path}")


def string_list(node) -> set[str]:
    return {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}


def _body_class(ann):
    """X from X, Annotated[X, Body()], Optional[X] and their nestings."""
    while isinstance(ann, ast.Subscript):
        ann = ann.slice.elts[0] if isinstance(ann.slice, ast.Tuple) else ann.slice
    return ann.id if isinstance(ann, ast.Name) else None


def http_routes(release) -> dict[str, tuple[set[str], str | None]]:
    """path -> (HTTP methods, name of the request-body class of the handler's `obj` parameter)."""
    routes = {}
    for fn in ast.walk(_tree(release, "srt/entrypoints/http_server.py")):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body_cls = next((_body_class(a.annotation) for a in fn.args.args if a.arg == "obj" and a.annotation), None)
        for dec in fn.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute) and dec.args
                    and isinstance(dec.args[0], ast.Constant)):
                continue
            kind = dec.func.attr
            if kind in ("get", "post", "put"):
                methods = {kind.upper()}
            elif kind == "api_route":
                kw = {k.arg: k.value for k in dec.keywords}
                methods = string_list(kw["methods"]) if "methods" in kw else {"GET"}
            else:
                continue
            routes[dec.args[0].value] = (methods, body_cls)
    return routes


def server_args_fields_and_flags(release) -> tuple[set[str], set[str]]:
    tree = _tree(release, "srt/server_args.py")
    fields, flags = set(), set()
    for n in _class(tree, "ServerArgs").body:
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            fields.add(n.target.id)
            flags.add("--" + n.target.id.replace("_", "-"))
            for call in ast.walk(n.annotation):  # Arg(cli_name=..., aliases=[...])
                if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "Arg":
                    for k in call.keywords:
                        if k.arg == "cli_name" and isinstance(k.value, ast.Constant):
                            flags.add(k.value.value)
                        if k.arg == "aliases" and isinstance(k.value, ast.List):
                            flags |= string_list(k.value)
    for call in ast.walk(tree):  # flags registered by hand with parser.add_argument("--x", ...)
        if isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "add_argument":
            flags |= {a.value for a in call.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
    return fields, flags


def registry_names(release) -> set[str]:
    tree = _tree(release, "srt/layers/quantization/__init__.py")
    names = {k.value for k in module_literal(release, "srt/layers/quantization/__init__.py",
                                             "BASE_QUANTIZATION_METHODS").keys}
    for call in ast.walk(tree):  # BASE_QUANTIZATION_METHODS.update({...}) under platform conditions
        if (isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "update"
                and getattr(call.func.value, "id", None) == "BASE_QUANTIZATION_METHODS"):
            names |= {k.value for k in call.args[0].keys}
    return names


def min_capability(release, cls) -> int:
    for n in _class(_tree(release, "srt/layers/quantization/" +
                         ("modelopt_quant.py" if cls.startswith("ModelOpt") else "mxfp4.py")), cls).body:
        if isinstance(n, ast.FunctionDef) and n.name == "get_min_capability":
            return next(r.value.value for r in ast.walk(n) if isinstance(r, ast.Return))
    raise AssertionError(f"{cls}.get_min_capability not found")


# ----------------------------------------------------------------------------------- recordings
def sglang_cfg(*overrides):
    return from_dict(apply_overrides({}, ["rollout.engine=sglang", "trace.enabled=false",
                                          "rollout.sglang_model_path=/ckpt/nvfp4", *overrides]))


def canned_result(prompt_len: int, layers: int = 4, topk: int = 2) -> dict:
    """A one-token result shaped like the release's (routed experts for the tiny default MoE config)."""
    ids = torch.zeros(prompt_len, layers, topk, dtype=torch.int32)  # P+T-1 rows with T=1
    return {"output_ids": [1], "meta_info": {"finish_reason": {"type": "length", "length": 1},
                                             "output_token_logprobs": [[-0.5, 1, None]], "weight_version": "default",
                                             "routed_experts": base64.b64encode(ids.numpy().tobytes()).decode()}}


class RecordingEngine:
    """Captures sglang.Engine calls (method, kwargs) the adapter makes; returns canned results. Not SGLang."""

    def __init__(self, **server_args):
        self.calls = [("__init__", server_args)]

    def __getattr__(self, method):
        def record(*args, **kwargs):
            assert not args, f"the adapter must call Engine.{method} with keywords only"
            self.calls.append((method, kwargs))
            if method == "generate":
                return [canned_result(len(p)) for p in kwargs["input_ids"]]
            return (True, "Success") if method.startswith("update_") else None
        return record


class RecordingTransport:
    """Captures (HTTP method, path, body); answers like the release's handlers would. Not SGLang."""

    def __init__(self):
        self.calls = []

    def request(self, method, url, body, timeout):
        path = "/" + url.split("/", 3)[3]
        self.calls.append((method, path, body))
        if path == "/generate":
            return canned_result(len(body["input_ids"]))
        if path == "/model_info":
            return {"weight_version": "3"}
        if path == "/server_info":
            return {"quantization": "modelopt_fp4", "custom_weight_loader": CUSTOM_WEIGHT_LOADERS}
        if path == "/weights_checker":
            return {"success": True, "message": "", "per_engine_checksum": "ab12"}
        return {"success": True, "message": "ok"}


def weight_update():
    w = torch.randn(32, 64)
    weights = {"model.layers.0.mlp.experts.0.down_proj.weight": pack_weight(w, "nvfp4"),
               "model.norm.weight": torch.ones(64, dtype=torch.bfloat16)}
    return weights


# ---------------------------------------------------------------------------------------- tests
def test_the_downloaded_wheel_is_the_pinned_release(release):
    assert release.version() == SGLANG_VERSION


def test_engine_methods_accept_the_keywords_the_colocated_adapter_passes(release):
    from megatron_qrl.rollout.sglang.engine import SGLangEngine

    cfg = sglang_cfg()
    holder = {}

    def factory(**kw):
        holder["engine"] = RecordingEngine(**kw)
        return holder["engine"]

    engine = build_sglang_engine(cfg, capability=(10, 0), engine_factory=factory)
    engine.backend.device = "cpu"
    assert isinstance(engine, SGLangEngine)
    engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=1))
    weights = weight_update()
    engine.update_weights(weights, 1, {n: payload_digest(p) for n, p in weights.items()})
    engine.release_memory()
    engine.resume_memory()
    calls = holder["engine"].calls
    assert [c[0] for c in calls] == ["__init__", "generate"] + ["update_weights_from_tensor"] * 3 + [
        "release_memory_occupation", "resume_memory_occupation"]  # FP4: begin, the bucket, end
    fields, _ = server_args_fields_and_flags(release)
    assert set(calls[0][1]) <= fields, set(calls[0][1]) - fields  # Engine(**kwargs) -> ServerArgs(**kwargs)
    for method, kwargs in calls[1:]:
        params = method_params(release, "srt/entrypoints/engine.py", "Engine", method)
        assert set(kwargs) <= params, f"Engine.{method} has no parameter(s) {set(kwargs) - params}"
    sampling_fields = class_fields(release, "srt/sampling/sampling_params.py", "SamplingParams")
    for sp in calls[1][1]["sampling_params"]:
        assert set(sp) <= sampling_fields


def test_engine_weight_sync_methods_exist_with_the_names_the_design_relies_on(release):
    expected = {
        "init_weights_update_group": {"master_address", "master_port", "rank_offset", "world_size", "group_name",
                                      "backend"},
        "update_weights_from_distributed": {"names", "dtypes", "shapes", "group_name", "flush_cache", "load_format"},
        "update_weights_from_tensor": {"named_tensors", "load_format", "flush_cache"},
        "release_memory_occupation": {"tags"}, "resume_memory_occupation": {"tags"},
        "generate": {"input_ids", "sampling_params", "return_logprob", "logprob_start_len", "return_routed_experts"},
        "async_generate": {"input_ids", "sampling_params", "return_logprob", "logprob_start_len",
                           "return_routed_experts"},
    }
    for method, names in expected.items():
        params = method_params(release, "srt/entrypoints/engine.py", "Engine", method)
        assert names <= params, f"Engine.{method} lacks {names - params}"


def test_http_routes_and_body_keys_exist_in_the_release(release):
    transport = RecordingTransport()
    engine = build_sglang_engine(sglang_cfg("rollout.placement=disaggregated",
                                            "rollout.sglang_server_urls=[http://h:30000]",
                                            "rollout.sglang_router_url=http://r:30010"), transport=transport)
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=1, top_k=5, stop_token_ids=(7,)))
    server = ServerClient("http://h:30000", transport)
    server.init_weights_update_group("10.0.0.1", 29600, 1, 2)
    bucket = split_buckets(wire_tensors(weight_update()), 1 << 20)[0]
    meta = BucketMeta.of(bucket)
    server.update_weights_from_distributed(meta.names, meta.dtypes, meta.shapes, flush_cache=True,
                                           weight_version="3", load_format=FLATTENED_BUCKET)
    server.update_weights_from_tensor(empty_serialized_named_tensors(1), load_format=END_FP4_UPDATE,
                                      flush_cache=True, weight_version="3")
    server.destroy_weights_update_group()
    server.release_memory_occupation()
    server.resume_memory_occupation()
    server.is_healthy(), server.model_info(), server.flush_cache(), server.weights_checksum()
    routes = http_routes(release)
    io_struct = "srt/managers/io_struct.py"
    checked = set()
    for method, path, body in transport.calls:
        assert path in routes, f"route {path} does not exist in sglang {SGLANG_VERSION}"
        methods, body_cls = routes[path]
        assert method in methods, f"{path} does not accept {method} ({methods})"
        if body:
            assert body_cls is not None, f"{path} takes no request body"
            fields = class_fields(release, io_struct, body_cls)
            assert set(body) <= fields, f"{body_cls} has no field(s) {set(body) - fields}"
        checked.add(path)
    assert {"/generate", "/server_info", "/init_weights_update_group", "/update_weights_from_distributed",
            "/update_weights_from_tensor",
            "/release_memory_occupation", "/resume_memory_occupation", "/health", "/model_info",
            "/weights_checker"} <= checked
    generate_body = next(b for m, p, b in transport.calls if p == "/generate")
    assert set(generate_body["sampling_params"]) <= class_fields(release, "srt/sampling/sampling_params.py",
                                                                 "SamplingParams")


def test_generate_fields_cover_deterministic_seed_and_routed_experts(release):
    body = generate_request([1], SamplingParams(), return_routed_experts=True, sampling_seed=3)
    assert set(body) <= class_fields(release, "srt/managers/io_struct.py", "GenerateReqInput")
    assert set(body["sampling_params"]) <= class_fields(release, "srt/sampling/sampling_params.py", "SamplingParams")
    src = release.read("srt/sampling/sampling_params.py")
    assert "TOP_K_ALL = 1 << 30" in src and "top_k must be -1 (disable)" in src  # we send -1 for "off"


def test_response_fields_the_parser_reads_are_produced_by_the_release(release):
    tm = release.read("srt/managers/tokenizer_manager.py")
    for key in ('"finish_reason"', '"weight_version"', 'meta_info["output_token_logprobs"]',
                'meta_info["routed_experts"]', '"output_ids"', '"meta_info"'):
        assert key in tm, f"tokenizer_manager.py no longer produces {key}"
    assert "(logprob, token_id, None)" in tm  # output_token_logprobs entries without text
    sb = release.read("srt/managers/schedule_batch.py")
    for literal in ('"type": "stop"', '"type": "length"', '"type": "abort"', 'matched="NaN happened"'):
        assert literal in sb
    assert "Stop position is included." in sb  # output_ids keep the stop token, as RolloutSample.tokens do


def test_routed_experts_are_int32_rows_per_forwarded_position_over_all_layers(release):
    fields, flags = server_args_fields_and_flags(release)
    assert "enable_return_routed_experts" in fields and "--enable-return-routed-experts" in flags
    assert "return_routed_experts" in class_fields(release, "srt/managers/io_struct.py", "GenerateReqInput")
    cap = release.read("srt/state_capturer/routed_experts.py")
    assert "num_hidden_layers" in cap and "num_experts_per_tok" in cap and "dtype=torch.int32" in cap
    assert "pybase64.b64decode" in cap and "dtype=np.int32" in cap
    base = release.read("srt/state_capturer/base.py")
    assert "[start_len : seqlen - 1]" in base  # rows = P+T-1 (start_len 0)


def test_original_logprob_switch_exists(release):
    assert f'get_bool_env_var("{ORIGINAL_LOGPROB_ENV}")' in release.read("srt/layers/sampler.py")


CAPABILITIES = [(8, 0), (8, 9), (9, 0), (10, 0), (12, 0)]


def test_every_quantization_choice_names_a_registered_method_and_valid_backends(release):
    registry = registry_names(release)
    qchoices = string_list(module_literal(release, "srt/server_args.py", "QUANTIZATION_CHOICES"))
    backends = {"fp4_gemm_runner_backend": string_list(module_literal(release, "srt/server_args.py",
                                                                      "FP4_GEMM_RUNNER_BACKEND_CHOICES")),
                "moe_runner_backend": string_list(module_literal(release, "srt/server_args.py",
                                                                 "MOE_RUNNER_BACKEND_CHOICES"))}
    fields, flags = server_args_fields_and_flags(release)
    seen = set()
    for cap, weights, scheme in itertools.product(CAPABILITIES, ("nvfp4", "mxfp4", "bf16"), ("w4a4", "w4a16")):
        try:
            q = choose_engine_quantization(cap, weights, scheme)
        except UnsupportedQuantization:
            continue
        if q.quantization is not None:
            assert q.quantization in registry and q.quantization in qchoices, q.quantization
            seen.add(q.quantization)
        for key, value in q.server_args.items():
            assert key in fields and value in backends[key], (key, value)
        argv = launch_server_argv(engine_server_args(sglang_cfg().rollout, q, routed_experts=True, colocated=False),
                                  "0.0.0.0", 30000)
        used = {a for a in argv if a.startswith("--")}
        assert used <= flags, f"launch_server has no flag(s) {used - flags}"
    assert seen == {"modelopt_fp4", "mxfp4"}


def test_fp4_hardware_requirements_match_the_release(release):
    assert min_capability(release, "ModelOptFp4Config") == 80  # NVFP4 accepted from SM80 (Marlin)
    assert min_capability(release, "Mxfp4Config") == 80
    mq = release.read("srt/layers/quantization/modelopt_quant.py")
    assert "native dense GEMM backends require SM100+" in mq  # W4A4 dense GEMMs: Blackwell only
    assert "use_marlin_fallback = (8, 0) <= capability < (10, 0)" in mq  # fused MoE: Marlin below Blackwell
    sa = release.read("srt/server_args.py")
    assert "marlin on SM80-SM90" in sa  # --fp4-gemm-backend auto picks Marlin on Hopper
    with pytest.raises(UnsupportedQuantization, match="Blackwell"):
        choose_engine_quantization((9, 0), "nvfp4", "w4a4")


def test_weight_sync_wire_format_matches_the_release_receiver(release):
    mr = release.read("srt/model_executor/model_runner.py")
    assert 'if load_format == "flattened_bucket":' in mr and "_update_bucketed_weights_from_distributed" in mr
    assert "getattr(torch, dtype)" in mr  # our dtype names are torch attribute names
    assert "rank = rank_offset + self.tp_rank" in mr
    tb = release.read("srt/weight_sync/tensor_bucket.py")
    assert "tensor.flatten().view(torch.uint8)" in tb and "torch.cat(flattened_tensors, dim=0)" in tb
    common = release.read("srt/utils/common.py")
    assert "PrefixStore(group_name, store)" in common and "rendezvous(init_method, rank, world_size" in common
    mq = release.read("srt/layers/quantization/modelopt_quant.py")
    for name in ('"weight"', '"weight_scale"', '"weight_scale_2"', '"input_scale"'):
        assert f"layer.register_parameter({name}" in mq  # ModelOpt NVFP4 linear parameter names


def test_weights_checker_checksum_is_the_releases_hash_of_installed_weights(release):
    wc = release.read("srt/utils/weight_checker.py")
    assert 'elif action == "checksum":' in wc and "comparable.dequantize()" in wc
    assert 'action: str = "checksum"' in release.read("srt/managers/io_struct.py")
    assert 'body["per_engine_checksum"] = per_engine_checksum' in release.read("srt/entrypoints/http_server.py")
    assert "def check_weights" not in release.read("srt/entrypoints/engine.py")  # no in-process equivalent


def test_facts_behind_the_trace_refusal(release):
    init = release.read("srt/layers/quantization/__init__.py")
    assert "QUANTIZATION_METHODS = {**BASE_QUANTIZATION_METHODS}" in init  # a plain, mutable module dict
    assert "def add_quantization_method_choices(choices):" in release.read("srt/server_args.py")
    assert 'mp.set_start_method("spawn", force=True)' in release.read("srt/entrypoints/engine.py")


def test_colocated_backend_hands_tensors_over_in_buckets_and_flushes_once(release):
    calls = []

    class Eng:
        def update_weights_from_tensor(self, **kw):
            calls.append(kw)
            return True, "Success"

    backend = ColocatedBackend({}, engine_factory=lambda **kw: Eng(), device="cpu")
    buckets = split_buckets(wire_tensors(weight_update()), 64)
    backend.sync(buckets, 1)
    assert len(calls) == len(buckets) > 1
    assert [c["flush_cache"] for c in calls] == [False] * (len(buckets) - 1) + [True]
    assert set(calls[0]) <= method_params(release, "srt/entrypoints/engine.py", "Engine", "update_weights_from_tensor")
