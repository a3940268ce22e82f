"""The FP4 reload session (rollout/sglang/reprocess.py) on stand-in SGLang layers, on the CPU.

The stand-ins mimic what tests/test_sglang_reload_contract.py establishes about sglang 0.5.15.post1: a layer's
quant method registers checkpoint-layout parameters carrying the layer's weight_loader (`create_weights`), the
model's `load_weights` looks parameters up once per call and calls `param.weight_loader`, and
`process_weights_after_loading` either replaces the parameters with new ones of another layout (the Marlin path:
the replacements have no weight_loader) or rewrites the scales in place (the Blackwell swizzle: running it twice
garbles them). They are not SGLang; they only let the session's dispatch be checked.
"""
import pytest
import torch

from megatron_qrl.rollout.sglang import custom_loader
from megatron_qrl.rollout.sglang.fp4_layouts import layout_of
from megatron_qrl.rollout.sglang.reprocess import IncompleteFp4Update, SESSION_ATTR

H, N, E = 32, 64, 3  # hidden (K), rows of a linear, experts


class LoaderParam(torch.nn.Parameter):
    """Like the release's BasevLLMParameter: the loader sits behind a read-only property."""

    def __new__(cls, data, weight_loader):
        return super().__new__(cls, data, requires_grad=False)

    def __init__(self, data, weight_loader):
        self._weight_loader = weight_loader

    @property
    def weight_loader(self):
        return self._weight_loader


def copy_or_rebind_param(layer, name, value):
    """As the release's helper: copy into an existing Parameter of the same shape/dtype, else rebind its .data."""
    param = getattr(layer, name, None)
    if isinstance(param, torch.nn.Parameter):
        if param.shape == value.shape and param.dtype == value.dtype:
            param.data.copy_(value)
        else:
            param.data = value
    else:
        setattr(layer, name, torch.nn.Parameter(value, requires_grad=False))


def swizzle(t):
    """Stand-in for a kernel layout: reverses each row (applying it twice restores the input: not idempotent)."""
    return t.flip(-1)


class ModelOptFp4LinearMethod:
    """Stand-in with the release's class name. A layer with shards (q/k/v) of `rows` each."""

    def __init__(self, backend):
        self.backend, self.processed = backend, []

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, weight_loader):
        layer.input_size_per_partition, layer.logical_widths = input_size_per_partition, output_partition_sizes
        layer.params_dtype = params_dtype
        n, k = sum(output_partition_sizes), input_size_per_partition
        layer.register_parameter("weight", LoaderParam(torch.empty(n, k // 2, dtype=torch.uint8), weight_loader))
        layer.register_parameter("weight_scale", LoaderParam(torch.empty(n, k // 16, dtype=torch.float8_e4m3fn),
                                                             weight_loader))
        for s in ("weight_scale_2", "input_scale"):
            layer.register_parameter(s, LoaderParam(torch.ones(len(output_partition_sizes)), weight_loader))

    def process_weights_after_loading(self, layer):
        self.processed.append(layer.prefix)
        layer.alpha = torch.nn.Parameter(layer.input_scale.max() * layer.weight_scale_2.max(), requires_grad=False)
        if self.backend == "marlin":  # new Parameters in another layout; the loaders are gone
            # the release's copy_or_rebind_param: on a second run it rebinds .data of the installed object
            copy_or_rebind_param(layer, "weight_global_scale", layer.weight_scale_2.max())
            layer.weight_global_scale = torch.nn.Parameter(layer.weight_global_scale.data.to(torch.bfloat16)
                                                           .reshape(1), requires_grad=False)
            layer.weight = torch.nn.Parameter(layer.weight.data.T.contiguous().view(torch.int32), requires_grad=False)
            layer.weight_scale = torch.nn.Parameter(layer.weight_scale.data.T.contiguous(), requires_grad=False)
        else:  # swizzled scales written into the same storage, aliased under a second name
            layer.weight_scale.data.copy_(swizzle(layer.weight_scale.data.view(torch.uint8)).view(torch.float8_e4m3fn))
            layer.weight_scale_interleaved = layer.weight_scale
        layer.workspace = torch.zeros(4)


class ModelOptNvFp4FusedMoEMethod:
    def __init__(self, backend):
        self.backend, self.processed = backend, []

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       weight_loader):
        layer.intermediate_size_per_partition, layer.params_dtype = intermediate_size_per_partition, params_dtype
        f = intermediate_size_per_partition
        shapes = {"w13_weight": ((num_experts, 2 * f, hidden_size // 2), torch.uint8),
                  "w2_weight": ((num_experts, hidden_size, f // 2), torch.uint8),
                  "w13_weight_scale": ((num_experts, 2 * f, hidden_size // 16), torch.float8_e4m3fn),
                  "w2_weight_scale": ((num_experts, hidden_size, f // 16), torch.float8_e4m3fn),
                  "w13_weight_scale_2": ((num_experts, 2), torch.float32), "w2_weight_scale_2": ((num_experts,),
                                                                                                  torch.float32),
                  "w13_input_scale": ((num_experts, 2), torch.float32), "w2_input_scale": ((num_experts,),
                                                                                            torch.float32)}
        for name, (shape, dtype) in shapes.items():
            layer.register_parameter(name, LoaderParam(torch.ones(shape).to(dtype), weight_loader))

    def process_weights_after_loading(self, layer):
        self.processed.append(layer.prefix)
        for w in ("w13", "w2"):
            q, s, s2 = (getattr(layer, f"{w}_{n}") for n in ("weight", "weight_scale", "weight_scale_2"))
            setattr(layer, f"{w}_weight", torch.nn.Parameter(q.data.transpose(1, 2).contiguous(), requires_grad=False))
            setattr(layer, f"{w}_weight_scale", torch.nn.Parameter(swizzle(s.data.view(torch.uint8))
                                                                   .view(torch.float8_e4m3fn), requires_grad=False))
            setattr(layer, f"{w}_weight_scale_2", torch.nn.Parameter(s2.data.reshape(E, -1)[:, 0].to(torch.bfloat16),
                                                                     requires_grad=False))


class QKVLinear(torch.nn.Module):
    """Three shards of N rows; weight_loader(param, loaded, shard_id) writes a shard's rows (scalars: its slot)."""

    def __init__(self, prefix, backend):
        super().__init__()
        self.prefix, self.input_size, self.output_size = prefix, H, 3 * N
        self.quant_method = ModelOptFp4LinearMethod(backend)
        self.quant_method.create_weights(self, H, [N, N, N], H, 3 * N, torch.bfloat16, self.weight_loader)

    def weight_loader(self, param, loaded, shard_id):
        i = "qkv".index(shard_id)
        if param.dim() == 1:
            param.data[i] = loaded
        else:
            param.data[i * N:(i + 1) * N].copy_(loaded)


class Experts(torch.nn.Module):
    def __init__(self, prefix, backend):
        super().__init__()
        self.prefix, self.hidden_size, self.num_local_experts = prefix, H, E
        self.quant_method = ModelOptNvFp4FusedMoEMethod(backend)
        self.quant_method.create_weights(self, E, H, N, torch.bfloat16, self.weight_loader)

    def weight_loader(self, param, loaded, name, shard_id, expert_id):
        if param.dim() == 2:  # per-expert scalars: [E, 2] for w1/w3, [E] for w2
            index = (expert_id, "w1w3".index(shard_id) // 2) if shard_id != "w2" else (expert_id,)
            param.data[index] = loaded
        elif shard_id == "w2":
            param.data[expert_id].copy_(loaded)
        else:
            half = param.shape[1] // 2
            rows = slice(0, half) if shard_id == "w1" else slice(half, 2 * half)
            param.data[expert_id, rows].copy_(loaded)


class Norm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(H, dtype=torch.bfloat16), requires_grad=False)


class StandInModel(torch.nn.Module):
    """Two FP4 attention layers, one expert layer, one BF16 norm; load_weights as the release's Qwen3-MoE does."""

    def __init__(self, backend):
        super().__init__()
        self.attn0, self.attn1 = QKVLinear("attn0", backend), QKVLinear("attn1", backend)
        self.experts, self.norm = Experts("experts", backend), Norm()

    def load_weights(self, weights):
        params = dict(self.named_parameters())  # looked up once per call, as the release does
        for name, loaded in weights:
            if name.startswith("norm"):
                params[name].data.copy_(loaded)
                continue
            module, shard, suffix = name.split(".")
            if module == "experts":
                expert, proj = shard.split("_")
                shard_id = {"gate": "w1", "up": "w3", "down": "w2"}[proj]
                param = params[f"experts.{'w2' if proj == 'down' else 'w13'}_{suffix}"]
                param.weight_loader(param, loaded, name, shard_id=shard_id, expert_id=int(expert))
            else:
                param = params[f"{module}.{suffix}"]
                param.weight_loader(param, loaded, shard)


def linear_tensors(module, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for shard in "qkv":
        out += [(f"{module}.{shard}.weight", torch.randint(0, 256, (N, H // 2), generator=g, dtype=torch.uint8)),
                (f"{module}.{shard}.weight_scale", (torch.rand(N, H // 16, generator=g) + 0.5)
                 .to(torch.float8_e4m3fn)),
                (f"{module}.{shard}.weight_scale_2", torch.rand((), generator=g) + 0.1)]
    return out


def expert_tensors(seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for e in range(E):
        for proj, (rows, cols) in (("gate", (N, H)), ("up", (N, H)), ("down", (H, N))):
            out += [(f"experts.{e}_{proj}.weight", torch.randint(0, 256, (rows, cols // 2), generator=g,
                                                               dtype=torch.uint8)),
                    (f"experts.{e}_{proj}.weight_scale", (torch.rand(rows, cols // 16, generator=g) + 0.5)
                     .to(torch.float8_e4m3fn)),
                    (f"experts.{e}_{proj}.weight_scale_2", torch.rand((), generator=g) + 0.1)]
    return out


def all_tensors(seed):
    return (linear_tensors("attn0", seed) + linear_tensors("attn1", seed + 1) + expert_tensors(seed + 2)
            + [("norm.weight", torch.full((H,), float(seed), dtype=torch.bfloat16))])


def loaded_model(backend, tensors):
    """What the release's startup does: create_weights (in __init__), load_weights, process every FP4 layer."""
    model = StandInModel(backend)
    model.load_weights(tensors)
    for m in (model.attn0, model.attn1, model.experts):
        m.quant_method.process_weights_after_loading(m)
        m.quant_method.processed.clear()
    return model


def installed(model):
    """name -> (data_ptr, bytes) of every tensor the kernels read, aliases included."""
    out = {}
    for prefix, module in model.named_modules():
        for name, t in {**module._parameters, **{k: v for k, v in vars(module).items()
                                                   if isinstance(v, torch.Tensor)}}.items():
            if t is not None:
                out[f"{prefix}.{name}"] = (t.data_ptr(), t.detach().reshape(-1).view(torch.uint8).clone())
    return out


def assert_same_values(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name][1], b[name][1]), name


def sync(model, buckets):
    """An update framed as the adapter frames it: begin, the buckets through plain load_weights, end."""
    custom_loader.begin_fp4_update(model, [])
    for bucket in buckets:
        model.load_weights(bucket)
    custom_loader.end_fp4_update(model, [])


BACKENDS = ["marlin", "swizzle"]


def test_the_stand_in_reproduces_the_release_problem():
    marlin = loaded_model("marlin", all_tensors(0))
    with pytest.raises(AttributeError, match="weight_loader"):
        marlin.load_weights(linear_tensors("attn0", 5))  # replaced Parameters have no loader
    swizzled = loaded_model("swizzle", all_tensors(0))
    before = swizzled.attn0.weight_scale_interleaved.clone()
    swizzled.load_weights(linear_tensors("attn0", 0))  # same bytes again: raw scales land in the kernel's tensor
    assert not torch.equal(swizzled.attn0.weight_scale_interleaved.view(torch.uint8), before.view(torch.uint8))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sync_installs_what_a_fresh_load_of_the_same_bytes_installs_in_the_same_storage(backend):
    model = loaded_model(backend, all_tensors(0))
    before = installed(model)
    new = all_tensors(7)
    half = len(new) // 2
    sync(model, [new[:half], new[half:]])  # the expert layer is split across the two buckets
    after = installed(model)
    assert_same_values(after, installed(loaded_model(backend, new)))
    assert {n: p for n, (p, _) in after.items()} == {n: p for n, (p, _) in before.items()}  # no tensor moved
    assert not hasattr(model, SESSION_ATTR)


@pytest.mark.parametrize("backend", BACKENDS)
def test_touched_layers_are_processed_once_in_first_write_order_and_untouched_ones_not(backend):
    model = loaded_model(backend, all_tensors(0))
    untouched = installed(model.attn0)
    sync(model, [expert_tensors(3)[:9], linear_tensors("attn1", 4), expert_tensors(3)[9:],
                 [("norm.weight", torch.full((H,), 2.0, dtype=torch.bfloat16))]])
    assert model.experts.quant_method.processed == ["experts"]
    assert model.attn1.quant_method.processed == ["attn1"] and model.attn0.quant_method.processed == []
    assert_same_values(installed(model.attn0), untouched)
    assert torch.equal(model.norm.weight, torch.full((H,), 2.0, dtype=torch.bfloat16))  # BF16 passes through

    processed = []
    for m in (model.attn0, model.attn1, model.experts):
        m.quant_method.processed = processed
    sync(model, [linear_tensors("attn1", 1), expert_tensors(2), linear_tensors("attn0", 1)])
    assert processed == ["attn1", "experts", "attn0"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_identical_second_sync_installs_identical_tensors(backend):
    model = loaded_model(backend, all_tensors(0))
    sync(model, [all_tensors(5)])
    first = installed(model)
    sync(model, [all_tensors(5)])
    assert_same_values(installed(model), first)
    sync(model, [all_tensors(0)])  # and back to the checkpoint's own bytes
    assert_same_values(installed(model), installed(loaded_model(backend, all_tensors(0))))


def test_read_only_scales_keep_their_parameter_and_value_when_not_sent():
    model = loaded_model("marlin", all_tensors(0))
    model.attn0.input_scale.data.fill_(3.0)
    param = model.attn0.input_scale
    sync(model, [linear_tensors("attn0", 2)])
    assert model.attn0.input_scale is param and torch.equal(param.data, torch.full((3,), 3.0))
    assert model.attn0.alpha.item() == pytest.approx(3.0 * max(t.item() for n, t in linear_tensors("attn0", 2)
                                                               if n.endswith("scale_2")))


def test_a_partly_sent_layer_keeps_its_previous_weights_and_the_update_fails_loudly():
    model = loaded_model("marlin", all_tensors(0))
    before = installed(model)
    only_q = [t for t in linear_tensors("attn0", 9) if ".q." in t[0]]
    with pytest.raises(IncompleteFp4Update, match="attn0"):
        sync(model, [only_q, linear_tensors("attn1", 9)])
    after = installed(model)
    assert_same_values({n: v for n, v in after.items() if n.startswith("attn0")},
                       {n: v for n, v in before.items() if n.startswith("attn0")})
    assert model.attn1.quant_method.processed == ["attn1"]  # the complete layer was still re-processed
    sync(model, [linear_tensors("attn0", 9)])  # the next full update works
    assert model.attn0.quant_method.processed == ["attn0"]


def test_an_update_that_died_midway_is_finished_by_the_next_one():
    model = loaded_model("marlin", all_tensors(0))
    custom_loader.begin_fp4_update(model, [])
    model.load_weights(linear_tensors("attn0", 1)[:3])  # the session stays open (the trainer died)
    sync(model, [all_tensors(4)])
    assert_same_values(installed(model), installed(loaded_model("marlin", all_tensors(4))))


def test_the_one_call_loader_frames_its_own_tensors():
    model = loaded_model("swizzle", all_tensors(0))
    custom_loader.load_fp4_update(model, all_tensors(6))
    assert_same_values(installed(model), installed(loaded_model("swizzle", all_tensors(6))))


def test_unsupported_modelopt_fp4_methods_are_refused_by_name():
    class ModelOptNvFp4A16LinearMethod:
        pass

    layer = torch.nn.Module()
    layer.quant_method = ModelOptNvFp4A16LinearMethod()
    with pytest.raises(NotImplementedError, match="weight_scale_2"):
        layout_of(layer)
    assert layout_of(Norm()) is None


def test_empty_named_tensors_payload_unpickles_to_an_empty_list_per_rank():
    import base64
    import pickle

    payload = custom_loader.empty_serialized_named_tensors(2)
    assert len(payload) == 2 and all(pickle.loads(base64.b64decode(p)) == [] for p in payload)
    assert base64.b64decode(payload[0])[0] == 0x80  # a pickle header, as the release's payload check expects
