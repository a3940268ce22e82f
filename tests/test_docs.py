"""Docs that are generated from code must match the code."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_configuration_reference_is_current():
    r = subprocess.run([sys.executable, "tools/gen_config_doc.py", "--check"], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr


def test_every_config_in_configs_dir_validates(tmp_path):
    """A recipe naming a model directory (model.hf_path, a placeholder the user edits) validates against a
    directory holding the release's config.json (tests/fixtures/<recipe>_config.json)."""
    import shutil

    import yaml

    from megatron_qrl.config import load_config

    files = sorted((ROOT / "configs").glob("*.yaml"))
    assert files, "configs/ holds no YAML files"
    for f in files:
        overrides = []
        if (yaml.safe_load(f.read_text()).get("model") or {}).get("hf_path"):
            model_dir = tmp_path / f.stem
            model_dir.mkdir()
            shutil.copy(ROOT / "tests" / "fixtures" / f"{f.stem}_config.json", model_dir / "config.json")
            overrides = [f"model.hf_path={model_dir}"]
        load_config(f, overrides)
