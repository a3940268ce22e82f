"""Qwen3-MoE HF <-> Megatron conversion on a tiny random model (2 layers, hidden 64, 4 q / 2 kv heads of 16,
8 experts top-2, moe_intermediate 32, vocab 64), all on CPU in fp32.

- hf-to-mcore, then Trainer.load (QAT off) -> logits equal HF's eager forward within LOGITS_ATOL;
- our mapping equals ModelOpt's own importer (import_mcore_gpt_from_hf) parameter for parameter;
- mcore-to-hf gives back every tensor bit for bit (fp32 and bf16 sources) and the same config.json;
- sharded output (small --max-shard-size) loads in transformers with identical logits;
- the converted checkpoint loads at TP=2 (2 gloo ranks) with the single-process log-probs.
"""
import json
import sys
from pathlib import Path

import pytest
import torch

from launch_ranks import run_ranks

# fp32 everywhere. HF and Megatron compute the same function with different kernels: RoPE's cos/sin
# (HF builds them per call from position ids, Megatron caches its frequency table), attention (eager
# matmul+softmax vs Megatron's baddbmm with the scale folded in), and the router (HF: softmax over all
# experts then top-k and renormalise; Megatron: top-k on logits then softmax over the k) all round
# differently, so logits differ by float32 round-off (observed ~1e-6), never more.
LOGITS_ATOL = 1e-4
LOGP_ATOL_TP2 = 1e-5  # same Megatron model, TP=2 vs one process: reduction order only

TINY_HF = dict(vocab_size=64, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
               norm_topk_prob=True, max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-6,
               tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[])


def make_tiny_hf(path: Path, dtype=torch.float32, seed: int = 0, **config):
    """Save a random Qwen3MoeForCausalLM; weights std 0.2 and norms 1 +- 0.2 so every tensor matters."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**TINY_HF, **config}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    model = model.to(dtype)
    model.save_pretrained(str(path))
    return model


def tokens(batch: int = 3, length: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY_HF["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    model.config._attn_implementation = "eager"
    model.eval()
    with torch.no_grad():
        return model(ids).logits.float()


def mcore_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1])[None].expand_as(ids), None).float()


def qat_off(ckpt: Path):
    """Run config of a converted checkpoint with fake quantization off (the model computes in fp32)."""
    from megatron_qrl.config import from_dict

    manifest = json.loads((ckpt / "manifest.json").read_text())
    return from_dict({"model": manifest["model"], "quant": {"format": "bf16", "qat": False},
                      "trace": {"enabled": False}, "trainer": {"micro_batch_size": 3}})


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(HF model, HF dir, converted checkpoint dir)."""
    from megatron_qrl.convert import hf_to_mcore
    from megatron_qrl.platform import teardown

    root = tmp_path_factory.mktemp("qwen3moe")
    hf_model = make_tiny_hf(root / "hf")
    ckpt = hf_to_mcore(root / "hf", root / "ckpt")
    yield hf_model, root / "hf", ckpt
    teardown()


@pytest.fixture(scope="module")
def trainer(converted):
    """Our Trainer (fp32, QAT off) with the converted checkpoint loaded."""
    from megatron_qrl.trainer import Trainer

    t = Trainer(qat_off(converted[2]))
    t.load(str(converted[2]), load_optimizer=False)
    return t


def test_checkpoint_is_a_trainer_checkpoint(converted):
    manifest = json.loads((converted[2] / "manifest.json").read_text())
    assert manifest["format"] == "megatron-qrl-dist-ckpt-v1" and manifest["contents"] == ["model"]
    assert manifest["params_dtype"] == "float32"
    assert manifest["model"]["num_experts"] == 8 and manifest["model"]["kv_channels"] == 16
    assert json.loads((converted[2] / "hf_config.json").read_text()) == \
        json.loads((converted[1] / "config.json").read_text())


def test_logits_match_hf(converted, trainer):
    hf_model, _, _ = converted
    ids = tokens()
    ours, theirs = mcore_logits(trainer.unwrapped[0], ids), hf_logits(hf_model, ids)
    diff = (ours - theirs).abs().max().item()
    print(f"max |logit diff| Megatron vs HF: {diff:.3e} (logit scale {theirs.abs().max().item():.2f})")
    assert diff < LOGITS_ATOL


def test_mapping_equals_modelopt_importer(converted, trainer):
    """ModelOpt's import_mcore_gpt_from_hf fills a fresh model of our spec with the same tensors."""
    from modelopt.torch.export import import_mcore_gpt_from_hf

    from megatron_qrl.models import build_model

    fresh = build_model(qat_off(converted[2]))[0]
    import_mcore_gpt_from_hf(fresh, str(converted[1]), dtype=torch.float32)
    ours = dict(trainer.unwrapped[0].named_parameters())
    theirs = dict(fresh.named_parameters())
    assert set(ours) == set(theirs)
    assert [n for n in ours if not torch.equal(ours[n], theirs[n])] == []


def _hf_tensors(directory: Path) -> dict:
    from megatron_qrl.convert.safetensors_io import SafetensorsReader

    with SafetensorsReader(directory) as r:
        return {n: r.get(n).clone() for n in r.names()}


def assert_same_tensors(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    bad = [n for n in a if a[n].dtype != b[n].dtype or not torch.equal(a[n], b[n])]
    assert bad == [], f"{len(bad)} tensors differ, e.g. {bad[:3]}"


def test_round_trip_is_bit_exact(converted, tmp_path):
    from megatron_qrl.convert import mcore_to_hf

    _, hf_dir, ckpt = converted
    out = mcore_to_hf(ckpt, tmp_path / "hf_back")
    assert_same_tensors(_hf_tensors(hf_dir), _hf_tensors(out))
    assert json.loads((out / "config.json").read_text()) == json.loads((hf_dir / "config.json").read_text())


def test_bf16_round_trip_keeps_bf16(tmp_path):
    from megatron_qrl.convert import hf_to_mcore, mcore_to_hf

    make_tiny_hf(tmp_path / "hf", dtype=torch.bfloat16, seed=3)
    ckpt = hf_to_mcore(tmp_path / "hf", tmp_path / "ckpt")
    assert json.loads((ckpt / "manifest.json").read_text())["params_dtype"] == "bfloat16"
    out = mcore_to_hf(ckpt, tmp_path / "back")
    theirs = _hf_tensors(out)
    assert {t.dtype for t in theirs.values()} == {torch.bfloat16}
    assert_same_tensors(_hf_tensors(tmp_path / "hf"), theirs)


def test_tied_embeddings(tmp_path):
    """tie_word_embeddings: HF saves no lm_head, Megatron shares the embedding as output layer."""
    from megatron_qrl.convert import hf_to_mcore, mcore_to_hf
    from megatron_qrl.convert.mcore_io import load_model_checkpoint
    from megatron_qrl.models import build_model

    hf_model = make_tiny_hf(tmp_path / "hf", seed=7, tie_word_embeddings=True)
    assert "lm_head.weight" not in _hf_tensors(tmp_path / "hf")
    ckpt = hf_to_mcore(tmp_path / "hf", tmp_path / "ckpt")
    model = build_model(qat_off(ckpt))[0]
    load_model_checkpoint(model, ckpt)
    ids = tokens(seed=2)
    assert (mcore_logits(model, ids) - hf_logits(hf_model, ids)).abs().max().item() < LOGITS_ATOL
    assert_same_tensors(_hf_tensors(tmp_path / "hf"), _hf_tensors(mcore_to_hf(ckpt, tmp_path / "back")))


def test_sharded_output_loads_in_transformers(converted, tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron_qrl.convert import mcore_to_hf

    hf_model, _, ckpt = converted
    out = mcore_to_hf(ckpt, tmp_path / "sharded", max_shard_size="40KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    assert not list(out.glob("*.partial"))
    reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ids = tokens(seed=5)
    assert torch.equal(hf_logits(reloaded, ids), hf_logits(hf_model, ids))


def test_generated_config_without_source_config(converted, tmp_path):
    """A checkpoint without the stored HF config (e.g. written by Trainer.save) gets a generated one."""
    import shutil

    from transformers import AutoConfig

    from megatron_qrl.convert import mcore_to_hf

    _, hf_dir, ckpt = converted
    bare = tmp_path / "bare"
    shutil.copytree(ckpt, bare)
    (bare / "hf_config.json").unlink()
    out = mcore_to_hf(bare, tmp_path / "out", dtype="float32")
    cfg = AutoConfig.from_pretrained(str(out))
    assert cfg.architectures == ["Qwen3MoeForCausalLM"] and cfg.head_dim == 16 and cfg.num_experts == 8
    assert_same_tensors(_hf_tensors(hf_dir), _hf_tensors(out))


# ------------------------------------------------------------------------------ TP=2 (2 gloo ranks)

def test_loads_at_tp2(converted, trainer, tmp_path):
    batch = {"tokens": tokens()}
    reference = trainer.logprobs(batch)
    out = tmp_path / "tp2.pt"
    run_ranks(2, __file__, converted[2], out, timeout=300)
    diff = (torch.load(out) - reference).abs().max().item()
    print(f"TP=2 vs one process, max |log-prob diff|: {diff:.2e}")
    assert diff < LOGP_ATOL_TP2


def _tp2_worker(ckpt: str, out: str) -> None:
    """torchrun entry: Trainer at TP=2 (sequence parallel) loads the converted checkpoint; rank 0 saves log-probs."""
    import torch.distributed as dist

    from megatron_qrl.platform import teardown
    from megatron_qrl.trainer import Trainer

    cfg = qat_off(Path(ckpt))
    cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"tensor_parallel": 2})})
    t = Trainer(cfg)
    t.load(ckpt, load_optimizer=False)
    logp = t.logprobs({"tokens": tokens()})
    if dist.get_rank() == 0:
        torch.save(logp, out)
    teardown()


if __name__ == "__main__":
    _tp2_worker(sys.argv[1], sys.argv[2])
