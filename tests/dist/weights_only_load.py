"""Weights written outside autograd (launched by tests/test_megatron_trainer.py).

(1) The FP4 linears cache their fake-quantized weight per change; Megatron's bf16 optimizers write the model
params through `.data` / the DDP param buffer, which no version counter sees, so the trainer must announce
the change (`weights_changed`, called by train_step and load): a write through `.data` followed by it
must reach the next forward, and train_step must call it.
(2) Weights-only checkpoint load with bf16 params.

With bf16 model params Megatron's optimizers keep fp32 main (master) copies; a load that restores the model
but not the optimizer must refresh them, or the first step writes the old (initial) weights back over the
loaded ones. For the plain and the distributed optimizer: trainer A saves; trainer B (another seed) loads
weights only and takes one step with a negligible LR; B's weights must still be A's. Megatron's
mixed-precision optimizers need CUDA: on CPU (fp32, no master copies) the same checks run in fp32 and the
load must still hand the loaded weights to the optimizer (reload_model_params); on a GPU they run in bf16,
where the bug showed (tools/gpu_loop.sh runs this script).
"""
import sys

import mcore_common as common

common.add_repo_to_path()
common.setup_threads()


def params(trainer) -> dict:
    from megatron.core.utils import unwrap_model

    return {n: p.detach().float().clone() for n, p in unwrap_model(trainer.model)[0].named_parameters()}


def main(outdir: str) -> None:
    import torch

    from megatron_qrl.config import load_config
    from megatron_qrl.trainer import Trainer

    bf16 = "true" if torch.cuda.is_available() else "false"
    for dist_opt in ("false", "true"):
        over = common.overrides("w4a16") + [f"trainer.bf16={bf16}", f"trainer.use_distributed_optimizer={dist_opt}",
                                            "trainer.lr=1e-30", "trainer.clip_grad=0"]
        a = Trainer(load_config(None, over + ["trainer.seed=1"]))
        a.train_step(common.make_batch(), common.loss_fn)   # Megatron's distributed optimizer saves after a step
        path = f"{outdir}/a_{dist_opt}"
        a.save(path, {})
        saved = params(a)
        b = Trainer(load_config(None, over + ["trainer.seed=2"]))
        assert any(not torch.equal(saved[n], p) for n, p in params(b).items()), "seeds must give other weights"
        reloads = []
        original = b.optimizer.reload_model_params
        b.optimizer.reload_model_params = lambda *a, **k: (reloads.append(1), original(*a, **k))[1]
        b.load(path, load_optimizer=False)
        assert reloads, "a weights-only load must refresh the optimizer's copies of the weights"
        b.train_step(common.make_batch(), common.loss_fn)
        after = params(b)
        changed = [n for n in saved if not torch.equal(saved[n], after[n])]
        assert not changed, f"distributed optimizer={dist_opt}: a step after a weights-only load moved " \
                            f"{len(changed)} params back, e.g. {changed[:3]}"
        print(f"weights-only load ok (bf16={bf16}, distributed optimizer={dist_opt})", flush=True)
    check_weight_cache(b)


def check_weight_cache(trainer) -> None:
    import torch
    from megatron.core.utils import unwrap_model

    from megatron_qrl.models import fp4_linear, fp4_linears, grouped_expert_modules, weights_changed

    from megatron_qrl.models import quantize_dequantize

    batch = common.make_batch()
    linears = [lin for lin in fp4_linears(unwrap_model(trainer.model)[0]) if lin.quant.weights]
    assert linears
    trainer.logprobs(batch)                    # fills every linear's cache
    with torch.no_grad():
        for lin in linears:
            lin.weight.data.mul_(0.5)          # as Megatron's bf16 optimizers write: no version bump
    weights_changed()
    trainer.logprobs(batch)
    grouped = {}   # linear -> (grouped expert MLP, role, index): their weights are quantized by the MLP, stacked
    for _, mlp in grouped_expert_modules(unwrap_model(trainer.model)[0]):
        for role in mlp.ROLES:
            for j, lin in enumerate(mlp._linears(role)):
                grouped[id(lin)] = (mlp, role, j)
    for lin in linears:   # the forward used the FP4 codes of the weight as it is now
        w = lin.weight.detach()
        expected, _ = quantize_dequantize(w, lin.quant.format, group=lin._tp())
        if id(lin) in grouped:
            mlp, role, j = grouped[id(lin)]
            used = mlp._qat_weights[role].effective[j]
            assert torch.equal(used, w + (expected - w)), f"{lin.site.name}: stale grouped FP4 weight after a .data write"
        else:
            assert torch.equal(lin._fq_weight_cache[1], expected), f"{lin.site.name}: stale FP4 weight after a .data write"
    assert grouped or not any(lin.site.expert is not None for lin in linears)
    epoch = fp4_linear._WEIGHT_EPOCH[0]
    trainer.train_step(batch, common.loss_fn)
    assert fp4_linear._WEIGHT_EPOCH[0] > epoch, "train_step must invalidate the cached FP4 weights"
    print("FP4 weight cache follows .data writes", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
