"""Bucketed weight broadcast (pipeline/weight_transport.py): the manifest's layout, and 3 gloo ranks."""
from pathlib import Path

import pytest
import torch

from megatron_qrl.pipeline.weight_transport import ALIGN, bucket_sizes, manifest
from megatron_qrl.quant import pack_weight

from launch_ranks import run_ranks

SCRIPT = Path(__file__).parent / "dist" / "weight_transport.py"


def test_manifest_aligns_parts_and_splits_buckets():
    weights = {"w": pack_weight(torch.randn(32, 64), "nvfp4"), "n": torch.randn(3), "big": torch.randn(100)}
    spec = manifest(weights, bucket_bytes=1024)
    parts = [p for e in spec for p in e["parts"]]
    assert [e["name"] for e in spec] == ["w", "n", "big"] and spec[0]["format"] == "nvfp4" and spec[1]["format"] is None
    assert [p[0] for p in spec[0]["parts"]] == ["uint8", "float8_e4m3fn", "float32"]
    assert all(offset % ALIGN == 0 for _, _, _, offset in parts)
    # w: 1024 B codes fill bucket 0; its scales, global scale, n start bucket 1; big (400 B) still fits there
    assert [p[2] for p in parts] == [0, 1, 1, 1, 1]
    assert bucket_sizes(spec) == [1024, 128 + 16 + 16 + 400]
    with pytest.raises(TypeError, match="torch.Tensor or FP4Tensor"):
        manifest({"x": [1, 2]})



def test_three_gloo_ranks_receive_the_sent_bytes():
    out = run_ranks(3, SCRIPT, timeout=180)
    for rank in range(3):
        assert f"WEIGHT TRANSPORT OK rank {rank}" in out
