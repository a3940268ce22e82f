"""Per-token records of one engine step: R3 routed experts and TRACE activation captures.

Both come from the model code the trainer runs: R3TopKRouter remembers its own top-k ids
(`last_topk_ids`, [tokens, k] in Megatron's [seq, batch]-flattened order = our packed order), and the FP4
linears hand a CaptureRecord per quantized activation site call to the engine's TRACE recorder
(`trace.TraceRecorder.recording`, the capture sink). A routed
expert's record holds one row per token dispatched to it, in the token dispatcher's order: tokens of
that expert by ascending token index (Megatron's `permute` over the routing map, no capacity drops).
`scatter_records` turns those rows back into [token, slot] tensors using the routed ids; records of
dense sites (qkv, proj, shared experts: quantized with quant.targets=all_linears) already hold one row
per token and become [token] tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_qrl.quant.sites import parse_site_name, site_name

from .protocol import ActivationCapture


class RoutingRecorder:
    """Collects the routers' own top-k choices after each forward, stacked over MoE layers."""

    def __init__(self, model: torch.nn.Module):
        from megatron_qrl.models import clear_replay, r3_routers

        clear_replay(model)   # the engine routes freely; replay is the trainer's business
        self.routers = sorted(r3_routers(model), key=lambda r: r.layer_index)
        if any(r.layer_index < 0 for r in self.routers):
            raise RuntimeError("routers carry no layer index; build the engine model with "
                               "megatron_qrl.models.build_model")
        self.layers = [r.layer_index for r in self.routers]

    @property
    def enabled(self) -> bool:
        return bool(self.routers)

    def collect(self, num_tokens: int) -> Optional[torch.Tensor]:
        """int16 [T, num_moe_layers, k] of the forward that just ran (None for a dense model)."""
        if not self.routers:
            return None
        ids = []
        for r in self.routers:
            if r.last_topk_ids is None or r.last_topk_ids.shape[0] != num_tokens:
                raise RuntimeError(f"router of layer {r.layer_index} recorded no top-k ids for this step's "
                                   f"{num_tokens} tokens")
            ids.append(r.last_topk_ids.to(torch.int16))
            r.last_topk_ids = None
        return torch.stack(ids, dim=1)


@dataclass
class GroupedCaptureRecord:
    """One routed-expert role of one layer for all experts at once (the kernel path, kernel_linears.py).

    Rows are in the dispatcher's order (by expert, then ascending token), like the per-expert records
    concatenated in expert order; expert_ids [N] names each row's expert, global_scale [N] its scale."""

    layer: int
    role: str
    expert_ids: torch.Tensor
    packed: torch.Tensor
    scales: torch.Tensor
    global_scale: Optional[torch.Tensor]
    bits: torch.Tensor

    @property
    def site(self) -> str:
        return site_name(self.layer, self.role)


def scatter_records(records: list, routed: Optional[torch.Tensor], num_tokens: int, moe_layers: list[int],
                    fmt: str, keep_codes: bool = False, errors: Optional[list] = None
                    ) -> dict[int, dict[str, ActivationCapture]]:
    """Capture records of one forward -> per layer and role an ActivationCapture over the step's tokens
    (`scatter_steps` with one step)."""
    return scatter_steps([(records, num_tokens)], routed, moe_layers, fmt, keep_codes, errors)


STEP_KEY = 1 << 20   # (step, expert) sort key = step * STEP_KEY + expert; expert ids are < 2^16


def scatter_steps(steps: list[tuple[list, int]], routed: Optional[torch.Tensor], moe_layers: list[int], fmt: str,
                  keep_codes: bool = False, errors: Optional[list] = None) -> dict[int, dict[str, ActivationCapture]]:
    """Capture records of several forwards -> per layer and role an ActivationCapture over all their tokens.

    steps: (records, num_tokens) per forward, in order; routed: int [sum tokens, num_moe_layers, k], the
    forwards' routed ids concatenated in the same order. Routed-expert roles get rows [T, k] (slot j =
    routed[:, layer, j]); dense roles rows [T]. keep_codes also keeps the packed E2M1 codes
    (`ActivationCapture.codes`, for tests and debugging; the trainer needs only bits and scales).

    Run once per generate() over all its steps, so capture costs no host work per engine step: within one
    forward the records of a layer and role, in expert order, are the dispatcher's rows, i.e. the
    (token, slot) assignments stably sorted by expert; over several forwards, stably sorted by (step,
    expert). One sort of those keys gives each row's (token, slot), one index_copy per tensor places it.
    Row counts are checked from shapes; row experts against the sorted keys on the device: with `errors`
    given, a (description, device bool) pair is appended for the caller to check once
    (`check_capture_errors`), otherwise it is checked here.
    """
    layer_pos = {layer: i for i, layer in enumerate(moe_layers)}
    dense: dict[tuple[int, str], list] = {}
    routed_items: dict[tuple[int, str], list] = {}      # (layer, role) -> [(step, expert or None, record)]
    for step, (records, num_tokens) in enumerate(steps):
        seen = set()
        for rec in records:
            if isinstance(rec, GroupedCaptureRecord):
                key = (rec.layer, rec.role, None)
                if key in seen:
                    raise RuntimeError(f"layer {rec.layer} {rec.role} was captured twice in one forward")
                seen.add(key)
                routed_items.setdefault((rec.layer, rec.role), []).append((step, None, rec))
                continue
            try:
                key = layer, role, expert = parse_site_name(rec.site)
            except ValueError:
                raise RuntimeError(f"capture record of unknown site '{rec.site}'") from None
            if key in seen:
                what = "site " + rec.site if expert is None else f"layer {layer} {role}: an expert"
                raise RuntimeError(f"{what} was captured twice in one forward")
            seen.add(key)
            if expert is None:
                dense.setdefault((layer, role), []).append(_dense_rows(rec, num_tokens, keep_codes))
            else:
                routed_items.setdefault((layer, role), []).append((step, expert, rec))
    out: dict[int, dict[str, ActivationCapture]] = {}
    for (layer, role), parts in dense.items():
        cap = {name: _cat([p[name] for p in parts]) for name in parts[0]}
        out.setdefault(layer, {})[role] = ActivationCapture(fmt, cap["bits"], cap["scales"], cap.get("global_scale"),
                                                            cap.get("codes"))
    if not routed_items:
        return out
    tokens = [n for _, n in steps]
    total, k = sum(tokens), routed.shape[-1]
    if routed.shape[0] != total:
        raise RuntimeError(f"routed ids cover {routed.shape[0]} tokens, the captured forwards {total}")
    device = routed.device
    step_of_slot = (torch.repeat_interleave(torch.arange(len(steps), device=device),
                                            torch.tensor(tokens, device=device) * k, output_size=total * k)
                    if len(steps) > 1 else None)
    for (layer, role), items in routed_items.items():
        flat = routed[:, layer_pos[layer], :].reshape(-1).long()
        keys = flat if step_of_slot is None else step_of_slot * STEP_KEY + flat
        sorted_keys, order = torch.sort(keys, stable=True)    # the dispatcher's order of (token, slot), per step
        rows = _rows_of(items, layer, role, fmt, keep_codes, device)
        n = rows["bits"].shape[0]
        if n != total * k:
            raise RuntimeError(f"layer {layer} {role}: {n} captured rows for {total} tokens x top-{k}; the "
                               "token dispatcher dropped or duplicated tokens")
        bad = (rows.pop("keys") != sorted_keys).any()
        what = f"TRACE capture of layer {layer} {role}: captured rows do not follow the routed experts"
        if errors is None:
            if bool(bad):
                raise RuntimeError(what)
        else:
            errors.append((what, bad))
        cap = {}
        for name, t in rows.items():
            raw = _bytes_view(t)
            dest = torch.empty((n, *t.shape[1:]), dtype=raw.dtype, device=t.device)
            dest.index_copy_(0, order, raw)
            cap[name] = dest.view(t.dtype).view(total, k, *t.shape[1:])
        out.setdefault(layer, {})[role] = ActivationCapture(fmt, cap["bits"], cap["scales"], cap.get("global_scale"),
                                                            cap.get("codes"))
    return out


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    if len(parts) == 1:
        return parts[0]
    return torch.cat([_bytes_view(p) for p in parts]).view(parts[0].dtype)


def _rows_of(items: list, layer: int, role: str, fmt: str, keep_codes: bool, device) -> dict[str, torch.Tensor]:
    """The rows of one layer and role in (step, dispatch) order: bits, scales, global_scale, codes, and each
    row's (step, expert) sort key. items: (step, expert or None for a grouped record, record)."""
    def flat2(t):
        return t.reshape(-1, t.shape[-1])

    items = sorted(items, key=lambda it: (it[0], -1 if it[1] is None else it[1]))
    counts = [flat2(r.bits).shape[0] for _, _, r in items]
    rows = {"bits": _cat([flat2(r.bits) for _, _, r in items]),
            "scales": _cat([flat2(r.scales) for _, _, r in items])}
    if fmt == "nvfp4":
        rows["global_scale"] = torch.cat([r.global_scale.float().reshape(-1) if e is None
                                          else r.global_scale.float().reshape(1).expand(c)
                                          for (_, e, r), c in zip(items, counts)])
    if keep_codes:
        rows["codes"] = _cat([flat2(r.packed) for _, _, r in items])
    # per-expert records: keys from host lists, built on the device in one op (no synchronisation)
    host_keys = [(s * STEP_KEY + e, c) for (s, e, _), c in zip(items, counts) if e is not None]
    parts = []
    if host_keys:
        kt = torch.tensor([key for key, _ in host_keys], device=device)
        parts.append(torch.repeat_interleave(kt, torch.tensor([c for _, c in host_keys], device=device),
                                             output_size=sum(c for _, c in host_keys)))
    grouped = [(s, r) for s, e, r in items if e is None]
    if grouped and host_keys:
        raise RuntimeError(f"layer {layer} {role} holds both grouped and per-expert capture records")
    if grouped:
        parts = [r.expert_ids.long() + s * STEP_KEY for s, r in grouped]
    rows["keys"] = parts[0] if len(parts) == 1 else torch.cat(parts)
    return rows


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """float8 tensors as uint8 for data movement (index and cat kernels need not support float8)."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


def check_capture_errors(errors: list) -> None:
    """One host synchronisation for all deferred capture checks of a generate() call."""
    if not errors:
        return
    flags = torch.stack([bad for _, bad in errors]).cpu()
    for (what, _), bad in zip(errors, flags.tolist()):
        if bad:
            raise RuntimeError(what + "; the token dispatcher dropped or reordered tokens")


class RolloutRecords:
    """Per-step R3 ids and TRACE capture records of one generate() call, kept on the device until the end.

    `add_step` only keeps references (no device work per engine step); `finish` scatters every step's
    capture records at once (`scatter_steps`), orders the rows by sequence (one gather on the device),
    copies the R3 ids to the host once and splits every tensor per sequence. The TRACE captures stay on
    the engine's device: the recorder seals them there and the trainer replays them there.
    """

    def __init__(self, moe_layers: list[int], fmt: str, keep_codes: bool = False):
        self.moe_layers, self.fmt, self.keep_codes = moe_layers, fmt, keep_codes
        self.routed: list[torch.Tensor] = []
        self.captured: list[tuple[list, int]] = []
        self.spans: dict[int, list[tuple[int, int]]] = {}
        self.offset = 0

    def add_step(self, routed: Optional[torch.Tensor], captured: list, spans: list[tuple[int, int, int]],
                 num_tokens: int) -> None:
        if routed is not None:
            self.routed.append(routed)
        self.captured.append((captured, num_tokens))
        for key, lo, hi in spans:
            self.spans.setdefault(key, []).append((self.offset + lo, hi - lo))
        self.offset += num_tokens

    def finish_blocks(self, keys: list[int], host: bool = True) -> tuple[Optional[torch.Tensor], dict, list[int]]:
        """(routed rows of all keys, [sum n, L, k] or None; trace {layer: {role: {field: rows}}}; rows per key),
        rows in key order: one gather per tensor on the device; the routed rows then come to the host
        (host=False: left where they are, for a caller that gathers further on the device)."""
        routed_all = _cat(self.routed) if self.routed else None
        trace_all = {}
        if any(records for records, _ in self.captured):
            errors: list = []
            trace_all = scatter_steps(self.captured, routed_all, self.moe_layers, self.fmt, self.keep_codes, errors)
            check_capture_errors(errors)
        sizes = [sum(n for _, n in self.spans.get(key, [])) for key in keys]
        index = [torch.arange(s, s + n) for key in keys for s, n in self.spans.get(key, [])]
        perm = torch.cat(index) if index else torch.zeros(0, dtype=torch.int64)
        contiguous = bool(perm.numel() == self.offset and torch.equal(perm, torch.arange(self.offset)))

        def ordered(full: torch.Tensor) -> torch.Tensor:
            dtype, raw = full.dtype, _bytes_view(full)
            if not contiguous:
                raw = raw.index_select(0, perm.to(raw.device))
            return raw.view(dtype)

        trace = {layer: {role: {attr: ordered(getattr(cap, attr)) for attr in ("bits", "scales", "global_scale", "codes")
                                if getattr(cap, attr) is not None}
                         for role, cap in roles.items()} for layer, roles in trace_all.items()}
        routed = ordered(routed_all) if routed_all is not None else None
        return (routed.cpu() if host and routed is not None else routed), trace, sizes

    def finish(self, keys: list[int]) -> tuple[dict, dict]:
        """(routed per key: host [n, L, k] or None, trace per key: {layer: {role: ActivationCapture on the
        engine's device}})."""
        routed_all, trace_all, sizes = self.finish_blocks(keys)

        def split(full: torch.Tensor) -> list[torch.Tensor]:
            # own storage per sequence: a view would make torch.save of one sample carry all of them
            dtype = full.dtype
            return [t.clone().view(dtype) for t in torch.split(_bytes_view(full), sizes)]

        routed = dict(zip(keys, split(routed_all))) if routed_all is not None else {key: None for key in keys}
        trace: dict = {key: {} for key in keys}
        for layer, roles in trace_all.items():
            for role, fields in roles.items():
                parts = {attr: split(t) for attr, t in fields.items()}
                fmt = self.fmt
                for i, key in enumerate(keys):
                    trace[key].setdefault(layer, {})[role] = ActivationCapture(
                        fmt, parts["bits"][i], parts["scales"][i],
                        parts["global_scale"][i] if "global_scale" in parts else None,
                        parts["codes"][i] if "codes" in parts else None)
        return routed, trace


def _dense_rows(rec, num_tokens: int, keep_codes: bool) -> dict[str, torch.Tensor]:
    """A dense site's record already has one row per packed token ([T, 1, K/8] in Megatron's layout)."""
    if rec.bits.numel() // rec.bits.shape[-1] != num_tokens:
        raise RuntimeError(f"site {rec.site}: {rec.bits.numel() // rec.bits.shape[-1]} captured rows for "
                           f"{num_tokens} tokens")

    def rows(t):
        return t.reshape(num_tokens, t.shape[-1])

    out = {"bits": rows(rec.bits), "scales": rows(rec.scales)}
    if rec.global_scale is not None:
        out["global_scale"] = rec.global_scale.float().reshape(()).expand(num_tokens).contiguous()
    if keep_codes:
        out["codes"] = rows(rec.packed)
    return out


def concat_rows(chunks: list[ActivationCapture]) -> ActivationCapture:
    first = chunks[0]
    if len(chunks) == 1:
        return first

    def cat(attr):
        parts = [getattr(c, attr) for c in chunks]
        return None if parts[0] is None else torch.cat(parts, dim=0)

    return ActivationCapture(first.format, cat("bits"), cat("scales"), cat("global_scale"), cat("codes"))


def guided_requantize(x: torch.Tensor, bits: torch.Tensor, scales: torch.Tensor,
                      global_scale: Optional[torch.Tensor], fmt: str, fallback_shift: float = 0.25,
                      stats: Optional[dict] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """TRACE replay of captured rows: x [N, K] -> (packed codes [N, K/2], dequantized x in x.dtype).

    Rows of one ActivationCapture come from different engine steps and so carry different NVFP4 global
    scales ([N]); the codec's guided mode takes one global scale per call, so rows are replayed in groups
    sharing a scale. Fallbacks are counted in `stats` like nvfp4_quantize does.
    """
    from megatron_qrl.quant import mxfp4_dequantize, mxfp4_quantize, nvfp4_dequantize, nvfp4_quantize

    if x.numel() == 0:  # an expert that got no tokens
        return torch.empty(*x.shape[:-1], x.shape[-1] // 2, dtype=torch.uint8, device=x.device), x.clone()
    if fmt == "mxfp4":
        packed, sc = mxfp4_quantize(x, "guided", scales=scales, trace_bits=bits, fallback_shift=fallback_shift,
                                    stats=stats)
        return packed, mxfp4_dequantize(packed, sc, dtype=x.dtype)
    if fmt != "nvfp4" or global_scale is None:
        raise ValueError(f"guided_requantize needs nvfp4 rows with global scales or mxfp4 rows, got {fmt}")
    packed = torch.empty(*x.shape[:-1], x.shape[-1] // 2, dtype=torch.uint8, device=x.device)
    deq = torch.empty_like(x)
    for g in torch.unique(global_scale):
        rows = (global_scale == g).nonzero(as_tuple=True)[0]
        p, s, gs = nvfp4_quantize(x[rows], g, "guided", scales=scales[rows], trace_bits=bits[rows],
                                  fallback_shift=fallback_shift, stats=stats)
        packed[rows] = p
        deq[rows] = nvfp4_dequantize(p, s, gs, dtype=x.dtype)
    return packed, deq
