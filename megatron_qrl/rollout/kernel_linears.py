"""The engine's FP4 linears on the W4A16 Triton kernels (kernels/): prepared weights, built once per sync.

When the engine runs its FP4 linears on the kernels (`kernels_wanted`: CUDA + bf16 model by default,
forced with `EmbeddedEngine(kernels="on")` / QRL_ROLLOUT_KERNELS=on, e.g. under TRITON_INTERPRET=1 on CPU):
- every quantized dense linear (qkv / proj / shared experts with quant.targets=all_linears) keeps a
  `PreparedFP4Weight` and its GEMM becomes `w4a16_gemm` (the linear's `_forward_impl` is swapped on the
  instance; input quantization and TRACE capture still go through the linear's own hook);
- every routed-expert MLP (Megatron SequentialMLP, one python call per expert) becomes one grouped launch
  for gate/up (fused SiLU) and one for down over all experts (`moe_grouped_gemm`): the dispatcher's
  permuted rows are already sorted by expert, so each row is an assignment of top-k 1;
- W4A4 quantize-dequantizes each expert's input with that expert's own dynamic global scale (amax of the
  rows routed to it in this step, as the trainer's QAT hook does) on the fused Triton fake-quant, then runs
  the W4A16 kernels. The fc2 input is the SwiGLU output times the router probability (Megatron's order),
  quantized per expert as well. Cached layers capture one `GroupedCaptureRecord` per layer and role.
`prepare` rebuilds the prepared weights from the WeightStore's synced FP4 payloads (never per call).
The parameters of those weights (`packed_weights`) hold no storage: the engine frees them, so an FP4 engine
holds its linears once in FP4 (and once more as the store's synced payloads), never as a dequantized BF16 copy
(48 layers of the Qwen3-30B-A3B shape: ~58 GB of BF16 expert weights).
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_qrl.quant.formats import FP4_FORMATS, fp4_format
from megatron_qrl.quant.wire import FP4Tensor

from .capture import GroupedCaptureRecord


def kernels_wanted(setting, device: torch.device, dtype: torch.dtype, fmt: str) -> bool:
    """Run the FP4 linears on the Triton kernels? The engine's mode (kernels/backend.py `engine_kernels`:
    None / 'auto' / 'on' / 'off' or a bool); never for a model without FP4 weights."""
    from megatron_qrl.kernels.backend import engine_kernels, engine_setting

    setting = engine_setting(setting)
    return fmt in FP4_FORMATS and engine_kernels(setting, device, dtype)


def prepare(payload: FP4Tensor, stack: Optional[list[FP4Tensor]] = None):
    """PreparedFP4Weight of one synced FP4 weight, or of a stack of experts' weights ([E, N, K]; tile-major when
    moe_grouped_gemm.EXPERT_STACK_TILE names a tile)."""
    from megatron_qrl.kernels import prepare_weight
    from megatron_qrl.kernels.layouts import tile_major_experts
    from megatron_qrl.kernels.moe_grouped_gemm import EXPERT_STACK_TILE

    if stack is None:
        return prepare_weight(payload.format, payload.packed, payload.scales, payload.global_scale)
    gs = (torch.stack([p.global_scale.reshape(()).float() for p in stack]) if payload.global_scale is not None
          else None)
    w = prepare_weight(payload.format, torch.stack([p.packed for p in stack]), torch.stack([p.scales for p in stack]),
                       gs)
    return tile_major_experts(w, *EXPERT_STACK_TILE) if EXPERT_STACK_TILE else w


def _dense_forward(lin, *, input, weight, bias=None, **_):
    """The swapped `_forward_impl` of a quantized dense linear: (W4A4: fake-quant input) -> w4a16_gemm."""
    from megatron_qrl.kernels.w4a16_gemm import w4a16_gemm

    if lin.quant.activations and input.numel() > 0:
        input = lin._quant_input(input)          # the linear's own hook: fused fake-quant, TRACE capture
    y = w4a16_gemm(input, lin.kernel_weight)
    return y + bias if bias is not None else y


def _glu_is_swiglu(config) -> bool:
    import torch.nn.functional as F

    return (bool(config.gated_linear_unit) and config.activation_func is F.silu
            and getattr(config, "activation_func_clamp_value", None) is None
            and not getattr(config, "glu_linear_offset", 0.0) and not config.add_bias_linear
            and not config.moe_apply_probs_on_input)


class GroupedExperts:
    """Replaces one SequentialMLP's forward: all experts of the layer in two grouped W4A16 launches."""

    def __init__(self, mlp, layer: int, fmt: str, w4a4: bool):
        self.mlp, self.layer, self.fmt, self.w4a4 = mlp, layer, fmt, w4a4
        self.w13 = self.w2 = None
        self.fc1_site = mlp.local_experts[0].linear_fc1.site
        self.fc2_site = mlp.local_experts[0].linear_fc2.site

    def _quant_rows(self, x: torch.Tensor, row_expert: torch.Tensor, num_experts: int, site, role: str):
        """dequant(quant(x)) with each row's expert's dynamic global scale; captures when the site's sink is set."""
        fmt = fp4_format(self.fmt)
        gs_rows = None
        if fmt.has_global_scale:
            amax = torch.zeros(num_experts, dtype=torch.float32, device=x.device)
            amax.scatter_reduce_(0, row_expert, x.detach().abs().amax(dim=-1).float(), reduce="amax",
                                 include_self=True)
            gs_rows = fmt.global_scales(amax)[row_expert].unsqueeze(-1).contiguous()
        capture = site.capture_sink is not None
        # capture: the same values plus the TRACE record, from the same single launch
        deq, enc = fmt.fake_quant(x, gs_rows, capture=capture, check_finite=False, kernels=True)
        if capture:
            site.capture_sink.append(GroupedCaptureRecord(self.layer, role, row_expert, enc.packed, enc.scales,
                                                          None if gs_rows is None else gs_rows.reshape(-1), enc.bits))
        return deq

    def __call__(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs, **_):
        from dataclasses import replace

        from megatron_qrl.kernels.moe_grouped_gemm import heuristic_moe_config, moe_align, moe_down, moe_gate_up

        x = permuted_local_hidden_states
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        n, dev = x.shape[0], x.device
        e = self.w13.num_experts
        if n == 0:
            return x.new_zeros(shape), None
        counts = torch.as_tensor(tokens_per_expert).to(device=dev, dtype=torch.int64)
        row_expert = torch.repeat_interleave(torch.arange(e, device=dev), counts, output_size=n)
        probs = permuted_probs.reshape(-1).float()
        xb = x.to(torch.bfloat16)
        f = self.w13.n // 2
        gu = heuristic_moe_config(n, e, f, self.w13.k, True, self.w13.fmt, tile=self.w13.tile)
        dn = heuristic_moe_config(n, e, self.w2.n, self.w2.k, False, self.w2.fmt, tile=self.w2.tile)
        if self.w4a4:
            # the fc2 input is quantized on its real value: no fp16-scaled intermediate
            gu, dn = replace(gu, x_pre=False), replace(dn, x_pre=False)
            xb = self._quant_rows(x, row_expert, e, self.fc1_site, "fc1").to(torch.bfloat16)
        routing = moe_align(row_expert.unsqueeze(1), e, gu.block_m)
        h = moe_gate_up(xb, self.w13, routing, gu)       # sorted (padded) rows
        if self.w4a4:
            pad = routing.sorted_ids.long()
            valid = pad < n
            src = torch.where(valid, pad, torch.zeros_like(pad))
            # Megatron scales the SwiGLU output by the router probability before fc2 (rounded to bf16)
            h = (h.float() * torch.where(valid, probs[src], torch.zeros_like(probs[src])).unsqueeze(-1)
                 ).to(x.dtype)
            # quantize the real rows in dispatch order (pads are zero rows and do not change any amax)
            pos = torch.empty(n + 1, dtype=torch.int64, device=dev)
            pos.scatter_(0, pad, torch.arange(pad.numel(), device=dev))
            rows = pos[:n]
            hq = torch.zeros(h.shape, dtype=torch.bfloat16, device=dev)
            hq[rows] = self._quant_rows(h[rows].contiguous(), row_expert, e, self.fc2_site, "fc2").to(torch.bfloat16)
            y = moe_down(hq, self.w2, routing, torch.ones_like(probs), dn)
        else:
            if h.dtype == torch.float16 and not (dn.fp16_dot and self.w2.fmt == "nvfp4"):
                h = (h.float() * 256.0).to(torch.bfloat16)
            y = moe_down(h, self.w2, routing, probs, dn)
        return y.to(x.dtype).reshape(shape), None


class KernelLinears:
    """Binds the engine model's quantized linears and expert MLPs to prepared FP4 weights and the kernels."""

    def __init__(self, model: torch.nn.Module, quantized: set[str], fmt: str, w4a4: bool):
        from megatron_qrl.models import fp4_linears

        self.fmt = fmt
        names = {id(m): n for n, m in model.named_modules()}
        self.dense: dict[str, torch.nn.Module] = {}          # weight name -> linear
        self.grouped: dict[str, GroupedExperts] = {}          # experts module name -> grouped runner
        expert_mlps = {}
        for lin in fp4_linears(model):
            wname = f"{names[id(lin)]}.weight"
            if wname not in quantized:
                continue
            if lin.site.expert is None:
                self.dense[wname] = lin
        for name, mod in model.named_modules():
            if type(mod).__name__ == "QATSequentialMLP" or (hasattr(mod, "local_experts")
                                                           and hasattr(mod, "num_local_experts")):
                first = mod.local_experts[0].linear_fc1
                if f"{names[id(first)]}.weight" in quantized:
                    if not _glu_is_swiglu(mod.config):
                        raise NotImplementedError("the grouped MoE kernels implement SwiGLU experts without bias; "
                                                  "run this model with EmbeddedEngine(kernels='off')")
                    expert_mlps[name] = mod
        for name, mod in expert_mlps.items():
            runner = GroupedExperts(mod, first_site_layer(mod), fmt, w4a4)
            self.grouped[name] = runner
        for lin in self.dense.values():
            lin.kernel_weight = None
            lin._forward_impl = _bound(lin)
        for name, runner in self.grouped.items():
            runner.mlp.forward = runner

    def packed_weights(self) -> set[str]:
        """The parameter names only the kernels read (their prepared FP4 form): every dense linear bound here
        and both projections of every expert of the grouped MLPs."""
        names = set(self.dense)
        for name, runner in self.grouped.items():
            names.update(f"{name}.local_experts.{j}.linear_fc{i}.weight"
                         for j in range(runner.mlp.num_local_experts) for i in (1, 2))
        return names

    def prepare(self, store) -> None:
        """(Re)build every prepared weight from the store's synced payloads: once per weight sync. Weights
        already prepared are overwritten in place, so CUDA graphs captured over them stay valid."""
        for wname, lin in self.dense.items():
            lin.kernel_weight = _install(lin.kernel_weight, prepare(store.entries[wname].to(lin.weight.device)))
        for name, runner in self.grouped.items():
            n, dev = runner.mlp.num_local_experts, runner.mlp.local_experts[0].linear_fc1.weight.device
            fc1 = [store.entries[f"{name}.local_experts.{j}.linear_fc1.weight"].to(dev) for j in range(n)]
            fc2 = [store.entries[f"{name}.local_experts.{j}.linear_fc2.weight"].to(dev) for j in range(n)]
            runner.w13 = _install(runner.w13, prepare(fc1[0], fc1))
            runner.w2 = _install(runner.w2, prepare(fc2[0], fc2))

    def drop(self) -> None:
        """Free the prepared weights (release_memory); `prepare` rebuilds them."""
        for lin in self.dense.values():
            lin.kernel_weight = None
        for runner in self.grouped.values():
            runner.w13 = runner.w2 = None

    def nbytes(self) -> int:
        total = sum(lin.kernel_weight.nbytes() for lin in self.dense.values() if lin.kernel_weight is not None)
        return total + sum(r.w13.nbytes() + r.w2.nbytes() for r in self.grouped.values() if r.w13 is not None)


def _install(old, new):
    """`new`'s bytes in `old`'s tensors when the layouts match (stable addresses), else `new`."""
    same = old is not None and all(a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
                                   for a, b in ((old.qweight, new.qweight), (old.scales, new.scales),
                                                (old.global_scale, new.global_scale)))
    if not same:
        return new
    old.qweight.copy_(new.qweight)
    old.scales.copy_(new.scales)
    old.global_scale.copy_(new.global_scale)
    return old


def first_site_layer(mlp) -> int:
    return mlp.local_experts[0].linear_fc1.site.layer


def _bound(lin):
    def forward_impl(**kwargs):
        return _dense_forward(lin, **kwargs)
    return forward_impl
