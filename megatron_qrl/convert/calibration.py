"""Activation amax of the FP4 linears' inputs, for the static `input_scale` serving engines need.

SGLang and vLLM quantize a linear's input with a *static* per-tensor scale read from the checkpoint
(`input_scale` = amax / (6 * 448), ModelOpt's formula), while our trainer and embedded engine use a dynamic
per-call amax. Calibration runs the model over a few sequences and keeps, per quantized linear, the
largest |input| seen:
- dense linears (qkv, proj, shared experts): their input;
- routed expert fc1: the tokens routed to that expert;
- routed expert fc2: silu(gate) * up *before* the routing probability is applied. Megatron multiplies
  the probability in before fc2, but fused MoE kernels quantize the unscaled activation and apply the
  probability after fc2, so that is the tensor whose range the engine's input_scale must cover.
Experts that received no calibration token get the largest amax of their layer's experts (ModelOpt's rule).
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
import torch

from megatron_qrl.logging import progress_bar

from .errors import ConvertError


def read_calibration_tokens(path: str | Path, vocab_size: int, max_len: int) -> list[torch.Tensor]:
    """Token id sequences from JSON (a list of lists) or JSONL (one list, or {"input_ids": [...]}, per line)."""
    path = Path(path)
    if not path.is_file():
        raise ConvertError(f"calibration file '{path}' does not exist; pass JSON/JSONL token id lists")
    text = path.read_text().strip()
    try:
        rows = json.loads(text) if text.startswith("[") else [json.loads(line) for line in text.splitlines() if line]
    except json.JSONDecodeError as e:
        raise ConvertError(f"calibration file '{path}' is not JSON/JSONL of token id lists ({e})") from None
    seqs = []
    for i, row in enumerate(rows):
        ids = row.get("input_ids") if isinstance(row, dict) else row
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise ConvertError(f"calibration row {i} of '{path}' is not a non-empty list of token ids "
                               "(or {\"input_ids\": [...]})")
        if max(ids) >= vocab_size or min(ids) < 0:
            raise ConvertError(f"calibration row {i} of '{path}' has token ids outside [0, {vocab_size})")
        seqs.append(torch.tensor(ids[:max_len], dtype=torch.long))
    return seqs


def random_tokens(num: int, length: int, vocab_size: int, seed: int = 0) -> list[torch.Tensor]:
    """Uniform random token sequences: a stand-in when no calibration text is given."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (length,), generator=g) for _ in range(num)]


def _amax(x: torch.Tensor) -> float:
    return float(x.detach().abs().amax()) if x.numel() else 0.0


@torch.no_grad()
def activation_amax(model, linears: dict, sequences: list[torch.Tensor]) -> dict[str, float]:
    """{weight name: input amax} for `linears` ({weight name: FP4 linear module}) over `sequences`."""
    from megatron_qrl.models.experts import _activation

    seen: dict[str, float] = defaultdict(float)
    owner = {id(mod): name for name, mod in linears.items()}
    fc1_of_fc2 = {}
    for name, mod in linears.items():
        if mod.site.role == "fc2" and mod.site.expert is not None:
            fc1_of_fc2[name.replace("linear_fc2.weight", "linear_fc1")] = name
    modules = dict(model.named_modules())
    hooks = []

    def on_input(module, args):
        name = owner[id(module)]
        seen[name] = max(seen[name], _amax(args[0]))

    def on_fc1_output(fc2_name):
        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            seen[fc2_name] = max(seen[fc2_name], _amax(_activation(model.config, out)))
        return hook

    try:
        for name, mod in linears.items():
            if name not in fc1_of_fc2.values():
                hooks.append(mod.register_forward_pre_hook(on_input))
        for fc1_module, fc2_name in fc1_of_fc2.items():
            hooks.append(modules[fc1_module].register_forward_hook(on_fc1_output(fc2_name)))
        for tokens in progress_bar(sequences, desc="calibrating input scales", unit="seq"):
            t = tokens[None].to(next(model.parameters()).device)
            model(t, torch.arange(t.shape[1], device=t.device)[None], None)
    finally:
        for h in hooks:
            h.remove()
    return _fill_unrouted_experts(dict(seen), linears)


def _fill_unrouted_experts(seen: dict[str, float], linears: dict) -> dict[str, float]:
    by_group = defaultdict(float)
    for name, mod in linears.items():
        by_group[(mod.site.layer, mod.site.role)] = max(by_group[(mod.site.layer, mod.site.role)], seen.get(name, 0.0))
    out = {}
    for name, mod in linears.items():
        value = seen.get(name, 0.0) or by_group[(mod.site.layer, mod.site.role)]
        if value <= 0:
            raise ConvertError(f"calibration saw no input for '{name}' (layer {mod.site.layer}, {mod.site.role}); "
                               "use more or longer calibration sequences")
        out[name] = value
    return out


def fixed_amax(linears: dict, amax: float) -> dict[str, float]:
    """The same amax for every linear (--input-amax: no calibration)."""
    return {name: float(amax) for name in linears}
