"""Single-process Megatron-Core reference run, plus the single-process unit checks.

Run: python -m torch.distributed.run --nproc_per_node 1 --master_port P tests/dist/mcore_reference.py OUT
Writes to OUT/:
  ref_<scheme>.pt      log-probs (natural routing and R3 replay), losses of 4 steps, log-probs after 3 steps
  init_<scheme>/       the initial weights as a dist checkpoint (every layout test starts from it)
  units.json           QAT linear vs codec reference, AQN and R3 checks
tests/test_megatron_trainer.py asserts on these files; tests/dist/mcore_layouts.py compares layouts to them.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mcore_common as common  # noqa: E402


def qat_linear_checks(config) -> dict:
    """FP4 linears vs a manual reference: codec quantize/dequantize of W and x, then a matmul."""
    import torch

    from megatron_qrl.models.fp4_linear import (FP4ColumnParallelLinear, FP4RowParallelLinear, QuantSettings,
                                                fp4_linear_class)
    from megatron_qrl.quant import mxfp4_dequantize, mxfp4_quantize, nvfp4_dequantize, nvfp4_quantize

    def codec(t, fmt):
        if fmt == "nvfp4":
            return nvfp4_dequantize(*nvfp4_quantize(t), dtype=t.dtype)
        return mxfp4_dequantize(*mxfp4_quantize(t), dtype=t.dtype)

    out = {}
    g = torch.Generator().manual_seed(3)
    for fmt, base, acts in [("nvfp4", FP4ColumnParallelLinear, True), ("nvfp4", FP4RowParallelLinear, True),
                            ("mxfp4", FP4ColumnParallelLinear, True), ("nvfp4", FP4ColumnParallelLinear, False)]:
        cls = fp4_linear_class(base, QuantSettings(format=fmt, activations=acts))
        kw = dict(config=config, init_method=lambda w: torch.nn.init.normal_(w, std=0.05), bias=False,
                  skip_bias_add=True)
        kw.update({"gather_output": False} if base is FP4ColumnParallelLinear else {"input_is_parallel": True})
        lin = cls(64, 48, **kw)
        x = (torch.randn(5, 3, 64, generator=g) * torch.linspace(0.1, 4, 64)).requires_grad_(True)
        y, _ = lin(x)
        xq = codec(x.detach(), fmt) if acts else x.detach()
        wq = codec(lin.weight.detach(), fmt)
        ref = xq @ wq.t()
        y.backward(torch.ones_like(y))
        tag = f"{fmt}_{base.__name__}_{'w4a4' if acts else 'w4a16'}"
        out[f"qat/{tag}/max_abs_diff"] = float((y - ref).abs().max())
        out[f"qat/{tag}/fp4_effect"] = float((y - x.detach() @ lin.weight.detach().t()).abs().max())
        # straight-through: grads are those of the quantized GEMM w.r.t. its (quantized) operands
        out[f"qat/{tag}/grad_x_diff"] = float((x.grad - torch.ones_like(y) @ wq).abs().max())
        gw = torch.ones_like(y).reshape(-1, 48).t() @ xq.reshape(-1, 64)
        out[f"qat/{tag}/grad_w_diff"] = float((lin.weight.grad - gw).abs().max())
    return out


def aqn_checks(trainer) -> dict:
    import torch

    from megatron_qrl.models import aqn_norms, clear_aqn_noise, set_aqn_noise

    batch = common.make_batch()
    norms = aqn_norms(trainer.model)
    weights = [n.weight.detach().clone() for n in norms]
    base = trainer.logprobs(batch)
    g = torch.Generator().manual_seed(11)
    set_aqn_noise(trainer.model, 0.05, g)
    z1 = [n.aqn_noise.clone() for n in norms]
    noisy = trainer.logprobs(batch)
    set_aqn_noise(trainer.model, 0.05, g)
    z2 = [n.aqn_noise.clone() for n in norms]
    out = {
        "aqn/num_norms": len(norms),
        "aqn/params_unchanged": all(torch.equal(w, n.weight) for w, n in zip(weights, norms)),
        "aqn/effective_is_w_plus_z": all(torch.equal(n.effective_weight(), n.weight + n.aqn_noise) for n in norms),
        "aqn/second_draw_replaces": all(torch.equal(n.aqn_noise, z) for n, z in zip(norms, z2)),
        "aqn/draws_differ": all(not torch.equal(a, b) for a, b in zip(z1, z2)),
        "aqn/noise_std": float(torch.cat(z1).std()),
        "aqn/noise_changes_logp": float((noisy - base).abs().max()),
        "aqn/not_in_state_dict": not any("aqn_noise" in k for k in trainer.model[0].module.state_dict()),
    }
    # a training step under noise moves the parameter by the optimizer update only; the buffer stays Z
    trainer.train_step(batch, common.loss_fn)
    out["aqn/buffer_unchanged_by_step"] = all(torch.equal(n.aqn_noise, z) for n, z in zip(norms, z2))
    clear_aqn_noise(trainer.model)
    out["aqn/cleared"] = all(float(n.aqn_noise.abs().max()) == 0 for n in norms)
    return out


def r3_checks(trainer) -> dict:
    import torch

    from megatron_qrl.models import r3_routers

    batch = common.make_batch(replay=True)
    routers = r3_routers(trainer.model)
    out = {"r3/num_routers": len(routers)}
    # the experts receive exactly the tokens the replayed ids send them (one micro-batch: samples 0..1)
    one = {k: v[:2] for k, v in batch.items() if k != "advantages"}
    counts = {}
    hooks = [r_layer.mlp.experts.register_forward_pre_hook(
        lambda mod, args, idx=r_layer.layer_number - 1: counts.__setitem__(idx, torch.as_tensor(args[1]).clone()))
        for r_layer in trainer.model[0].module.decoder.layers]
    trainer.logprobs(one)
    for h in hooks:
        h.remove()
    want = {r.layer_index: torch.bincount(one["r3_expert_ids"][:, :, r.layer_index].flatten(),
                                          minlength=common.NUM_EXPERTS) for r in routers}
    out["r3/expert_tokens_equal_replay"] = all(torch.equal(counts[i].long(), w) for i, w in want.items())
    # replaying the router's own choice reproduces the unreplayed forward exactly
    natural = {k: v for k, v in one.items() if k != "r3_expert_ids"}
    lp_nat = trainer.logprobs(natural)
    own = torch.stack([r.last_topk_ids.reshape(common.T, 2, common.TOPK).transpose(0, 1) for r in routers], dim=2)
    lp_own = trainer.logprobs({**natural, "r3_expert_ids": own})
    out["r3/own_ids_replay_diff"] = float((lp_nat - lp_own).abs().max())
    lp_rep = trainer.logprobs(one)
    out["r3/replay_changes_logp"] = float((lp_nat - lp_rep).abs().max())
    # the router still learns: its weight gets a gradient through the replayed probabilities
    stats = trainer.train_step(batch, common.loss_fn)
    out["r3/router_agreement"] = stats.get("r3/router_agreement", -1.0)
    out["r3/router_grad_norm"] = float(sum(r.weight.main_grad.norm() for r in routers))
    return out


def _params(trainer) -> dict:
    return {k: v.detach().clone() for k, v in trainer.model[0].module.state_dict().items()
            if k.endswith("weight")}


def shim_checks() -> dict:
    """The CPU shim is scoped: Megatron's modules see a CPU 'cuda', torch itself is untouched."""
    import torch
    from megatron.core.tensor_parallel import layers

    from megatron_qrl.platform import cpu

    try:
        torch.cuda.current_device()
        untouched = False
    except (AssertionError, RuntimeError):
        untouched = True
    return {"shim/installed": cpu.installed(), "shim/torch_untouched": untouched,
            "shim/megatron_device": str(layers.torch.cuda.current_device())}


def trace_checks(trainer) -> dict:
    """Capture a forward's FP4 activations, replay them as TRACE guides: the same forward comes out."""
    import torch

    from megatron_qrl.models import capture_activations, guided_fallback_stats
    from megatron_qrl.quant import GuidedRounding
    from megatron_qrl.trace import TraceReplay

    one = {k: v[:2] for k, v in common.make_batch().items() if k != "advantages"}  # one micro-batch
    with capture_activations(trainer.model) as records:
        lp0 = trainer.logprobs(one)
    guides = {r.site: GuidedRounding(r.bits, r.scales, r.global_scale) for r in records}
    calls = []

    def trace_guides(sample_ids, batch_rows=None):
        calls.append(sample_ids.tolist())
        return lambda site, x: guides.get(site.name)

    guided_fallback_stats(trainer.model)
    trainer.trace = TraceReplay.serving(trace_guides)
    lp1 = trainer.logprobs(one)
    fallback = guided_fallback_stats(trainer.model)
    flipped = {k: GuidedRounding(g.bits ^ 0xFF, g.scales, g.global_scale) for k, g in guides.items()}
    trainer.trace = TraceReplay.serving(lambda ids, rows=None: (lambda site, x: flipped.get(site.name)))
    lp2 = trainer.logprobs(one)
    trainer.trace = None
    names = sorted(guides)
    return {"trace/num_sites": len(guides), "trace/records": len(records), "trace/site_examples": names[:3],
            "trace/has_expert_sites": any(".fc1.E" in n for n in names), "trace/provider_calls": calls,
            "trace/replay_diff": float((lp1 - lp0).abs().max()), "trace/fallback": fallback,
            "trace/flipped_bits_diff": float((lp2 - lp0).abs().max()),
            "trace/bits_dtype": str(records[0].bits.dtype), "trace/bits_per_element": 8 * records[0].bits.numel()
            / (2 * records[0].packed.numel())}


def reference(scheme: str, outdir: Path) -> None:
    import torch

    from megatron_qrl.trainer import Trainer

    cfg = common.make_cfg(scheme)
    trainer = Trainer(cfg)
    trainer.save(outdir / f"init_{scheme}", {"note": "initial weights"})
    batch = common.make_batch()
    natural = {k: v for k, v in batch.items() if k != "r3_expert_ids"}
    result = {"logp_natural": trainer.logprobs(natural), "logp_replay": trainer.logprobs(batch), "losses": []}
    result["logp_aqn"] = common.logprobs_with_aqn(trainer, batch)
    for step in range(4):
        stats = trainer.train_step(batch, common.loss_fn)
        result["losses"].append(stats["loss"])
        if step == 0:
            result["stats_step1"] = stats
        if step == 2:
            result["logp_after3"] = trainer.logprobs(batch)
            result["params_after3"] = _params(trainer)
    result["params_after4"] = _params(trainer)
    torch.save(result, outdir / f"ref_{scheme}.pt")


def main() -> None:
    common.setup_threads()
    outdir = Path(sys.argv[1])
    outdir.mkdir(parents=True, exist_ok=True)
    from megatron_qrl.trainer import Trainer

    reference("w4a4", outdir)
    reference("w4a16", outdir)
    trainer = Trainer(common.make_cfg("w4a4"))
    units = qat_linear_checks(trainer.config)
    units.update(aqn_checks(trainer))
    units.update(r3_checks(trainer))
    units.update(trace_checks(trainer))
    units.update(shim_checks())
    common.write_json(outdir / "units.json", units)


if __name__ == "__main__":
    main()
