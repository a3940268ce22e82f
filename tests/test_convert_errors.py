"""Bad conversion input fails before anything is written, with a message that names the problem and the fix;
a failure mid-way leaves neither the destination nor a temporary directory behind."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_qrl.convert import ConvertError, export_nvfp4, hf_to_mcore, mcore_to_hf
from megatron_qrl.trainer.checkpoint import CheckpointError
from test_convert_qwen3_moe import make_tiny_hf

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert_errors")
    make_tiny_hf(root / "hf", seed=5)
    return root / "hf"


@pytest.fixture(scope="module")
def checkpoint(source, tmp_path_factory):
    from megatron_qrl.platform import teardown

    ckpt = hf_to_mcore(source, tmp_path_factory.mktemp("convert_errors_ckpt") / "ckpt")
    yield ckpt
    teardown()


def variant(source: Path, tmp_path: Path, tensors=None, config=None) -> Path:
    """A copy of the source HF directory with edited tensors and/or config.json."""
    out = tmp_path / "hf_variant"
    shutil.copytree(source, out)
    if tensors is not None:
        state = load_file(str(out / "model.safetensors"))
        tensors(state)
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    if config is not None:
        data = json.loads((out / "config.json").read_text())
        config(data)
        (out / "config.json").write_text(json.dumps(data))
    return out


def nothing_written(dst: Path) -> bool:
    return not dst.exists() and not list(dst.parent.glob(f".{dst.name}.tmp-*"))


def expect_refusal(src, tmp_path, match, **kwargs):
    dst = tmp_path / "ckpt"
    with pytest.raises(ConvertError, match=match) as err:
        hf_to_mcore(src, dst, **kwargs)
    assert nothing_written(dst)
    return str(err.value)


def test_unknown_architecture(source, tmp_path):
    src = variant(source, tmp_path, config=lambda c: c.update(architectures=["LlamaForCausalLM"]))
    msg = expect_refusal(src, tmp_path, r"architectures=\['LlamaForCausalLM'\] is not supported")
    assert "Qwen3MoeForCausalLM" in msg


def test_missing_tensor(source, tmp_path):
    src = variant(source, tmp_path, tensors=lambda t: t.pop("model.layers.1.mlp.experts.7.down_proj.weight"))
    msg = expect_refusal(src, tmp_path, r"1 tensor\(s\) missing")
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in msg and "re-download" in msg


def test_extra_tensor(source, tmp_path):
    src = variant(source, tmp_path, tensors=lambda t: t.update({"model.layers.0.mlp.experts.8.up_proj.weight":
                                                                    torch.zeros(32, 64)}))
    msg = expect_refusal(src, tmp_path, r"1 unexpected tensor\(s\)")
    assert "experts.8.up_proj" in msg and "num_experts=8" in msg


def test_quantized_checkpoint(source, tmp_path):
    src = variant(source, tmp_path, tensors=lambda t: t.update({Q_PROJ.replace("weight", "weight_scale_inv"):
                                                                    torch.ones(1)}))
    expect_refusal(src, tmp_path, r"quantized \(FP8/FP4\) checkpoint: convert the BF16 release")


def test_shape_mismatch(source, tmp_path):
    src = variant(source, tmp_path, tensors=lambda t: t.update({Q_PROJ: torch.zeros(48, 64)}))
    msg = expect_refusal(src, tmp_path, "shape mismatch")
    assert f"{Q_PROJ} has [48, 64], expected [64, 64]" in msg


@pytest.mark.parametrize("edit,match", [
    (lambda c: c.update(norm_topk_prob=False), "norm_topk_prob"),
    (lambda c: c.update(mlp_only_layers=[1]), "every layer is an MoE layer"),
    (lambda c: c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}), "yarn"),
])
def test_unsupported_config_features(source, tmp_path, edit, match):
    expect_refusal(variant(source, tmp_path, config=edit), tmp_path, match)


def test_config_contradicting_the_checkpoint(source, tmp_path):
    msg = expect_refusal(source, tmp_path, "disagrees with the checkpoint", overrides=["model.num_layers=4"])
    assert "model.num_layers" in msg and "remove these fields" in msg


def test_existing_output(source, tmp_path):
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(ConvertError, match="already exists; choose a new path or remove it"):
        hf_to_mcore(source, tmp_path / "ckpt")


def test_index_naming_a_missing_shard(source, tmp_path):
    src = variant(source, tmp_path)
    (src / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {Q_PROJ: "model-00001-of-00002.safetensors"}}))
    expect_refusal(src, tmp_path, r"lists shard\(s\) \['model-00001-of-00002.safetensors'\]")


def test_failure_mid_way_leaves_nothing(source, tmp_path, monkeypatch):
    import megatron_qrl.convert.import_hf as import_hf

    def broken_save(model, cfg, directory, extra):
        (directory / "partial.bin").write_bytes(b"x")
        raise OSError("disk full")

    monkeypatch.setattr(import_hf, "save_model_checkpoint", broken_save)
    with pytest.raises(OSError, match="disk full"):
        hf_to_mcore(source, tmp_path / "ckpt")
    assert nothing_written(tmp_path / "ckpt")


def test_mcore_to_hf_needs_a_checkpoint(tmp_path):
    (tmp_path / "not_a_ckpt").mkdir()
    with pytest.raises(CheckpointError, match="no manifest.json"):
        mcore_to_hf(tmp_path / "not_a_ckpt", tmp_path / "out")
    with pytest.raises(ConvertError, match="does not exist or is not a directory"):
        mcore_to_hf(tmp_path / "missing", tmp_path / "out")
    assert nothing_written(tmp_path / "out")


def test_hf_config_of_another_model(checkpoint, tmp_path):
    make_tiny_hf(tmp_path / "other", num_experts=4)
    with pytest.raises(ConvertError, match=r"describes another model than the checkpoint: num_experts \(4 vs"):
        mcore_to_hf(checkpoint, tmp_path / "out", hf_config=str(tmp_path / "other"))
    assert nothing_written(tmp_path / "out")


def test_export_refusals(checkpoint, tmp_path):
    (tmp_path / "exists").mkdir()
    with pytest.raises(ConvertError, match="already exists"):
        export_nvfp4(checkpoint, tmp_path / "exists")
    with pytest.raises(ConvertError, match="--input-amax must be > 0"):
        export_nvfp4(checkpoint, tmp_path / "out", input_amax=0.0)
    with pytest.raises(ConvertError, match="calibration file .* does not exist"):
        export_nvfp4(checkpoint, tmp_path / "out", calib_tokens=str(tmp_path / "none.jsonl"))
    assert nothing_written(tmp_path / "out")


def test_cli_reports_errors_in_one_line(source, tmp_path, capsys):
    from megatron_qrl.cli import main

    (tmp_path / "taken").mkdir()
    assert main(["convert", "hf-to-mcore", str(source), str(tmp_path / "taken")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qrl convert hf-to-mcore: error: output") and "already exists" in err
    assert main(["export-nvfp4", str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    assert "qrl export-nvfp4: error: checkpoint" in capsys.readouterr().err
    # overrides may follow options (argparse alone would reject them as unrecognized)
    config = tmp_path / "run.yaml"
    config.write_text("quant:\n  targets: all_linears\n")
    assert main(["convert", "hf-to-mcore", str(source), str(tmp_path / "new"), "--config", str(config),
                 "model.num_layers=4"]) == 2
    assert "model.num_layers: " in capsys.readouterr().err and nothing_written(tmp_path / "new")
