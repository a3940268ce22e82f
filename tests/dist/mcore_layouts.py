"""Two gloo ranks: TP=2, PP=2, EP=2 and TP2xEP2 against the single-process reference; checkpoint resharding.

Run: python -m torch.distributed.run --nproc_per_node 2 --master_port P tests/dist/mcore_layouts.py REF OUT
REF is the output directory of mcore_reference.py. For every layout the trainer loads the reference's
initial checkpoint (saved at TP=1: this is itself a resharding load), computes log-probs (natural routing
and R3 replay) and runs 3 optimizer steps. The TP=2 trainer then saves a checkpoint that a TP=1
(data-parallel 2) trainer loads, with optimizer state, to check log-probs and a 4th step. Under TP=2 a
standalone FP4 column/row-parallel linear is compared with the codec applied to the full tensors.
Rank 0 writes OUT/layouts.json; tests/test_megatron_trainer.py asserts on it.

EP=2 runs with W4A16: with 2 ranks it is also data-parallel 2, which changes which tokens meet at an
expert and therefore the dynamic per-tensor activation scale of W4A4 (see models/fp4_linear.py).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mcore_common as common  # noqa: E402

LAYOUTS = [("TP2", {"tp": 2}, "w4a4"), ("PP2", {"pp": 2}, "w4a4"), ("EP2", {"ep": 2}, "w4a16"),
           ("TP2xEP2", {"tp": 2, "ep": 2}, "w4a4")]


def maxdiff(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def sharded_linear_check(config) -> dict:
    """Under TP=2 (+SP), FP4 linears on shards equal the codec on the full weight and input."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_qrl.models.fp4_linear import (FP4ColumnParallelLinear, FP4RowParallelLinear, QuantSettings,
                                                fp4_linear_class)
    from megatron_qrl.quant import nvfp4_dequantize, nvfp4_quantize

    r, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    g = torch.Generator().manual_seed(5)
    S, K, N = 8, 64, 48
    x = torch.randn(S, 2, K, generator=g) * torch.linspace(0.05, 3, K)
    x[0, 0, 7] = 9.0  # the global amax lives on rank 0's shard only
    w = torch.randn(N, K, generator=g) * 0.05
    w[N - 1, K - 1] = 0.9  # ... and the weight's on the last rank's shard
    q = lambda t: nvfp4_dequantize(*nvfp4_quantize(t), dtype=t.dtype)  # noqa: E731
    ref = q(x) @ q(w).t()
    kw = dict(config=config, init_method=torch.nn.init.zeros_, bias=False, skip_bias_add=True)
    out = {}
    col = fp4_linear_class(FP4ColumnParallelLinear, QuantSettings("nvfp4"))(K, N, gather_output=False, **kw)
    col.weight.data.copy_(w[r * N // tp:(r + 1) * N // tp])
    y, _ = col(x[r * S // tp:(r + 1) * S // tp])  # sequence-parallel input shard
    out["column_sp"] = maxdiff(y, ref[..., r * N // tp:(r + 1) * N // tp])
    row = fp4_linear_class(FP4RowParallelLinear, QuantSettings("nvfp4"))(K, N, input_is_parallel=True, **kw)
    row.weight.data.copy_(w[:, r * K // tp:(r + 1) * K // tp])
    y, _ = row(x[..., r * K // tp:(r + 1) * K // tp])  # K-sharded input; SP reduce-scatters the output
    out["row_sp"] = maxdiff(y, ref[r * S // tp:(r + 1) * S // tp])
    t = torch.tensor([max(out.values())])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {"max_abs_diff": float(t), "tp": tp}


def run_layout(name, layout, scheme, refdir: Path, outdir: Path) -> dict:
    import torch

    from megatron_qrl.trainer import Trainer

    ref = torch.load(refdir / f"ref_{scheme}.pt", weights_only=False)
    trainer = Trainer(common.make_cfg(scheme, **layout))
    trainer.load(refdir / f"init_{scheme}", load_optimizer=False)
    batch = common.make_batch()
    natural = {k: v for k, v in batch.items() if k != "r3_expert_ids"}
    res = {"scheme": scheme, "dp": trainer.dp_size,
           "logp_natural": maxdiff(trainer.logprobs(natural), ref["logp_natural"]),
           "logp_replay": maxdiff(trainer.logprobs(batch), ref["logp_replay"]),
           "logp_aqn": maxdiff(common.logprobs_with_aqn(trainer, batch), ref["logp_aqn"]),
           "aqn_changes_logp": maxdiff(ref["logp_aqn"], ref["logp_replay"])}
    losses = []
    for step in range(3):
        stats = trainer.train_step(batch, common.loss_fn)
        losses.append(stats["loss"])
        if step == 0:
            res["tokens_stat"] = stats["tokens"]
            res["router_agreement"] = stats.get("r3/router_agreement")
            res["ref_router_agreement"] = ref["stats_step1"].get("r3/router_agreement")
    lp3 = trainer.logprobs(batch)
    res["losses"], res["ref_losses"] = losses, ref["losses"][:3]
    res["loss_rel"] = max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"]))
    res["logp_after3"] = maxdiff(lp3, ref["logp_after3"])
    res["logp_after3_mean"] = float((lp3 - ref["logp_after3"]).abs().mean())
    res["update_effect_mean"] = float((ref["logp_after3"] - ref["logp_replay"]).abs().mean())
    if name == "TP2":
        res["sharded_linear"] = sharded_linear_check(trainer.config)
        trainer.save(outdir / "tp2_step3", {"data_position": 3})
        torch.save(lp3, outdir / "tp2_logp_after3.pt")
    return res


def checkpoint_tp2_to_tp1(refdir: Path, outdir: Path) -> dict:
    import torch

    from megatron_qrl.trainer import Trainer, read_manifest

    ref = torch.load(refdir / "ref_w4a4.pt", weights_only=False)
    trainer = Trainer(common.make_cfg("w4a4"))  # TP=1, data-parallel 2
    extra = trainer.load(outdir / "tp2_step3", load_optimizer=True)
    batch = common.make_batch()
    lp_tp2 = torch.load(outdir / "tp2_logp_after3.pt")
    res = {"extra_state": extra, "step": trainer.step, "manifest_layout": read_manifest(outdir / "tp2_step3")["layout"],
           "logp_vs_tp2": maxdiff(trainer.logprobs(batch), lp_tp2)}
    before = {k: v.detach().clone() for k, v in trainer.model[0].module.state_dict().items() if k.endswith("weight")}
    stats = trainer.train_step(batch, common.loss_fn)
    after = trainer.model[0].module.state_dict()
    res["loss4"], res["ref_loss4"] = stats["loss"], ref["losses"][3]
    res["lr"] = stats["lr"]
    # the 4th update (Adam moments and step restored from the TP=2 checkpoint) vs the reference's 4th update
    num = den = 0.0
    for k, v in before.items():
        mine = after[k] - v
        want = ref["params_after4"][k] - ref["params_after3"][k]
        num += float((mine - want).pow(2).sum())
        den += float(want.pow(2).sum())
    res["update4_rel_err"] = (num / den) ** 0.5
    res["weights_vs_ref_after3"] = max(maxdiff(v, ref["params_after3"][k]) for k, v in before.items())
    return res


def main() -> None:
    import time

    common.setup_threads()
    refdir, outdir = Path(sys.argv[1]), Path(sys.argv[2])
    outdir.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, layout, scheme in LAYOUTS:
        t0 = time.perf_counter()
        results[name] = run_layout(name, layout, scheme, refdir, outdir)
        results[name]["seconds"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    results["ckpt_tp2_to_tp1"] = checkpoint_tp2_to_tp1(refdir, outdir)
    results["ckpt_tp2_to_tp1"]["seconds"] = time.perf_counter() - t0
    if common.rank() == 0:
        common.write_json(outdir / "layouts.json", results)
    from megatron_qrl.platform import teardown

    teardown()


if __name__ == "__main__":
    main()
