"""A Hugging Face model directory through the whole job (issue 26), on a tiny Qwen3-MoE (tests/hf_model_dir.py).

- `model.hf_path` weights land in the trainer exactly: log-probs equal transformers' forward in one process
  (Qwen3-MoE and dense Qwen3) and under TP=2, PP=2, EP=2 (2 gloo ranks); dense Qwen3 round-trips and trains;
- `qrl train` runs 2 RL steps (SFT warm start, chat template with a system prompt, GSM8K file, TRACE + R3,
  eval) from the directory alone, then `qrl export-nvfp4` of its checkpoint gives a directory that
  transformers loads as it is (tokenizer, chat template, generation config, config), whose NVFP4 weights,
  dequantized by ModelOpt, give the trainer's W4A16 logits;
- bad input stops `qrl train` with a message naming the problem before anything is written.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_model_dir import make_hf_model_dir, write_gsm8k
from launch_ranks import run_ranks

ROOT = Path(__file__).resolve().parents[1]
# fp32, same function, different kernels (RoPE tables, attention, router softmax order): see
# test_convert_qwen3_moe.py. Log-probs of the tiny model differ by ~1e-6.
LOGP_ATOL = 1e-4
# export vs trainer, both W4A16 (the same FP4 weights, activations unquantized): the exported bytes dequantize
# to exactly the trainer's fake-quantized weights (test_convert_nvfp4_export.py), so only the kernel
# differences above remain.
EXPORT_LOGITS_ATOL = 1e-4
SYSTEM = "You are a helpful math assistant."


def _env():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "QRL_NO_PROGRESS": "1", "WANDB_MODE": "offline"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def qrl(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "megatron_qrl.cli", *map(str, args)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def write_config(path: Path, hf_dir: Path, data: Path, out: Path) -> Path:
    """A run config that names the model only by its directory (no architecture fields)."""
    path.write_text(f"""
model:
  hf_path: {hf_dir}
data:
  task: gsm8k
  path: {data}
  eval_size: 4
  system_prompt: {SYSTEM}
trainer:
  micro_batch_size: 4
  use_distributed_optimizer: false
rollout:
  prompts_per_step: 2
  group_size: 2
  max_new_tokens: 8
run:
  output_dir: {out}
  total_steps: 2
  sft_steps: 1
  eval_every: 2
  checkpoint_every: 2
  wandb_mode: disabled
""")
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("hfjob")
    hf = make_hf_model_dir(root / "hf")
    return root, hf, write_gsm8k(root / "gsm8k.jsonl")


def _tokens(seed=1, batch=3, length=20):
    return torch.randint(0, 300, (batch, length), generator=torch.Generator().manual_seed(seed))


def hf_logprobs(hf_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' log p(tokens[t] | tokens[:t]) in the trainer's alignment (position 0 = 0)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        logp = torch.log_softmax(model(tokens).logits.float(), dim=-1)
    out = torch.zeros(tokens.shape)
    out[:, 1:] = logp[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    return out


@pytest.fixture(scope="module")
def dense_dir(model_dir):
    return make_hf_model_dir(model_dir[0] / "dense", seed=3, dense=True)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_dense"])
def test_hf_path_weights_equal_transformers(model_dir, dense_dir, family):
    from megatron_qrl.config import from_dict
    from megatron_qrl.convert.load_hf import load_hf_weights
    from megatron_qrl.platform import teardown
    from megatron_qrl.trainer import Trainer

    hf = model_dir[1] if family == "qwen3_moe" else dense_dir
    cfg = from_dict({"model": {"hf_path": str(hf)}, "quant": {"format": "bf16", "qat": False},
                     "trace": {"enabled": False}, "trainer": {"micro_batch_size": 3}})
    assert cfg.model.num_experts == (4 if family == "qwen3_moe" else 0)
    try:
        trainer = Trainer(cfg)
        before = trainer.logprobs({"tokens": _tokens()})
        assert load_hf_weights(trainer, hf) == len(list(trainer.unwrapped[0].parameters()))
        ours = trainer.logprobs({"tokens": _tokens()})
    finally:
        teardown()
    theirs = hf_logprobs(hf, _tokens())
    assert (before - theirs).abs().max() > 0.1   # the random init is far from the HF weights
    assert (ours - theirs).abs().max() < LOGP_ATOL


def test_hf_path_weights_under_tp_pp_ep(model_dir):
    root, hf, _ = model_dir
    out = root / "layouts"
    out.mkdir()
    torch.save(_tokens(seed=4, batch=4), out / "tokens.pt")
    run_ranks(2, ROOT / "tests/dist/hf_weights_layouts.py", hf, out, timeout=600)
    theirs = hf_logprobs(hf, _tokens(seed=4, batch=4))
    for layout in ("tp2", "pp2", "ep2"):
        diff = (torch.load(out / f"logp_{layout}.pt") - theirs).abs().max().item()
        assert diff < LOGP_ATOL, (layout, diff)


@pytest.fixture(scope="module")
def trained(model_dir):
    root, hf, data = model_dir
    out = root / "run"
    r = qrl("train", "--config", write_config(root / "run.yaml", hf, data, out))
    assert r.returncode == 0, r.stderr[-4000:]
    return out


def test_train_from_a_model_directory(model_dir, trained):
    _, hf, _ = model_dir
    metrics = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1]
    assert all(m["sync/hash_ok"] == 1.0 for m in metrics)
    assert "eval/accuracy" in metrics[-1] and metrics[-1]["eval/num_prompts"] == 4
    # response lengths are counted in tokens of the model's tokenizer, at most max_new_tokens
    assert all(0 < m["response/len_mean"] <= 8 for m in metrics)
    saved = (trained / "config.yaml").read_text()
    assert f"hf_path: {hf}" in saved and "vocab_size: 320" in saved and "num_experts: 4" in saved
    manifest = json.loads((trained / "checkpoints/step_000002/manifest.json").read_text())
    assert manifest["model"]["hf_path"] == str(hf) and manifest["model"]["vocab_size"] == 320
    # `qrl eval` reloads the saved config: the same directory, tokenizer and chat template
    r = qrl("eval", trained / "checkpoints/step_000002", "--out", trained / "eval.json")
    assert r.returncode == 0, r.stderr[-4000:]
    result = json.loads((trained / "eval.json").read_text())
    assert result["task"] == "gsm8k" and result["eval/num_prompts"] == 4


def test_export_loads_in_transformers_with_the_trainers_logits(model_dir, trained, tmp_path):
    from modelopt.torch.quantization.qtensor import NVFP4QTensor
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from megatron_qrl.convert.export_hf import checkpoint_config, load_checkpoint_model
    from megatron_qrl.convert.safetensors_io import SafetensorsReader
    from megatron_qrl.platform import teardown

    _, hf, _ = model_dir
    ckpt, out = trained / "checkpoints/step_000002", tmp_path / "nvfp4"
    # --dtype float32: the unquantized tensors (embeddings, norms, attention, router) as the fp32 trainer has them
    r = qrl("export-nvfp4", ckpt, out, "--calib-samples", 2, "--calib-seq-len", 16, "--dtype", "float32")
    assert r.returncode == 0, r.stderr[-4000:]
    # the directory as it is: tokenizer, chat template and generation config of the source model
    tok, src = AutoTokenizer.from_pretrained(str(out), local_files_only=True), \
        AutoTokenizer.from_pretrained(str(hf), local_files_only=True)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 3 plus 4?"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        src.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok("Weng earns $12").input_ids == src("Weng earns $12").input_ids
    eos = GenerationConfig.from_pretrained(str(out)).eos_token_id
    assert eos == GenerationConfig.from_pretrained(str(hf)).eos_token_id == [2, 0]
    config = AutoConfig.from_pretrained(str(out), local_files_only=True)
    assert config.quantization_config["quant_method"] == "modelopt"
    # transformers cannot run pre-quantized NVFP4 on CPU: dequantize with ModelOpt, load into the HF model
    with SafetensorsReader(out) as reader:
        stored = {n: reader.get(n) for n in reader.names()}
    state = {}
    for name, t in stored.items():
        if name.endswith((".weight_scale", ".weight_scale_2", ".input_scale")):
            continue
        if t.dtype == torch.uint8:
            module = name.removesuffix(".weight")
            q = NVFP4QTensor(torch.Size((t.shape[0], t.shape[1] * 2)), torch.float32, t)
            t = q.dequantize(dtype=torch.float32, scale=stored[f"{module}.weight_scale"],
                             double_scale=stored[f"{module}.weight_scale_2"], block_sizes={-1: 16})
        state[name] = t.float()
    # the export's own files, its weights dequantized (transformers fuses the experts' tensors on loading)
    plain = tmp_path / "dequantized"
    shutil.copytree(out, plain, ignore=shutil.ignore_patterns("*.safetensors", "hf_quant_config.json"))
    config_json = json.loads((out / "config.json").read_text())
    del config_json["quantization_config"]
    (plain / "config.json").write_text(json.dumps(config_json))
    save_file(state, str(plain / "model.safetensors"), metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(str(plain), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    ids = tok(["What is 3 plus 4? The answer is 7.", "Natalia sold clips to 48 of her friends"],
              padding="longest", return_tensors="pt").input_ids[:, :12]
    with torch.no_grad():
        theirs = model(ids).logits.float()
    try:
        cfg = checkpoint_config(ckpt, overrides=["quant.scheme=w4a16"])
        _, ours_model = load_checkpoint_model(ckpt, cfg)
        with torch.no_grad():
            ours = ours_model(ids, torch.arange(ids.shape[1])[None].expand_as(ids), None).float()
    finally:
        teardown()
    diff = (ours - theirs).abs().max().item()
    print(f"max |logit diff| export (transformers) vs trainer W4A16: {diff:.2e}")
    assert diff < EXPORT_LOGITS_ATOL
    # the weights moved during training: the export is not simply the source directory
    with SafetensorsReader(hf) as reader:
        assert not torch.equal(reader.get("model.norm.weight").float(), state["model.norm.weight"])


def test_dense_qwen3_round_trip_and_rl_steps(dense_dir, model_dir, tmp_path):
    """Dense Qwen3: hf-to-mcore -> mcore-to-hf is bit exact (tokenizer carried inside the checkpoint, so the
    source may be gone), and `qrl train` runs RL steps from the directory (all linears in FP4)."""
    from megatron_qrl.convert import hf_to_mcore, mcore_to_hf
    from megatron_qrl.convert.safetensors_io import SafetensorsReader
    from megatron_qrl.platform import teardown

    src = tmp_path / "src"
    shutil.copytree(dense_dir, src)
    # a run recipe as --config: its model.hf_path (here a directory that does not exist) is not the source
    recipe = write_config(tmp_path / "recipe.yaml", tmp_path / "nowhere", model_dir[2], tmp_path / "unused")
    try:
        ckpt = hf_to_mcore(src, tmp_path / "ckpt", config=str(recipe))
        shutil.rmtree(src)
        back = mcore_to_hf(ckpt, tmp_path / "back")
    finally:
        teardown()
    with SafetensorsReader(dense_dir) as a, SafetensorsReader(back) as b:
        assert set(a.names()) == set(b.names()) and "lm_head.weight" not in a.names()
        assert all(torch.equal(a.get(n), b.get(n)) for n in a.names())
    assert json.loads((back / "config.json").read_text()) == json.loads((dense_dir / "config.json").read_text())
    assert {"tokenizer.json", "chat_template.jinja", "generation_config.json"} <= {p.name for p in back.iterdir()}
    out = tmp_path / "run"
    r = qrl("train", "--config", write_config(tmp_path / "dense.yaml", dense_dir, model_dir[2], out),
            "quant.targets=all_linears", "run.total_steps=1", "run.checkpoint_every=0", "run.eval_every=0")
    assert r.returncode == 0, r.stderr[-4000:]
    metrics = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert metrics["sync/hash_ok"] == 1.0 and metrics["sync/bytes"] > 0


def test_mcore_to_hf_carries_the_tokenizer(model_dir, trained, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, hf, _ = model_dir
    r = qrl("convert", "mcore-to-hf", trained / "checkpoints/step_000002", tmp_path / "bf16", "--dtype", "float32")
    assert r.returncode == 0, r.stderr[-4000:]
    files = {p.name for p in (tmp_path / "bf16").iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"} <= files
    assert AutoTokenizer.from_pretrained(str(tmp_path / "bf16"), local_files_only=True).chat_template
    AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"), local_files_only=True)


# ------------------------------------------------------------------------------------------- bad input
def _without_tokenizer(d: Path) -> list[str]:
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (d / f).unlink()
    return []


def _unsupported_architecture(d: Path) -> list[str]:
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}))
    return []


BAD_INPUTS = {
    "missing tokenizer files": (_without_tokenizer, "has no tokenizer files"),
    "tokenizer vocab larger than the model's": (lambda d: [], "more than model.vocab_size (280)"),
    "unsupported architecture": (_unsupported_architecture, "Qwen2ForCausalLM"),
    "chat_template=true without a template": (lambda d: ["data.chat_template=true", "data.system_prompt=null"],
                                              "has no chat template"),
    "prompt longer than the context": (lambda d: ["model.max_sequence_length=40", "rollout.max_new_tokens=16"],
                                       "too long for the model's context"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_refused_before_anything_is_written(model_dir, tmp_path, case):
    root, hf, data = model_dir
    edit, message = BAD_INPUTS[case]
    d = tmp_path / "hf"
    if case == "tokenizer vocab larger than the model's":
        make_hf_model_dir(d, vocab_size=280)
    elif case == "chat_template=true without a template":
        make_hf_model_dir(d, chat_template=None)
    else:
        shutil.copytree(hf, d)
    overrides = edit(d)
    out = tmp_path / "run"
    r = qrl("train", "--config", write_config(tmp_path / "run.yaml", d, data, out), *overrides, timeout=300)
    assert r.returncode != 0 and message in r.stderr, r.stderr[-3000:]
    assert not out.exists()
