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
    assert r0["ntok"] == r1["ntok"] == single["ntok"] and r0["nseq"] == r1["nseq"] == single["nseq"]
    for name, cfg in mod.METHOD_CFGS:
        key = mod.key_of(name, cfg)
        assert set(r0[f"stats_{key}"]) == set(single[f"stats_{key}"]), key
        torch.testing.assert_close(cat(f"w_{key}"), single[f"w_{key}"], rtol=0, atol=1e-6)
        for stat, value in single[f"stats_{key}"].items():
            for r in (r0, r1):
                assert r[f"stats_{key}"][stat] == pytest.approx(value, rel=1e-9, abs=1e-12), (key, stat)
    # non-trivial values are being compared: alpha strictly inside (0, 1), masks that drop something
    for level in ("token", "seq", "geo"):
        assert 0 < single[f"stats_ais_{level}"]["ais/alpha"] < 1, level
        for method in ("mis", "icepop"):
            assert single[f"stats_{method}_{level}"]["is/masked_frac"] > 0, (method, level)
    assert 0 < single["stats_tis_seq"]["is/truncated_frac"] < 1
    assert single["stats_none_token"]["mismatch/outside_window_frac"] > 0
    assert float(r0["loss"] + r1["loss"]) == pytest.approx(float(single["loss"]), abs=1e-6)
    torch.testing.assert_close(cat("grad"), single["grad"], rtol=0, atol=1e-7)
    for mode in mod.LOSS_AGG_MODES:   # each aggregation mode, with the KL term: summed over ranks = one process
        total = float(r0[f"loss_{mode}"] + r1[f"loss_{mode}"])
        assert total == pytest.approx(float(single[f"loss_{mode}"]), abs=1e-6), mode
        torch.testing.assert_close(cat(f"grad_{mode}"), single[f"grad_{mode}"], rtol=0, atol=1e-7)
