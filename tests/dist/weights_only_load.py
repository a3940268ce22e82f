"""Weights-only checkpoint load with bf16 params (launched by tests/test_megatron_trainer.py).

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


if __name__ == "__main__":
    main(sys.argv[1])
