"""Data-parallel RL statistics (2 gloo ranks via torchrun) equal the single-process result."""
import importlib.util
from pathlib import Path

import pytest
import torch

from launch_ranks import run_ranks

SCRIPT = Path(__file__).parent / "dist" / "rl_ais_dp.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("rl_ais_dp", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod



@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("rl_dp") / "result"
    run_ranks(2, SCRIPT, out, timeout=120)
    return [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(2)]


def test_dp_split_matches_single_process(ranks):
    mod = _load_script()
    single = mod.compute(mod.make_batch())
    r0, r1 = ranks
    cat = lambda key: torch.cat([r0[key], r1[key]])  # noqa: E731
    torch.testing.assert_close(cat("adv"), single["adv"], rtol=0, atol=1e-6)
    assert r0["ntok"] == r1["ntok"] == single["ntok"]
    for name, cfg in mod.METHOD_CFGS:
        key = name + ("_seq" if cfg.get("mis_level") == "sequence" else "")
        torch.testing.assert_close(cat(f"w_{key}"), single[f"w_{key}"], rtol=0, atol=1e-6)
        for stat, value in single[f"stats_{key}"].items():
            for r in (r0, r1):
                assert r[f"stats_{key}"][stat] == pytest.approx(value, rel=1e-9, abs=1e-12), (key, stat)
    assert 0 < single["stats_ais"]["ais/alpha"] < 1  # a non-trivial alpha is being compared
    assert single["stats_mis"]["is/masked_frac"] > 0 and single["stats_icepop"]["is/masked_frac"] > 0
    assert float(r0["loss"] + r1["loss"]) == pytest.approx(float(single["loss"]), abs=1e-6)
    torch.testing.assert_close(cat("grad"), single["grad"], rtol=0, atol=1e-7)
