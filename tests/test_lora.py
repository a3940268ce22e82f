"""QeRL mode (lora.enabled): LoRA adapters on a frozen packed-FP4 base, in the trainer and the embedded engine.

In-process (one rank): only adapters train and hold optimizer state; the base bytes never change across
steps (hash) and the engine runs the very same base tensors; after each adapters-only sync the engine's
log-probs equal the trainer's forward; the LoRA linear equals dequant(W) x + s B A x with the same
gradients. Two gloo ranks (tests/dist/lora_tp.py): TP=2 (+ sequence parallel) matches one process. The RL
loop runs 2 steps with lora.enabled on the tiny config.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_qrl.config import ConfigError, load_config

from launch_ranks import run_ranks

ROOT = Path(__file__).resolve().parents[1]
DIST = Path(__file__).parent / "dist"
TINY = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.num_query_groups=2",
        "model.num_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=64", "model.vocab_size=64",
        "model.max_sequence_length=48", "model.init_method_std=0.1", "rollout.max_new_tokens=8"]
LORA = ["lora.enabled=true", "lora.rank=4", "lora.alpha=8", "quant.targets=all_linears", "quant.scheme=w4a16",
        "rollout.scheme=w4a16", "trace.enabled=false", "trainer.lr=2e-2", "trainer.micro_batch_size=4",
        "aqn.enabled=false"]
# the engine's cached attention vs the trainer's full forward, fp32: round-off only
LOGP_ATOL = 5e-5


def make_batch(B=4, T=24, seed=3):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 64, (B, T), generator=g)
    loss_mask = torch.ones(B, T)
    loss_mask[:, :6] = 0
    return {"tokens": tokens, "loss_mask": loss_mask, "advantages": torch.tensor([1.0, -0.5, 0.25, -1.0])[:B]}


def loss_fn(logp, mb):
    w = 1.0 + mb["advantages"][:, None]
    return -(w * logp * mb["loss_mask"]).sum() / mb["num_global_tokens"], {}


def engine_logprobs(engine, batch, prompt_len=6):
    prompts = [row[:prompt_len].tolist() for row in batch["tokens"]]
    responses = [row[prompt_len:].tolist() for row in batch["tokens"]]
    return torch.stack(engine.score(prompts, responses))


@pytest.fixture(scope="module")
def run():
    """One trainer + engine, 3 adapter-only syncs around 2 train steps; everything the tests assert on."""
    from megatron_qrl.models.lora import lora_linears
    from megatron_qrl.pipeline.sync.lora import base_digests
    from megatron_qrl.pipeline.sync import sync_weights
    from megatron_qrl.platform import teardown
    from megatron_qrl.rollout.embedded import EmbeddedEngine
    from megatron_qrl.trainer import Trainer

    cfg = load_config(None, TINY + LORA)
    torch.manual_seed(0)
    trainer = Trainer(cfg)
    engine = EmbeddedEngine(cfg)
    batch = make_batch()
    out = {"trainer": trainer, "engine": engine, "cfg": cfg, "syncs": [], "engine_logp": [], "trainer_logp": [],
           "base": [base_digests(trainer.unwrapped)]}
    for step in range(3):
        out["syncs"].append(sync_weights(engine, trainer, cfg, step, version=step))
        out["engine_logp"].append(engine_logprobs(engine, batch))
        out["trainer_logp"].append(trainer.logprobs(batch)[:, 6:])
        if step < 2:
            trainer.train_step(batch, loss_fn)
            out["base"].append(base_digests(trainer.unwrapped))
    out["shared"] = all(a.base_packed.data_ptr() == b.base_packed.data_ptr()
                        for a, b in zip(lora_linears(trainer.unwrapped), lora_linears(engine.model)))
    yield out
    teardown()


def test_only_adapters_get_gradients_and_optimizer_state(run):
    from megatron_qrl.models.lora import lora_linears

    trainer = run["trainer"]
    model = trainer.unwrapped[0]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith((".lora_A", ".lora_B")) for n in trainable)
    assert len(trainable) == 2 * len(list(lora_linears(model)))
    opt_params = [p for o in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
                  for g in o.optimizer.param_groups for p in g["params"]]
    trainable_params = {id(p) for p in model.parameters() if p.requires_grad}
    # Megatron's optimizer may hold fp32 main copies; count them by shape against the adapters
    assert len(opt_params) == len(trainable_params)
    states = [st for o in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
              for st in o.optimizer.state.values()]
    assert len(states) == len(trainable_params) and all("exp_avg" in st for st in states)
    for lin in lora_linears(model):  # FP4 base: no weight parameter at all, uint8 buffers only
        assert lin.weight is None and lin.base_packed.dtype == torch.uint8 and not lin.base_packed.requires_grad


def test_frozen_base_bytes_never_change_and_engine_shares_them(run):
    assert len(run["base"]) == 3 and len(run["base"][0]) > 0
    assert run["base"][0] == run["base"][1] == run["base"][2]
    assert run["shared"]  # colocated: one copy of the packed base for trainer and engine
    assert all(s["sync/base_ok"] == 1.0 and s["sync/hash_ok"] == 1.0 for s in run["syncs"])


def test_adapter_only_sync_makes_engine_equal_trainer_forward(run):
    syncs = run["syncs"]
    n_adapters = sum(1 for n, p in run["trainer"].unwrapped[0].named_parameters() if p.requires_grad)
    assert syncs[0]["sync/tensors"] > n_adapters            # first sync: every parameter once
    assert syncs[1]["sync/tensors"] == syncs[2]["sync/tensors"] == n_adapters
    assert syncs[1]["sync/bytes"] < syncs[0]["sync/bytes"]
    for e, t in zip(run["engine_logp"], run["trainer_logp"]):
        assert float((e - t).abs().max()) < LOGP_ATOL
    # the adapters moved the policy: each step changes the engine's log-probs far beyond the tolerance
    for before, after in zip(run["engine_logp"], run["engine_logp"][1:]):
        assert float((after - before).abs().max()) > 100 * LOGP_ATOL


def test_lora_linear_equals_dequantized_base_plus_low_rank(run):
    """Forward and gradients of one LoRA linear against plain autograd on dequant(W) + s * B @ A."""
    from megatron_qrl.models.lora import lora_linears

    lin = next(lin for lin in lora_linears(run["trainer"].unwrapped) if lin.lora_rank and lin.column)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        lin.lora_B.copy_(torch.randn(lin.lora_B.shape, generator=g) * 0.1)
    w = lin.base_weight(torch.float32).detach()
    x = torch.randn(5, 2, w.shape[1], generator=g, requires_grad=True)
    y, _ = lin(x)
    A, B = lin.lora_A.detach().clone().requires_grad_(), lin.lora_B.detach().clone().requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    ref = x2 @ w.t() + lin.lora_scale * (x2 @ A.t()) @ B.t()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    gy = torch.randn(y.shape, generator=g)
    # Megatron's DDP hook moves each .grad into the parameter's main_grad buffer: read the increment there
    # (after an optimizer step .grad still aliases main_grad until the next train_step's zero_grad)
    lin.lora_A.grad = lin.lora_B.grad = None
    before = [lin.lora_A.main_grad.clone(), lin.lora_B.main_grad.clone()]
    y.backward(gy)
    ref.backward(gy)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin.lora_A.main_grad - before[0], A.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin.lora_B.main_grad - before[1], B.grad, rtol=1e-5, atol=1e-5)
    assert float(B.grad.abs().max()) > 0 and float(A.grad.abs().max()) > 0


@pytest.mark.parametrize("overrides,needle", [
    (["lora.enabled=true", "lora.base_format=mxfp4"], "must equal rollout.weights"),
    (["lora.enabled=true", "lora.base_format=bf16", "rollout.weights=bf16", "trace.enabled=false"], "quant.qat=false"),
    (["lora.target_modules=[linear_qkv,q_proj]"], "unknown names"),
    (["lora.dropout=0.1"], "must be 0"),
    (["lora.enabled=true", "rollout.placement=disaggregated"], "rollout.placement=colocated"),
])
def test_config_cross_checks(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(ROOT / "configs/tiny_cpu.yaml", overrides)



def _torchrun(nproc: int, *args) -> None:
    run_ranks(nproc, DIST / "lora_tp.py", *args, timeout=600)


def test_tensor_parallel_2_matches_one_process(tmp_path):
    _torchrun(1, "ref", tmp_path)
    _torchrun(2, "tp2", tmp_path)
    res = json.loads((tmp_path / "tp2.json").read_text())
    assert res["tp"] == 2 and res["sequence_parallel"]
    assert res["logp_init"] < 1e-5            # same weights (loaded from the TP=1 checkpoint): reduction order only
    assert res["loss_rel"] < 1e-5             # losses of 2 optimizer steps, each before its update
    assert res["logp_after"] < 1e-4           # after 2 adapter updates
    assert res["adapters_moved"] > 1e-3       # the steps did change the adapters' output


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_rl_loop_runs_two_steps_with_lora(tmp_path, decode):
    """The RL loop in QeRL mode on both decode paths (static: the step the GPU captures as CUDA graphs)."""
    args = ["--config", str(ROOT / "configs/tiny_cpu.yaml"), f"run.output_dir={tmp_path}", "run.total_steps=2",
            "run.eval_every=0", "run.sft_steps=0", "run.wandb_mode=disabled", "rollout.prompts_per_step=2",
            "rollout.group_size=4", "rollout.max_new_tokens=8", "trainer.micro_batch_size=8", "lora.enabled=true",
            "lora.rank=8", f"rollout.decode={decode}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "QRL_NO_PROGRESS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, "-m", "megatron_qrl.launch.train", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1]
    assert all(m["sync/hash_ok"] == 1.0 and m["sync/base_ok"] == 1.0 for m in metrics)
    assert metrics[1]["sync/tensors"] < metrics[0]["sync/tensors"]  # adapters only after the first sync
    assert all(torch.isfinite(torch.tensor(m["train/loss"])) for m in metrics)
    assert (tmp_path / "checkpoints" / "latest").is_file()
