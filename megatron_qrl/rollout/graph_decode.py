"""The engine's static decode loop: CUDA-graph decode steps per batch bucket, host work once per window.

Per generate() call:
1. Admission: waiting prompts take free rows (and KV slots); their prefill runs through the eager Megatron
   path (`ModelRunner`, one packed step per admission wave, TRACE and R3 recorded as the eager engine does);
   the first token is sampled on the device from the prefill logits.
2. Decode windows: `window` replays of the step graph of the current bucket (the smallest captured batch
   size >= the rows in use). Each replay feeds every row its last token, samples the next one on the device
   (rng.py / sampling.py), writes token, log-prob, R3 ids and TRACE captures into ring buffers and updates
   the rows' state (positions, counters, stop / length checks) -- all in device memory.
3. Host check, once per window: the ring is scattered into per-sequence output buffers (device ops), one
   small device->host copy reads which rows finished; finished rows free their slots, waiting prompts are
   admitted, and the rows in use are compacted so that the bucket can shrink as the batch drains.
At the end each output buffer comes to the host once. On a GPU the step runs as CUDA graphs captured once
per (bucket, sampling setting) and kept across weight updates (weights change in place); without CUDA the
same step runs eagerly, which is how the CPU tests check it against the eager engine.

Numerics: the step is `DecodeModel` (static_decode.py); for W4A16 and BF16 weights a sequence's tokens do
not depend on the batch. Under W4A4 the per-expert activation scale depends on the rows of a step, and so
does the per-tensor scale of the FP4 attention linears (qkv, proj under quant.targets=all_linears: amax over
all the step's rows, as the eager engine's forward takes it over its step's tokens): rows of finished
sequences and bucket padding never count (zeroed first), but prompts admitted mid-call prefill in a step of
their own, where the eager engine mixes them into a decode step.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_qrl.quant.blocks import block_size

from .attention import StepBatch
from .capture import RolloutRecords
from .decode_linears import capture_widths
from .protocol import ActivationCapture, RolloutSample, SamplingParams
from .rng import stream_keys
from .sampling import sample_and_logprob

_log = logging.getLogger(__name__)
RUNNING, STOPPED, LENGTH = 0, 1, 2


def batch_buckets(max_batch: int) -> list[int]:
    """Captured batch sizes: powers of two up to max_batch, and max_batch itself."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


@dataclass
class RecordShapes:
    """Per-row shapes of what a decode step records (for the ring and output buffers)."""

    moe_layers: int
    top_k: int
    trace: dict[int, dict[str, dict[str, tuple[tuple, torch.dtype]]]]   # layer -> role -> name -> (shape, dtype)


def record_shapes(mc, trace_layers: list[int], fmt: str, keep_codes: bool, moe_layers: int,
                  dense: Optional[dict[int, dict[str, int]]] = None) -> RecordShapes:
    """Routed-expert roles fc1 / fc2 record k slots per token; the captured dense sites (`dense`: layer ->
    role -> input width, e.g. qkv / proj under quant.targets=all_linears) one row per token, as
    `ActivationCapture` lays them out."""
    k = mc.moe_router_topk or 1
    trace = {}
    for layer in trace_layers:          # TRACE layers exist only with FP4 weights
        roles = {role: _capture_fields((k,), width, fmt, keep_codes)
                 for role, width in (("fc1", mc.hidden_size), ("fc2", mc.moe_ffn_hidden_size))}
        roles.update({role: _capture_fields((), width, fmt, keep_codes)
                      for role, width in (dense or {}).get(layer, {}).items()})
        trace[layer] = roles
    return RecordShapes(moe_layers, k, trace)


def _capture_fields(lead: tuple, width: int, fmt: str, keep_codes: bool) -> dict[str, tuple[tuple, torch.dtype]]:
    """name -> (per-token shape, dtype) of one captured role whose rows are `lead` x `width` elements."""
    block = block_size(fmt)
    f = {"bits": ((*lead, width // 8), torch.uint8),
         "scales": ((*lead, width // block), torch.float8_e4m3fn if fmt == "nvfp4" else torch.uint8)}
    if fmt == "nvfp4":
        f["global_scale"] = (lead, torch.float32)
    if keep_codes:
        f["codes"] = ((*lead, width // 2), torch.uint8)
    return f


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


class DecodeState:
    """Static device buffers of up to `rows` decoding sequences plus the ring of the current window."""

    def __init__(self, rows: int, window: int, shapes: RecordShapes, scratch_slot: int, device, max_stops: int = 8):
        z = lambda *s, dt=torch.long: torch.zeros(*s, dtype=dt, device=device)   # noqa: E731
        self.rows, self.window, self.shapes, self.max_stops = rows, window, shapes, max_stops
        self.tokens, self.positions, self.n_gen, self.keys = z(rows), z(rows), z(rows), z(rows)
        self.slots = torch.full((rows,), scratch_slot, dtype=torch.long, device=device)
        self.seq = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.active = z(rows, dt=torch.bool)
        self.reason = z(rows)
        self.max_new = z(())
        self.stop_ids = torch.full((max_stops,), -1, dtype=torch.long, device=device)
        self.t = z(())
        self.scratch = torch.tensor(scratch_slot, dtype=torch.long, device=device)
        # ring [rows, window, ...]: what each row recorded at each step of the window
        self.r_tokens, self.r_seq, self.r_n = z(rows, window), z(rows, window), z(rows, window)
        self.r_logp = z(rows, window, dt=torch.float32)
        self.r_routed = (z(rows, window, shapes.moe_layers, shapes.top_k, dt=torch.int16)
                         if shapes.moe_layers else None)
        self.r_trace = {layer: {role: {name: torch.zeros((rows, window, *shape), dtype=_bytes_dtype(dt),
                                                         device=device)
                                       for name, (shape, dt) in fields.items()}
                                for role, fields in roles.items()}
                        for layer, roles in shapes.trace.items()}

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in self._state()]

    def restore(self, saved: list[torch.Tensor]) -> None:
        for t, s in zip(self._state(), saved):
            t.copy_(s)

    def _state(self) -> list[torch.Tensor]:
        return [self.tokens, self.positions, self.n_gen, self.slots, self.active, self.reason, self.t]

    def permute(self, order: torch.Tensor, count: int) -> None:
        """Move rows order[j] to j for j < count (compaction); the other rows become free."""
        for t in (self.tokens, self.positions, self.n_gen, self.keys, self.slots, self.seq, self.active,
                  self.reason):
            t[:count] = t[order[:count]]
        self.seq[count:] = -1
        self.active[count:] = False
        self.slots[count:] = self.scratch


def _to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors on the host through one pinned device->host copy: each packed at a 16-byte aligned offset
    of one device staging buffer, then returned as views of the host buffer (tokens, log-probs and R3 ids:
    a few MB per call). The TRACE captures used to travel here too (~137 MB per call at batch 64, 4 layers:
    +15% on generate() even into reused memory, docs/PERF.md); they stay on the device now."""
    if not tensors or tensors[0].device.type == "cpu":
        return [t.contiguous() for t in tensors]
    flat = [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    offsets, total = [], 0
    for f in flat:
        offsets.append(total)
        total += -(-f.numel() // 16) * 16
    stage = torch.empty(total, dtype=torch.uint8, device=tensors[0].device)
    for f, at in zip(flat, offsets):
        stage[at:at + f.numel()].copy_(f)
    buf = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    buf.copy_(stage, non_blocking=True)
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return [buf[at:at + f.numel()].view(t.dtype).view(t.shape) for t, f, at in zip(tensors, flat, offsets)]


def _bytes_dtype(dt: torch.dtype) -> torch.dtype:
    return torch.uint8 if dt in (torch.float8_e4m3fn,) else dt


class CallOutputs:
    """Per-sequence output buffers of one generate() call on the device (row S and the last column: dump)."""

    def __init__(self, num_seqs: int, max_new: int, shapes: RecordShapes, device):
        S, N = num_seqs, max_new
        self.S, self.N = S, N
        self.tokens = torch.zeros((S + 1, N + 1), dtype=torch.long, device=device)
        self.logp = torch.zeros((S + 1, N + 1), dtype=torch.float32, device=device)
        self.routed = (torch.zeros((S + 1, N, shapes.moe_layers, shapes.top_k), dtype=torch.int16, device=device)
                       if shapes.moe_layers else None)
        self.trace = {layer: {role: {name: torch.zeros((S + 1, N, *shape), dtype=_bytes_dtype(dt), device=device)
                                     for name, (shape, dt) in fields.items()}
                              for role, fields in roles.items()}
                      for layer, roles in shapes.trace.items()}
        self.dtypes = {(layer, role, name): dt for layer, roles in shapes.trace.items()
                       for role, fields in roles.items() for name, (_, dt) in fields.items()}

    def scatter_window(self, st: DecodeState, B: int, steps: int) -> None:
        """The last window's `steps` ring columns (rows < B) -> the sequences' buffers; no host sync."""
        seq, n = st.r_seq[:B, :steps].reshape(-1), st.r_n[:B, :steps].reshape(-1)
        valid = seq >= 0
        si = torch.where(valid, seq, torch.full_like(seq, self.S))
        self.tokens[si, torch.where(valid, n, torch.full_like(n, self.N))] = st.r_tokens[:B, :steps].reshape(-1)
        self.logp[si, torch.where(valid, n, torch.full_like(n, self.N))] = st.r_logp[:B, :steps].reshape(-1)
        ri = torch.where(valid, n - 1, torch.full_like(n, self.N - 1))          # decode record index
        if self.routed is not None:
            self.routed[si, ri] = st.r_routed[:B, :steps].reshape(-1, *st.r_routed.shape[2:])
        for layer, roles in self.trace.items():
            for role, fields in roles.items():
                for name, buf in fields.items():
                    ring = st.r_trace[layer][role][name]
                    buf[si, ri] = ring[:B, :steps].reshape(-1, *ring.shape[2:])


class DecodeGraphs:
    """One CUDA graph per (bucket, sampling setting), captured on first use, replayed afterwards.

    Capture happens between windows with live rows: the warm-up runs (which compile kernels and create
    library handles) execute for real, so the rows' state is snapshotted before and restored after; their
    K/V writes land at the positions the next replay rewrites. Without CUDA (or with graphs off) `run`
    calls the step eagerly."""

    def __init__(self, step, state: DecodeState, enabled: bool):
        self.step, self.state, self.enabled = step, state, enabled
        self.graphs: dict = {}
        self.pool = None
        self.captures = 0
        self.capture_s = 0.0                 # host time spent capturing (warm-ups included)
        self.failure: Optional[str] = None   # why capture failed; the step then runs eagerly (logged once)

    def run(self, bucket: int, params: SamplingParams) -> None:
        if not self.enabled:
            self.step(bucket, params)
            return
        key = (bucket, params.temperature, params.top_k, params.top_p)
        graph = self.graphs.get(key)
        if graph is None:
            try:
                graph = self.graphs[key] = self._capture(bucket, params)
            except Exception as e:   # noqa: BLE001 - a step that cannot be captured still decodes, slower
                self.failure = f"{type(e).__name__}: {e}"
                self.enabled = False
                _log.warning("rollout: CUDA graph capture failed, decoding without graphs: %s", self.failure,
                             exc_info=True)
                torch.cuda.synchronize()
                self.step(bucket, params)
                return
        graph.replay()

    def _capture(self, bucket: int, params: SamplingParams):
        t0 = time.perf_counter()
        saved = self.state.snapshot()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.step(bucket, params)
        torch.cuda.current_stream().wait_stream(side)
        self.state.restore(saved)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.step(bucket, params)
        self.state.restore(saved)          # capture records the step; nothing ran, but be explicit
        self.captures += 1
        self.capture_s += time.perf_counter() - t0
        return graph

    def clear(self) -> None:
        self.graphs.clear()
        self.pool = None


class GraphDecodeLoop:
    """generate() of the embedded engine through the static decode step (see the module docstring)."""

    def __init__(self, engine, model, window: int, use_graphs: bool):
        from megatron.core.transformer.moe.moe_layer import MoELayer

        self.engine, self.model = engine, model
        mc = engine.model.config
        moe = sum(isinstance(layer.mlp, MoELayer) for layer in engine.model.decoder.layers)
        self.shapes = record_shapes(mc, engine.trace_layers, engine.format, engine.keep_codes, moe,
                                    dense=capture_widths(model.linears))
        rows = engine.max_batch_size
        self.buckets = batch_buckets(rows)
        self.state = DecodeState(rows, window, self.shapes, engine.cache.scratch_slot, engine.device)
        self.graphs = DecodeGraphs(self._step, self.state, use_graphs)
        self.window = window
        # counts, and host wall time per phase (prefill waves, decode windows incl. their host check, the
        # samples' assembly: of it the prefill records' gather and the one device->host copy)
        self.stats = {"windows": 0, "replays": 0, "admission_waves": 0, "prefill_s": 0.0, "decode_s": 0.0,
                      "assemble_s": 0.0, "assemble_prefill_s": 0.0, "assemble_copy_s": 0.0}

    # --------------------------------------------------------------------------- the captured step
    def _step(self, B: int, params: SamplingParams) -> None:
        st = self.state
        act, tok, pos, n = st.active[:B], st.tokens[:B], st.positions[:B], st.n_gen[:B]
        slots = torch.where(act, st.slots[:B], st.scratch)
        wpos = torch.where(act, pos, torch.zeros_like(pos))
        logits, rec = self.model.forward(tok, wpos, slots, act)
        new, logp = sample_and_logprob(logits, params, st.keys[:B], n)
        w = torch.remainder(st.t, self.window).reshape(1)
        st.r_tokens[:B].index_copy_(1, w, new.unsqueeze(1))
        st.r_logp[:B].index_copy_(1, w, logp.unsqueeze(1))
        st.r_seq[:B].index_copy_(1, w, torch.where(act, st.seq[:B], torch.full_like(n, -1)).unsqueeze(1))
        st.r_n[:B].index_copy_(1, w, n.unsqueeze(1))
        if rec.routed is not None:
            st.r_routed[:B].index_copy_(1, w, rec.routed.unsqueeze(1))
        for layer, roles in rec.trace.items():
            for role, fields in roles.items():
                for name, t in fields.items():
                    st.r_trace[layer][role][name][:B].index_copy_(1, w, _bytes(t).unsqueeze(1))
        stop = (new.unsqueeze(1) == st.stop_ids.unsqueeze(0)).any(-1)
        n1 = n + 1
        length = n1 >= st.max_new
        st.reason[:B] = torch.where(act & stop, torch.full_like(n, STOPPED),
                                    torch.where(act & length, torch.full_like(n, LENGTH), st.reason[:B]))
        st.tokens[:B] = torch.where(act, new, tok)
        st.positions[:B] = pos + act.long()
        st.n_gen[:B] = torch.where(act, n1, n)
        st.active[:B] = act & ~(stop | length)
        st.t += 1

    # ----------------------------------------------------------------------------------- the loop
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[RolloutSample]:
        eng, st = self.engine, self.state
        dev = eng.device
        if len(sampling.stop_token_ids) > st.max_stops:
            raise ValueError(f"the graph decode path supports up to {st.max_stops} stop tokens, got "
                             f"{len(sampling.stop_token_ids)}; use rollout.decode=eager")
        S, N = len(prompts), sampling.max_new_tokens
        self.model.refresh_weights()                   # weights may have been updated (in place) since the last call
        out = CallOutputs(S, N, self.shapes, dev)
        st.max_new.fill_(N)
        st.stop_ids.fill_(-1)
        if sampling.stop_token_ids:
            st.stop_ids[:len(sampling.stop_token_ids)] = torch.tensor(sampling.stop_token_ids, device=dev)
        keys = stream_keys(sampling.seed, torch.arange(S) + sampling.index_offset).to(dev)
        records = RolloutRecords(eng.routing.layers, eng.format, eng.keep_codes)
        row_seq = [-1] * st.rows                       # host mirror of state.seq
        row_gen = [0] * st.rows                        # tokens each row had generated at the last host check
        finished: dict[int, tuple[int, int]] = {}      # seq -> (tokens, reason)
        waiting = list(range(S))
        clock = time.perf_counter
        while waiting or any(s >= 0 for s in row_seq):
            t0 = clock()
            self._admit(prompts, waiting, row_seq, row_gen, finished, records, keys, out, sampling)
            t1 = clock()
            self.stats["prefill_s"] += t1 - t0
            used = max((r + 1 for r, s in enumerate(row_seq) if s >= 0), default=0)
            if used == 0:
                continue
            bucket = next(b for b in self.buckets if b >= used)
            # no replay past the step where every row in use has reached max_new_tokens
            steps = min(self.window, max(N - row_gen[r] for r, s in enumerate(row_seq) if s >= 0))
            for _ in range(steps):
                self.graphs.run(bucket, sampling)
            self.stats["replays"] += steps
            self.stats["windows"] += 1
            out.scatter_window(st, bucket, steps)
            st.t.zero_()
            self._retire(bucket, row_seq, row_gen, finished)
            self._compact(row_seq, row_gen)
            self.stats["decode_s"] += clock() - t1
        eng.stats["steps"] += self.stats["replays"]
        t0 = clock()
        samples = self._samples(prompts, out, finished, records, sampling)
        self.stats["assemble_s"] += clock() - t0
        return samples

    def _admit(self, prompts, waiting, row_seq, row_gen, finished, records, keys, out, sampling) -> None:
        """Prefill as many waiting prompts as free rows and KV slots allow; start their rows."""
        eng, st, dev = self.engine, self.state, self.engine.device
        free_rows = [r for r, s in enumerate(row_seq) if s < 0]
        take = min(len(waiting), len(free_rows), len(eng.cache.free_slots))
        if take == 0:
            return
        admitted = waiting[:take]
        del waiting[:take]
        budget = eng.max_tokens_per_step
        chunks, cur, size = [], [], 0
        for s in admitted:                               # whole prompts per prefill step, within the budget
            n = len(prompts[s])
            if cur and budget is not None and size + n > budget:
                chunks.append(cur)
                cur, size = [], 0
            cur.append(s)
            size += n
        chunks.append(cur)
        slots = {s: eng.cache.acquire_slot() for s in admitted}
        firsts: list[torch.Tensor] = []
        for chunk in chunks:
            batch = StepBatch.build([(slots[s], prompts[s], 0) for s in chunk], dev)
            with eng.trace_recorder.recording() as captured:
                logits = eng.runner.forward(batch)
            routed = eng.routing.collect(batch.num_tokens)
            spans = [(s, batch.row_starts[b], batch.row_starts[b] + batch.row_lens[b]) for b, s in enumerate(chunk)]
            records.add_step(routed, captured, spans, batch.num_tokens)
            idx = torch.tensor(chunk, device=dev)
            tok, logp = sample_and_logprob(logits, sampling, keys[idx], torch.zeros_like(idx))
            out.tokens[idx, 0] = tok
            out.logp[idx, 0] = logp
            firsts.append(tok)
            eng.stats["forwarded_tokens"] += batch.num_tokens
        self.stats["admission_waves"] += 1
        first = torch.cat(firsts).tolist()
        stops = set(sampling.stop_token_ids)
        start_rows, start_seqs = [], []
        for s, t in zip(admitted, first):
            if t in stops or sampling.max_new_tokens <= 1:
                finished[s] = (1, STOPPED if t in stops else LENGTH)
                eng.cache.free_slot(slots[s])
                continue
            row = free_rows[len(start_rows)]
            start_rows.append(row)
            start_seqs.append(s)
            row_seq[row], row_gen[row] = s, 1
        if not start_rows:
            return
        r = torch.tensor(start_rows, device=dev)
        sq = torch.tensor(start_seqs, device=dev)
        st.tokens[r] = torch.tensor([first[admitted.index(s)] for s in start_seqs], device=dev)
        st.positions[r] = torch.tensor([len(prompts[s]) for s in start_seqs], device=dev)
        st.slots[r] = torch.tensor([slots[s] for s in start_seqs], device=dev)
        st.n_gen[r] = 1
        st.keys[r] = keys[sq]
        st.seq[r] = sq
        st.reason[r] = RUNNING
        st.active[r] = True

    def _retire(self, B: int, row_seq, row_gen, finished) -> None:
        """Read which rows finished (one small device->host copy) and free their rows and slots."""
        st, eng = self.state, self.engine
        snap = torch.stack([st.active[:B].long(), st.reason[:B], st.n_gen[:B], st.slots[:B]]).cpu().tolist()
        done = []
        for r in range(B):
            s = row_seq[r]
            row_gen[r] = snap[2][r]
            if s >= 0 and not snap[0][r]:
                finished[s] = (snap[2][r], snap[1][r])
                eng.cache.free_slot(snap[3][r])
                row_seq[r] = -1
                done.append(r)
        if done:
            d = torch.tensor(done, device=eng.device)
            st.seq[d] = -1
            st.slots[d] = st.scratch

    def _compact(self, row_seq, row_gen) -> None:
        """Move the rows in use to the front when that lets a smaller bucket serve them."""
        used = [r for r, s in enumerate(row_seq) if s >= 0]
        if not used:
            return
        span = used[-1] + 1
        if next(b for b in self.buckets if b >= len(used)) >= next(b for b in self.buckets if b >= span):
            return
        order = torch.tensor(used + [r for r in range(self.state.rows) if row_seq[r] < 0], device=self.engine.device)
        self.state.permute(order, len(used))
        seqs, gens = [row_seq[r] for r in used], [row_gen[r] for r in used]
        row_seq[:] = seqs + [-1] * (len(row_seq) - len(seqs))
        row_gen[:] = gens + [0] * (len(row_gen) - len(gens))

    # -------------------------------------------------------------------------------- the samples
    def _samples(self, prompts, out: CallOutputs, finished, records: RolloutRecords,
                 sampling: SamplingParams) -> list[RolloutSample]:
        """Each sequence's prefill rows (eager records) then its decode rows: per tensor one gather on the
        device. Tokens, log-probs and R3 ids come to the host in ONE pinned copy; the TRACE captures stay on
        the device (per-sequence views of one gathered tensor per field): the recorder seals them there and
        the trainer replays them there, so the bulk of the capture never crosses PCIe (docs/trace.md)."""
        eng, S, dev = self.engine, len(prompts), self.engine.device
        t0 = time.perf_counter()
        routed_pre, trace_pre, pre_rows = records.finish_blocks(list(range(S)), host=False)
        self.stats["assemble_prefill_s"] += time.perf_counter() - t0
        gen = [finished[s][0] for s in range(S)]
        dec_rows = [max(n - 1, 0) for n in gen]
        pre_start = torch.tensor([0] + pre_rows[:-1]).cumsum(0)
        order = torch.cat([torch.cat([torch.arange(p0, p0 + p), sum(pre_rows) + s * out.N + torch.arange(d)])
                           for s, (p0, p, d) in enumerate(zip(pre_start.tolist(), pre_rows, dec_rows))]).to(dev)
        per_seq = [p + d for p, d in zip(pre_rows, dec_rows)]

        def rows(pre: torch.Tensor, dec: Optional[torch.Tensor]) -> torch.Tensor:
            pre = _bytes(pre).to(dev)
            dec = (torch.zeros((S * out.N, *pre.shape[1:]), dtype=pre.dtype, device=dev) if dec is None
                   else _bytes(dec[:S]).reshape(S * out.N, *pre.shape[1:]))
            return torch.cat([pre, dec]).index_select(0, order)

        def split(t: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
            return [part.view(dtype) for part in torch.split(t, per_seq)]

        to_host = [out.tokens[:S], out.logp[:S]]
        if routed_pre is not None and out.routed is not None:
            to_host.append(rows(routed_pre, out.routed))
        t0 = time.perf_counter()
        host = _to_host(to_host)
        self.stats["assemble_copy_s"] += time.perf_counter() - t0
        tokens, logp = host[0], host[1]
        routed = split(host[2], routed_pre.dtype) if len(host) > 2 else [None] * S
        caps: list[dict] = [{} for _ in range(S)]
        for layer, roles in trace_pre.items():
            for role, fields in roles.items():
                parts = {name: split(rows(t, out.trace.get(layer, {}).get(role, {}).get(name)), t.dtype)
                         for name, t in fields.items()}
                for s in range(S):
                    caps[s].setdefault(layer, {})[role] = ActivationCapture(
                        eng.format, parts["bits"][s], parts["scales"][s],
                        parts["global_scale"][s] if "global_scale" in parts else None,
                        parts["codes"][s] if "codes" in parts else None)
        samples = []
        for s, prompt in enumerate(prompts):
            n, reason = finished[s]
            samples.append(RolloutSample(
                prompt_ids=list(prompt), tokens=tokens[s, :n].tolist(),
                logprobs=logp[s, :n].clone() if sampling.return_logprobs else None,
                finish_reason="stop" if reason == STOPPED else "length", routed_experts=routed[s], trace=caps[s],
                weight_version=eng.version))
            eng.stats["generated_tokens"] += n
        return samples
