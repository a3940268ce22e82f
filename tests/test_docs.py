"""Docs that are generated from code must match the code."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_configuration_reference_is_current():
    r = subprocess.run([sys.executable, "tools/gen_config_doc.py", "--check"], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr


def test_every_config_in_configs_dir_validates():
    from megatron_qrl.config import load_config

    files = sorted((ROOT / "configs").glob("*.yaml"))
    assert files, "configs/ holds no YAML files"
    for f in files:
        load_config(f)
