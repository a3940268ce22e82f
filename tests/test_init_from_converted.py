"""An RL run starts from a converted Hugging Face checkpoint (docs/convert.md "Start an RL run from it"):
`qrl convert hf-to-mcore` -> `qrl train ... run.init_checkpoint=DST` with the checkpoint's `model` section; a config of
another shape is refused before start-up, naming the overrides that fix it."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("transformers")


def _qrl(*args):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "QRL_NO_PROGRESS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "QRL_FAULT_INJECT"):
        env.pop(k, None)
    return subprocess.run([sys.executable, "-m", "megatron_qrl.cli", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)


def test_rl_run_from_a_converted_hf_checkpoint(tmp_path):
    from test_convert_qwen3_moe import make_tiny_hf

    make_tiny_hf(tmp_path / "hf")
    r = _qrl("convert", "hf-to-mcore", tmp_path / "hf", tmp_path / "mcore")
    assert r.returncode == 0, r.stderr[-3000:]
    model = json.loads((tmp_path / "mcore" / "manifest.json").read_text())["model"]
    cfg = yaml.safe_load((ROOT / "configs/tiny_cpu.yaml").read_text())
    cfg["model"] = model                      # the converted model's shape
    cfg["trace"]["num_cached_layers"] = model["num_layers"]
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    common = [f"run.init_checkpoint={tmp_path / 'mcore'}", "run.sft_steps=0", "run.total_steps=1", "run.eval_every=0",
              "rollout.prompts_per_step=4", "rollout.group_size=4"]
    r = _qrl("train", "--config", tmp_path / "run.yaml", f"run.output_dir={tmp_path / 'run'}", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"from the weights of {tmp_path / 'mcore'}" in r.stderr
    assert (tmp_path / "run" / "checkpoints" / "step_000001" / "manifest.json").is_file()
    r = _qrl("train", "--config", ROOT / "configs/tiny_cpu.yaml", f"run.output_dir={tmp_path / 'other'}", *common)
    assert r.returncode == 2 and "holds a model of another shape" in r.stderr and "Traceback" not in r.stderr
    assert "set model.num_layers=2 model.hidden_size=64" in r.stderr
