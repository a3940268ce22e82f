"""The FP4 reload (rollout/sglang/{custom_loader,reprocess,fp4_layouts}.py) against the pinned release's source.

Like tests/test_sglang_contract.py: the pinned wheel is downloaded (never installed or imported) and its files are
parsed with `ast`. Established here for sglang==SGLANG_VERSION:
- the problem: every weight-update path calls `model.load_weights` and never `process_weights_after_loading`;
- the hook: `ServerArgs.custom_weight_loader` and how `update_weights_from_tensor` dispatches to it;
- which ModelOpt methods define `process_weights_after_loading`, which ones ModelOpt NVFP4 checkpoints get, and
  what those do to a layer's parameters (what fp4_layouts.py must rebuild and what it may keep);
- that every FP4 tensor our Megatron -> HF name map produces lands in a layer whose method the reload covers.
A failed download FAILS these tests (no skip).
"""
from __future__ import annotations

import ast
import importlib
import inspect

import pytest
import torch

from megatron_qrl.config import load_config
from megatron_qrl.convert import qwen3_moe
from megatron_qrl.rollout.sglang.custom_loader import CUSTOM_WEIGHT_LOADERS
from megatron_qrl.rollout.sglang.fp4_layouts import (LAYOUTS, MODELOPT_FP4_LINEAR, MODELOPT_NVFP4_FUSED_MOE,
                                                     UNSUPPORTED)
from sglang_release_ast import class_node, release, tree  # noqa: F401 (release: a fixture)

MODELOPT = "srt/layers/quantization/modelopt_quant.py"
MARLIN_FP4 = "srt/layers/quantization/marlin_utils_fp4.py"
MODEL_RUNNER = "srt/model_executor/model_runner.py"


# ------------------------------------------------------------------------------------------ ast readers
def function(node, name):
    found = [n for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name]
    assert found, f"function {name} not found"
    return found[0]


def methods_defining(t, method) -> set[str]:
    return {c.name for c in ast.walk(t) if isinstance(c, ast.ClassDef)
            and any(isinstance(f, ast.FunctionDef) and f.name == method for f in c.body)}


def called(node) -> set[str]:
    """Dotted names of everything called inside node: 'self.model.load_weights', 'dynamic_import', ..."""
    return {ast.unparse(c.func) for c in ast.walk(node) if isinstance(c, ast.Call)}


def params(fn) -> list[str]:
    a = fn.args
    return [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]


def rebound(fn, owner="layer") -> set[str]:
    """Attribute names of `owner` that fn assigns, deletes or rebinds through the release's helpers."""
    out = set()
    for n in ast.walk(fn):
        if isinstance(n, (ast.Assign, ast.Delete)):
            targets = n.targets
        elif isinstance(n, (ast.AugAssign, ast.AnnAssign)):
            targets = [n.target]
        else:
            targets = []
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr == "data":
                t = t.value
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == owner:
                out.add(t.attr)
        if isinstance(n, ast.Call) and ast.unparse(n.func) in ("copy_or_rebind_param", "alias_or_bind_derived_param",
                                                               "replace_parameter", "setattr"):
            if len(n.args) >= 2 and isinstance(n.args[1], ast.Constant):
                out.add(n.args[1].value)
        if isinstance(n, ast.Call) and ast.unparse(n.func) == "alias_or_bind_derived_param" and len(n.args) >= 3 \
                and isinstance(n.args[2], ast.Constant):
            out.add(n.args[2].value)
    return out


def registered(fn) -> set[str]:
    """Parameter names fn registers with layer.register_parameter("name", ...)."""
    return {c.args[0].value for c in ast.walk(fn) if isinstance(c, ast.Call)
            and ast.unparse(c.func) == "layer.register_parameter" and isinstance(c.args[0], ast.Constant)}


# -------------------------------------------------------------------------------------------- the problem
def test_every_update_path_loads_weights_and_never_reruns_post_load_processing(release):
    runner = class_node(tree(release, MODEL_RUNNER), "ModelRunner")
    for name in ("update_weights_from_distributed", "_update_bucketed_weights_from_distributed",
                 "update_weights_from_tensor", "_update_weights_from_flattened_bucket"):
        calls = called(function(runner, name))
        assert "self.model.load_weights" in calls or "self._update_bucketed_weights_from_distributed" in calls \
            or "self._update_weights_from_flattened_bucket" in calls, name
        assert not any("process_weights_after_loading" in c or "postprocess" in c for c in calls), name
    # only the from-disk path goes through the loader that re-processes every quantized layer afterwards
    assert "loader.load_weights_and_postprocess" in called(function(runner, "update_weights_from_disk"))
    loader = release.read("srt/model_loader/loader.py")
    assert "quant_method.process_weights_after_loading(module)" in loader


def test_the_marlin_path_replaces_parameters_so_a_second_load_cannot_reach_their_loaders(release):
    marlin = tree(release, MARLIN_FP4)
    src = release.read(MARLIN_FP4)
    assert {"weight", "weight_scale", "weight_global_scale"} <= rebound(function(marlin,
                                                                                "prepare_nvfp4_layer_for_marlin"))
    assert "layer.weight = torch.nn.Parameter(marlin_qweight, requires_grad=False)" in src
    assert "layer.w13_weight = torch.nn.Parameter(" in src and "layer.w2_weight = torch.nn.Parameter(" in src
    qwen = release.read("srt/models/qwen3_moe.py")
    assert "weight_loader = param.weight_loader" in qwen  # the model's loader looks the loader up on the param


# ------------------------------------------------------------------------------------------------ the hook
def test_the_custom_weight_loader_hook_has_the_name_and_call_the_loaders_rely_on(release):
    sa = class_node(tree(release, "srt/server_args.py"), "ServerArgs")
    field = next(n for n in sa.body if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") ==
                 "custom_weight_loader")
    assert "List[str]" in ast.unparse(field.annotation) and "nargs='*'" in ast.unparse(field.annotation)
    fn = function(class_node(tree(release, MODEL_RUNNER), "ModelRunner"), "update_weights_from_tensor")
    assert params(fn) == ["self", "named_tensors", "load_format"]
    src = ast.unparse(fn)
    assert "elif load_format in self.server_args.custom_weight_loader:" in src
    assert "custom_loader = dynamic_import(load_format)" in src and "custom_loader(self.model, named_tensors)" in src
    # the dispatch is reached for any load_format but "flattened_bucket", with the list as sent (here: empty)
    assert src.index("if load_format == 'flattened_bucket':") < src.index("custom_loader(self.model")
    imp = ast.unparse(function(tree(release, "srt/utils/common.py"), "dynamic_import"))
    assert "importlib.import_module(module_path)" in imp and "getattr(module, func_name)" in imp
    # update_weights_from_distributed has no such hook: hence the framing calls around its buckets
    assert "custom_weight_loader" not in ast.unparse(function(class_node(tree(release, MODEL_RUNNER), "ModelRunner"),
                                                              "update_weights_from_distributed"))
    assert "recv_req.serialized_named_tensors[self.tp_rank]" in release.read("srt/managers/tp_worker.py")
    # what the loaders call on the model: load_weights(list of (name, tensor)) for tensors sent with a framing call
    load = function(class_node(tree(release, "srt/models/qwen3_moe.py"), "Qwen3MoeForCausalLM"), "load_weights")
    assert params(load)[:2] == ["self", "weights"] and load.args.defaults  # is_mtp has a default
    common = release.read("srt/utils/common.py")
    assert "pybase64.b64decode(data, validate=True)" in common and "class SafeUnpickler" in common


def test_our_loader_names_resolve_the_way_dynamic_import_resolves_them():
    for dotted in CUSTOM_WEIGHT_LOADERS:
        module, name = dotted.rsplit(".", 1)
        fn = getattr(importlib.import_module(module), name)
        assert list(inspect.signature(fn).parameters) == ["model", "named_tensors"]


# ------------------------------------------------------------------------------------- the methods covered
def test_which_modelopt_methods_define_post_load_processing_and_which_nvfp4_checkpoints_get(release):
    t = tree(release, MODELOPT)
    defining = methods_defining(t, "process_weights_after_loading")
    assert defining == {"ModelOptFp8LinearMethod", "ModelOptFp8MoEMethod", "ModelOptFp4LinearMethod",
                        "ModelOptNvFp4A16LinearMethod", "ModelOptNvFp4FusedMoEMethod"}
    fp4 = {m for m in defining if "Fp4" in m}
    assert fp4 == set(LAYOUTS) | set(UNSUPPORTED)  # every FP4 method is either covered or refused by name
    get = ast.unparse(function(class_node(t, "ModelOptFp4Config"), "get_quant_method"))
    assert "Linear=ModelOptFp4LinearMethod" in get and "Moe=ModelOptNvFp4FusedMoEMethod" in get
    assert set(LAYOUTS) == {"ModelOptFp4LinearMethod", "ModelOptNvFp4FusedMoEMethod"}
    # our export writes quant_algo NVFP4 (not the mixed-precision W4A16_NVFP4 that selects NvFp4A16)
    from megatron_qrl.convert.nvfp4_export import hf_quant_config

    assert hf_quant_config([])["quantization"]["quant_algo"] == "NVFP4"
    mixed = ast.unparse(function(class_node(t, "ModelOptMixedPrecisionConfig"), "get_quant_method"))
    assert "return ModelOptNvFp4A16LinearMethod(self.nvfp4a16_config)" in mixed  # under quant_algo W4A16_NVFP4
    assert "W4A16_NVFP4" in mixed and "W4A16_NVFP4" not in get


def test_bf16_layers_need_no_reprocessing_on_nvidia_gpus(release):
    unquant = tree(release, "srt/layers/quantization/unquant.py")
    body = function(class_node(unquant, "UnquantizedLinearMethod"), "process_weights_after_loading").body
    assert len(body) == 1 and ast.unparse(body[0].test) == "_is_cpu and _is_cpu_amx_available"  # CPU AMX only
    assert "UnquantizedEmbeddingMethod" not in methods_defining(unquant, "process_weights_after_loading")


@pytest.mark.parametrize("layout", [MODELOPT_FP4_LINEAR, MODELOPT_NVFP4_FUSED_MOE], ids=lambda l: l.method)
def test_the_layout_is_what_create_weights_registers_and_processing_rewrites(release, layout):
    t = tree(release, MODELOPT)
    cls = class_node(t, layout.method)
    create = function(cls, "create_weights")
    assert set(layout.raw_slots) <= registered(create)
    # every registered parameter gets the same loader, so a read-only one that survives processing carries it
    for c in ast.walk(create):
        if isinstance(c, ast.Call) and ast.unparse(c.func) in ("ModelWeightParameter", "PerTensorScaleParameter",
                                                               "_make_per_tensor_scale_parameter"):
            assert any(k.arg == "weight_loader" and ast.unparse(k.value) == "weight_loader" for k in c.keywords)
    assert "weight_loader = extra_weight_attrs.get('weight_loader')" in ast.unparse(create)
    # the keywords we call create_weights with are its parameters (weight_loader goes to **extra_weight_attrs)
    layer = type("Layer", (), {a: 1 for a in ("input_size_per_partition", "logical_widths", "input_size",
                                              "output_size", "params_dtype", "num_local_experts", "hidden_size",
                                              "intermediate_size_per_partition")})()
    layer.logical_widths = [1]
    kwargs = layout.create_weights_kwargs(layer, print)
    assert set(kwargs) - {"weight_loader"} <= set(params(create)) and create.args.kwarg.arg == "extra_weight_attrs"
    # process_weights_after_loading(layer) is the only call the reload makes on the method besides create_weights
    assert params(function(cls, "process_weights_after_loading")) == ["self", "layer"]
    # what processing rebinds, on every backend branch and in the helpers it calls
    process = function(cls, "process_weights_after_loading")
    helpers = {"prepare_nvfp4_layer_for_marlin": MARLIN_FP4, "prepare_moe_nvfp4_layer_for_marlin": MARLIN_FP4,
               "align_fp4_moe_weights_for_flashinfer_trtllm": "srt/layers/moe/moe_runner/flashinfer_trtllm.py"}
    touched = rebound(process)
    for helper, path in helpers.items():
        if helper in called(process):
            touched |= rebound(function(tree(release, path), helper))
    assert not touched & set(layout.read_only), "a read-only slot is rewritten by processing"
    assert touched & set(layout.raw_slots) <= set(layout.rewritten)
    marlin = {"ModelOptFp4LinearMethod": "prepare_nvfp4_layer_for_marlin",
              "ModelOptNvFp4FusedMoEMethod": "prepare_moe_nvfp4_layer_for_marlin"}[layout.method]
    assert marlin in called(process)  # the Hopper path
    assert set(layout.complete) <= set(layout.rewritten)


def test_the_layer_attributes_the_create_weights_kwargs_read_are_set_by_the_release(release):
    linear = tree(release, "srt/layers/linear.py")
    init = ast.unparse(function(class_node(linear, "LinearBase"), "__init__"))
    assert "self.input_size = input_size" in init and "self.output_size = output_size" in init
    create = ast.unparse(function(class_node(tree(release, MODELOPT), "ModelOptFp4LinearMethod"), "create_weights"))
    for attr in ("logical_widths", "input_size_per_partition", "params_dtype"):
        assert f"layer.{attr} = " in create
    moe = release.read("srt/layers/moe/fused_moe_triton/layer.py")
    assert "self.hidden_size = hidden_size" in moe and "self.num_local_experts = " in moe
    assert "num_experts=self.num_local_experts" in moe
    moe_create = ast.unparse(function(class_node(tree(release, MODELOPT), "ModelOptNvFp4FusedMoEMethod"),
                                      "create_weights"))
    for attr in ("intermediate_size_per_partition", "params_dtype"):
        assert f"layer.{attr} = " in moe_create


# --------------------------------------------------------------------------- coverage of our name map
def sglang_module_of(hf_name: str, stacked: list[tuple], expert_prefixes: set[str]) -> tuple[str, str]:
    """(SGLang module attribute, parameter slot) the release's Qwen3-MoE load_weights writes hf_name into."""
    base, _, suffix = hf_name.rpartition(".")  # ...q_proj.weight_scale -> (..q_proj, weight_scale)
    if ".mlp.experts." in base:
        proj = base.rsplit(".", 1)[1]
        prefix = "experts.w2_" if proj == "down_proj" else "experts.w13_"
        assert prefix in expert_prefixes
        return "experts", prefix.split(".")[1] + suffix
    for param_name, shard_name, _ in stacked:
        if base.endswith(shard_name):
            return param_name, suffix
    return base.rsplit(".", 1)[1], suffix


def test_every_fp4_tensor_our_name_map_produces_lands_in_a_layer_the_reload_covers(release):
    from megatron_qrl.rollout.sglang.names import qwen3_moe_name_map
    from megatron_qrl.rollout.sglang.wire import wire_tensors
    from megatron_qrl.quant import pack_weight

    qwen = tree(release, "srt/models/qwen3_moe.py")
    load = function(class_node(qwen, "Qwen3MoeForCausalLM"), "load_weights")
    stacked = next(ast.literal_eval(n.value) for n in ast.walk(load) if isinstance(n, ast.Assign)
                   and ast.unparse(n.targets[0]) == "stacked_params_mapping")
    expert_prefixes = {c.value for c in ast.walk(function(tree(release, "srt/layers/moe/fused_moe_triton/layer.py"),
                                                          "make_expert_params_mapping"))
                       if isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value.startswith("experts.")}
    constructed = {ast.unparse(n.targets[0]).removeprefix("self."): ast.unparse(n.value.func)
                   for n in ast.walk(qwen) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
                   and any(k.arg == "quant_config" and ast.unparse(k.value) == "quant_config"
                           for k in n.value.keywords)}
    assert constructed["qkv_proj"] == "QKVParallelLinear" and constructed["o_proj"] == "RowParallelLinear"
    assert constructed["experts"] == "get_moe_impl_class(quant_config)"
    linear = tree(release, "srt/layers/linear.py")
    bases = {c.name: [ast.unparse(b) for b in c.bases] for c in ast.walk(linear) if isinstance(c, ast.ClassDef)}

    def is_linear_base(cls):
        return cls == "LinearBase" or any(is_linear_base(b) for b in bases.get(cls, []))

    impl = ast.unparse(function(tree(release, "srt/layers/moe/ep_moe/layer.py"), "get_moe_impl_class"))
    returned = {r.value.id for r in ast.walk(ast.parse(impl)) if isinstance(r, ast.Return)}
    assert returned <= {"FusedMoE", "DeepEPMoE"} and "class DeepEPMoE(FusedMoE):" in release.read(
        "srt/layers/moe/ep_moe/layer.py")
    method_of = {"linear": "ModelOptFp4LinearMethod", "moe": "ModelOptNvFp4FusedMoEMethod"}  # get_quant_method above

    for config in ("configs/tiny_cpu.yaml", "configs/single_h200.yaml"):
        m = load_config(config, []).model
        to_hf = qwen3_moe_name_map(m)
        seen = set()
        for rule in qwen3_moe.tensor_rules(m):
            if not rule.mcore.endswith(("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight",
                                        "linear_fc2.weight")):
                continue  # every linear quant.targets can quantize; norms, router, embeddings stay BF16
            if ".local_experts." in rule.mcore and not rule.mcore.split(".local_experts.")[1].startswith("0."):
                continue  # expert 0 stands for all
            shape = (sum(s[0] for s in qwen3_moe.hf_shapes(rule, m)), qwen3_moe.hf_shapes(rule, m)[0][1])
            fp4 = {n: p for n, p in to_hf(rule.mcore, pack_weight(torch.zeros(shape), "nvfp4"))}
            for wire in wire_tensors(fp4, {n: torch.ones(()) for n in fp4}):
                module, slot = sglang_module_of(wire.name, stacked, expert_prefixes)
                kind = "moe" if module == "experts" else "linear" if is_linear_base(constructed[module]) else None
                layout = LAYOUTS[method_of[kind]]
                assert slot in layout.raw_slots, (wire.name, slot)
                seen.add((module, layout.method))
        assert {x[0] for x in seen} == {"qkv_proj", "o_proj", "experts"}
