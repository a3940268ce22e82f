"""TRACE metrics: transfer cost, rejected caches, and the code mismatch before/after guidance.

The cache keeps only each code's mantissa bit, not the code, so the mismatch is measured through that
bit. Adjacent E2M1 codewords always differ in it (magnitude indices alternate parity; across zero,
+0 (bit 0) and -0.5 (bit 1)), codewords two apart never do. So

    trace/code_mismatch_before = fraction of cached elements whose trainer-nearest code's mantissa bit
                                 differs from the rollout's bit (the trainer quantizing on its own, its
                                 own global and block scales: what QAT does without TRACE)
    trace/code_mismatch_after  = the same for the guided codes (rollout scales + bits); ~0, nonzero only
                                 where the guide fell back to nearest

counts exactly the disagreements by an odd number of codewords: every one-codeword disagreement --
the kind TRACE targets and the bulk of train/rollout mismatches -- and the rare three-apart ones;
disagreements by two codewords are invisible to it. Only rows the cache holds are counted.
`mismatch_counts` is the host reference; the trainer counts on the device while it replays
(trace/replay.replay_rows -> TraceMetrics.add_device_mismatch) and reads the counters once per pass.
"""
from __future__ import annotations

from collections import defaultdict
import torch

from megatron_qrl.quant import GuidedRounding, mantissa_bits, round_nearest, unpack_bits
from megatron_qrl.quant.nvfp4 import nvfp4_block_scales, nvfp4_global_scale, nvfp4_scaled

from .replay import guided_codes

PREFIX = "trace/"


def mismatch_counts(x: torch.Tensor, guide, fallback_shift: float = 0.25) -> dict[str, int]:
    """{'before', 'after', 'elements'} over the rows of x the guide found (rows aligned with the guide).

    The trainer's own nearest encoding takes its scales from the whole tensor x, as unguided QAT does.
    """
    x2 = x.detach().reshape(-1, x.shape[-1])
    n = x2.shape[0]
    found = getattr(guide, "cached_rows", None)   # a completed guide: the rows the cache held
    if found is None:
        found = getattr(guide, "found", None)
    keep = (torch.arange(n, device=x.device) if found is None
            else torch.nonzero(found.reshape(-1)).reshape(-1).to(x.device))
    gs_own = nvfp4_global_scale(x2)
    own = round_nearest(nvfp4_scaled(x2, nvfp4_block_scales(x2, gs_own), gs_own)).index_select(0, keep)
    gs = guide.global_scale
    if gs is not None and gs.dim() > 0:
        gs = gs.reshape(n, 1).index_select(0, keep)
    scales = guide.scales.reshape(n, -1).view(torch.uint8).index_select(0, keep).view(torch.float8_e4m3fn)
    sub = GuidedRounding(guide.bits.reshape(n, -1).index_select(0, keep), scales, gs)
    codes, _ = guided_codes(x2.index_select(0, keep), sub, fallback_shift)
    cached = unpack_bits(sub.bits)
    return {"before": int((mantissa_bits(own) != cached).sum()),
            "after": int((mantissa_bits(codes) != cached).sum()), "elements": cached.numel()}


class TraceMetrics:
    """Counters and timings of one step; `as_dict()` gives the 'trace/...' metrics to log."""

    def __init__(self):
        self.counters: dict[str, float] = defaultdict(float)
        self._device: dict[str, torch.Tensor] = {}   # counts still on the device (read once, in as_dict)

    def count(self, name: str, value: float = 1) -> None:
        self.counters[name] += value

    def add_device_mismatch(self, before: torch.Tensor, after: torch.Tensor, elements: int) -> None:
        """Mismatch counts computed on the device (trace/replay.replay_rows): accumulated there, no sync."""
        for k, v in (("mismatch_before", before), ("mismatch_after", after)):
            self._device[k] = self._device[k] + v if k in self._device else v
        self.count("mismatch_elements", elements)

    def _fold_device(self) -> None:
        if self._device:
            keys = list(self._device)
            values = torch.stack([self._device[k].to(torch.float64) for k in keys]).tolist()   # one host read
            for k, v in zip(keys, values):
                self.counters[k] += v
            self._device.clear()

    def add_transfer(self, seconds: float, bytes_received: int, bytes_sent: int = 0) -> None:
        self.count("transfer_s", seconds)
        self.count("cache_bytes", bytes_received)
        self.count("bytes_sent", bytes_sent)

    def add_mismatch(self, x: torch.Tensor, guide, fallback_shift: float = 0.25) -> dict[str, int]:
        c = mismatch_counts(x, guide, fallback_shift)
        self.count("mismatch_before", c["before"])
        self.count("mismatch_after", c["after"])
        self.count("mismatch_elements", c["elements"])
        return c

    def as_dict(self) -> dict[str, float]:
        self._fold_device()
        c = self.counters
        out = {PREFIX + k: v for k, v in c.items()
               if k not in ("mismatch_before", "mismatch_after", "mismatch_elements")}
        for k in ("transfer_s", "cache_bytes", "rejected"):
            out.setdefault(PREFIX + k, 0.0)
        if c.get("mismatch_elements"):
            out[PREFIX + "code_mismatch_before"] = c["mismatch_before"] / c["mismatch_elements"]
            out[PREFIX + "code_mismatch_after"] = c["mismatch_after"] / c["mismatch_elements"]
        rows = c.get("guided_rows", 0) + c.get("missing_rows", 0)
        if rows:
            out[PREFIX + "missing_row_fraction"] = c.get("missing_rows", 0) / rows
        return out

    def reset(self) -> None:
        self.counters.clear()
        self._device.clear()
