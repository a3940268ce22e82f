"""The embedded FP4 rollout engine: the trainer's own Megatron model, real FP4 weights, a KV cache.

One process, one model instance built by `megatron_qrl.models.build_model` (the trainer's definition,
eval mode, no grad), configured for inference:
- weights: a WeightStore of packed FP4 tensors (the trainer's codec bytes, digest-checked at every
  update) dequantized into the quantized linears once per update (CPU; the GPU W4A16 kernel seam is
  WeightStore.materialize). Those linears stop fake-quantizing their weights (they already hold FP4
  values);
- activations: W4A4 quantize-dequantizes the quantized linears' inputs through the model's own FP4 hook
  (nearest rounding, per-tensor dynamic global scale exactly as in the trainer's QAT forward) and
  captures the TRACE records of the cached layers' quantized sites (routed experts; also qkv/proj/shared
  experts under quant.targets=all_linears) into its `trace_recorder` (megatron_qrl/trace/recorder.py), which
  keeps them under each sample's handle; W4A16 leaves inputs alone;
- KV cache: bf16 / fp8 / fp4 (kv_cache.py; packed codes + scales on CUDA or with the kernels on);
  AQN noise in the norms' noise buffers (set_aqn_noise);
- continuous batching over packed steps (scheduler.py, attention.py), sampling with per-sequence
  generators (sampling.py), R3 routed-expert ids from the model's router (capture.py).
The same code runs on GPU with the model on cuda; attention and the expert GEMMs are then the places for
kernels (attention.attend, WeightStore.materialize).
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch

from megatron_qrl.quant.formats import FP4_FORMATS
from megatron_qrl.quant.wire import Payload, pack_state
from megatron_qrl.trace.recorder import TraceRecorder

from .attention import StepBatch
from .capture import RolloutRecords, RoutingRecorder, concat_rows
from .decode_path import build_graph_loop, resolve_decode_mode
from .kernel_linears import KernelLinears, kernels_wanted
from .kv_cache import KVCache, packed_storage
from .model_runner import ModelRunner
from .protocol import RolloutSample, SamplingParams, WeightUpdateError
from .sampling import policy_logprobs, sample_step, sequence_generator
from .scheduler import ContinuousBatchScheduler, Sequence, StepPlan
from .static_decode import unsupported_reason
from .weights import WeightStore


def _check_single_process_layout() -> None:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise RuntimeError("Megatron process groups are not initialised: call "
                           "megatron_qrl.platform.init_distributed(cfg) before building the engine")
    sizes = {"tensor": ps.get_tensor_model_parallel_world_size(),
             "pipeline": ps.get_pipeline_model_parallel_world_size(),
             "expert": ps.get_expert_model_parallel_world_size()}
    if any(v != 1 for v in sizes.values()):
        raise RuntimeError(f"the embedded engine runs an unsharded model but Megatron's layout is {sizes}; "
                           "run engines in processes with a 1x1x1 layout (rollout.placement=disaggregated) or "
                           "use rollout.engine=sglang")


def rollout_quantized(site, targets: str) -> bool:
    """Does the engine run this linear in FP4? Routed experts always; the rest with quant.targets=all_linears."""
    return site.expert is not None or targets == "all_linears"


class EmbeddedEngine:
    """RolloutEngine over the trainer's Megatron model (see the module docstring)."""

    def __init__(self, cfg, model: Optional[torch.nn.Module] = None, *, max_batch_size: Optional[int] = None,
                 max_tokens_per_step: Optional[int] = None, keep_codes: bool = False, kernels=None):
        from megatron_qrl.models import build_model

        _check_single_process_layout()
        self.cfg = cfg
        ro = cfg.rollout
        self.model = model if model is not None else build_model(cfg)[0]
        self.model.eval()
        self.model.requires_grad_(False)
        self.device = next(self.model.parameters()).device
        self.format = ro.weights
        self.scheme = ro.scheme if ro.weights in FP4_FORMATS else "w16a16"
        quantized = self._configure_linears(cfg)
        self.store = WeightStore(dict(self.model.named_parameters()), quantized, ro.weights)
        # GPU: the FP4 linears run on the W4A16 Triton kernels (kernel_linears.py; kernels="on" forces it)
        dtype = next(self.model.parameters()).dtype
        self.kernels = (KernelLinears(self.model, set(quantized), ro.weights, self.scheme == "w4a4")
                        if kernels_wanted(kernels, self.device, dtype, ro.weights) else None)
        if self.kernels is not None:
            self._free_dense_copies(self.kernels.packed_weights())
        mc = self.model.config
        self.max_batch_size = max_batch_size or ro.max_batch_size
        self.max_tokens_per_step = max_tokens_per_step
        self.cache = KVCache(num_layers=len(self.model.decoder.layers), max_slots=self.max_batch_size,
                             max_len=cfg.model.max_sequence_length, num_kv_heads=mc.num_query_groups,
                             head_dim=cfg.model.head_dim, dtype=mc.params_dtype, device=self.device,
                             kv_format=ro.kv_cache, scratch=True,
                             packed=packed_storage(ro.kv_cache, cfg.model.head_dim, self.device, self.kernels is not None))
        self.runner = ModelRunner(self.model, self.cache)
        self.routing = RoutingRecorder(self.model)
        self.keep_codes = keep_codes
        self.trace_layers = cfg.cached_layers() if cfg.trace.enabled and self.scheme == "w4a4" else []
        self.trace_recorder = TraceRecorder(cfg, self.model, self.trace_layers)   # the capture sink, the records
        self.version = -1
        self.released = False
        # decode path, chosen once (decode_path.py): the static loop is built at the first generate()
        self.decode_mode = resolve_decode_mode(ro.decode, self.device, unsupported_reason(self.model, cfg))
        self._static_loop = None
        self._param_shapes: dict[str, torch.Size] = {}
        self.stats = {"generate_calls": 0, "sequences": 0, "generated_tokens": 0, "steps": 0,
                      "forwarded_tokens": 0, "peak_batch": 0, "refused_updates": 0}

    # ---------------------------------------------------------------------------------------- setup
    def _configure_linears(self, cfg) -> list[str]:
        """Inference settings per FP4 linear; returns the parameter names the weight store keeps in FP4."""
        from megatron_qrl.models import fp4_linears
        from megatron_qrl.models.fp4_linear import OFF, QuantSettings

        ro = cfg.rollout
        names = {id(m): n for n, m in self.model.named_modules()}
        quantized = []
        from megatron_qrl.models.lora import configure_engine_linear, is_lora_linear

        for lin in fp4_linears(self.model):
            if is_lora_linear(lin):  # QeRL mode: frozen base shared with the trainer, not a parameter (pipeline/sync/lora.py)
                lin.quant = configure_engine_linear(lin, cfg)
            elif ro.weights in FP4_FORMATS and rollout_quantized(lin.site, cfg.quant.targets):
                # weights arrive as FP4 values already; inputs are quantized only in W4A4
                lin.quant = QuantSettings(format=ro.weights, weights=False, activations=ro.scheme == "w4a4",
                                          fallback_shift=cfg.trace.fallback_shift)
                quantized.append(f"{names[id(lin)]}.weight")
            else:
                lin.quant = OFF
        return quantized

    def _free_dense_copies(self, names: set[str]) -> None:
        """The kernels read these weights packed: their parameters keep no storage (an empty tensor, so a
        stray dense read fails on its shape instead of computing with stale values)."""
        self.store.keep_packed_only(names)
        for name, p in self.model.named_parameters():
            if name in names:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    # ------------------------------------------------------------------------------------- weights
    def update_weights(self, weights: Mapping[str, Payload], version: int, hashes: Mapping[str, str]) -> None:
        """Digest-checked, all-or-nothing weight install (see WeightStore.stage)."""
        try:
            if self.released:
                raise WeightUpdateError("engine memory is released; call resume_memory() before update_weights()")
            if not isinstance(version, int) or version < 0:
                raise WeightUpdateError(f"version must be an int >= 0, got {version!r}")
            staged = self.store.stage(weights, hashes)
            never_loaded = set(self.store.missing()) - set(staged)
            if never_loaded:
                raise WeightUpdateError(f"the first weight update must cover every parameter; missing "
                                        f"{len(never_loaded)}, e.g. {sorted(never_loaded)[:3]}")
        except WeightUpdateError:
            self.stats["refused_updates"] += 1
            raise
        self.store.commit(staged, hashes, version)
        self.store.materialize(staged.keys())
        if self.kernels is not None:
            self.kernels.prepare(self.store)      # kernel weight layout: once per sync, never per call
        self.version = version
        self.trace_recorder.reset(version)        # TRACE records belong to the weights that made them

    def sync_from_model(self, source: torch.nn.Module, version: int) -> dict[str, str]:
        """Pack `source`'s weights (an unsharded trainer model) with the codec and install them; returns digests."""
        chunks = source if isinstance(source, (list, tuple)) else [source]
        if self.store.packed_only and any(c is self.model for c in chunks):
            raise ValueError("the engine's own model holds no values for the FP4 weights its kernels read packed "
                             "(EmbeddedEngine._free_dense_copies); sync from the trainer's model, or see "
                             "tools/seeded_weights.py for random weights")
        named = [(n, p) for c in chunks for n, p in c.named_parameters()]
        weights, hashes = pack_state(named, self.format, lambda n: n in self.store.quantized)
        self.update_weights(weights, version, hashes)
        return hashes

    def set_aqn_noise(self, sigma: float, seed: int) -> int:
        """Fresh AQN draw Z ~ N(0, sigma^2) in every AQN norm (replaces the previous one). Returns #norms.

        The draw order is the model's (megatron_qrl.models.set_aqn_noise), so a trainer that applies AQN too
        (aqn.apply_to=both) gets the same Z from the same seed.
        """
        from megatron_qrl.models import set_aqn_noise

        return set_aqn_noise(self.model, sigma, generator=torch.Generator().manual_seed(int(seed)))

    # ------------------------------------------------------------------------------------ generate
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[RolloutSample]:
        self._check_ready(prompts, sampling)
        if self.decode_mode != "eager":
            if self._static_loop is None:
                self._static_loop = build_graph_loop(self, self.decode_mode)
            samples = self._static_loop.generate(prompts, sampling)
            self.stats["generate_calls"] += 1
            self.stats["sequences"] += len(prompts)
            return self.trace_recorder.keep(samples, sampling.index_offset)
        seqs = [Sequence(i, [int(t) for t in p], sampling, sequence_generator(sampling.seed, sampling.index_offset + i))
                for i, p in enumerate(prompts)]
        scheduler = ContinuousBatchScheduler(self.cache, self.max_batch_size, self.max_tokens_per_step)
        for s in seqs:
            scheduler.submit(s)
        # per-step R3 ids / TRACE capture records stay on the device, untouched, until the end of the call
        records = RolloutRecords(self.routing.layers, self.format, self.keep_codes)
        while scheduler.has_work():
            self._step(scheduler.plan(), records)
            scheduler.retire_finished()
        self._collect(seqs, records)
        self.stats["generate_calls"] += 1
        self.stats["sequences"] += len(seqs)
        self.stats["peak_batch"] = max(self.stats["peak_batch"], scheduler.peak_running)
        return self.trace_recorder.keep([self._to_sample(s) for s in seqs], sampling.index_offset)

    def score(self, prompts: list[list[int]], responses: list[list[int]]) -> list[torch.Tensor]:
        """Teacher-forced policy log-probs [T_i] of given responses (prefill of prompt + response[:-1]).

        Same numerics as generate() except that each sequence is forwarded in one step, which matters only
        for W4A4 (the activation global scale is per tensor, so it depends on the tokens in the step).
        """
        if len(prompts) != len(responses):
            raise ValueError(f"score needs one response per prompt ({len(prompts)} prompts, "
                             f"{len(responses)} responses)")
        longest = max((len(r) for r in responses), default=1)
        vocab = self.cfg.model.vocab_size
        if any(r and (min(r) < 0 or max(r) >= vocab) for r in responses):
            raise ValueError(f"responses hold token ids outside [0, {vocab})")
        self._check_ready(prompts, SamplingParams(max_new_tokens=max(1, longest)))
        out: list[torch.Tensor] = [torch.zeros(0)] * len(prompts)
        for start in range(0, len(prompts), self.max_batch_size):
            idx = [i for i in range(start, min(start + self.max_batch_size, len(prompts))) if responses[i]]
            if not idx:
                continue
            slots = [self.cache.acquire_slot() for _ in idx]
            try:
                runs = [(slot, list(prompts[i]) + list(responses[i][:-1]), 0) for slot, i in zip(slots, idx)]
                batch = StepBatch.build(runs, self.device)
                where = torch.cat([torch.arange(batch.row_starts[b] + len(prompts[i]) - 1,
                                                batch.row_starts[b] + batch.row_lens[b]) for b, i in enumerate(idx)])
                logits = self.runner.forward(batch, where.to(self.device)).cpu()
                self.routing.collect(batch.num_tokens)
            finally:
                for slot in slots:
                    self.cache.free_slot(slot)
            offset = 0
            for i in idx:
                n = len(responses[i])
                out[i] = policy_logprobs(logits[offset:offset + n], torch.tensor(responses[i]))
                offset += n
        return out

    def _check_ready(self, prompts, sampling: SamplingParams) -> None:
        if self.released:
            raise RuntimeError("engine memory is released; call resume_memory() before generate()")
        if self.version < 0:
            raise RuntimeError("the engine has no weights yet; call update_weights() (or sync_from_model()) first")
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        vocab = self.cfg.model.vocab_size
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
            if min(p) < 0 or max(p) >= vocab:
                raise ValueError(f"prompt {i} holds token ids outside [0, {vocab})")
            if len(p) + sampling.max_new_tokens > self.cache.max_len:
                raise ValueError(f"prompt {i} ({len(p)} tokens) + max_new_tokens ({sampling.max_new_tokens}) "
                                 f"exceeds model.max_sequence_length ({self.cache.max_len})")

    def _step(self, plan: StepPlan, records: RolloutRecords) -> None:
        runs = [(s.slot, feed, s.num_cached) for s, feed in zip(plan.sequences, plan.feeds)]
        batch = StepBatch.build(runs, self.device)
        with self.trace_recorder.recording() as captured:
            logits = self.runner.forward(batch)
        routed = self.routing.collect(batch.num_tokens)
        spans = [(seq.index, batch.row_starts[b], batch.row_starts[b] + batch.row_lens[b])
                 for b, seq in enumerate(plan.sequences)]
        records.add_step(routed, captured, spans, batch.num_tokens)
        self.stats["steps"] += 1
        self.stats["forwarded_tokens"] += batch.num_tokens
        for seq, feed in zip(plan.sequences, plan.feeds):
            seq.num_cached += len(feed)
        rows = [b for b, s in enumerate(plan.samples) if s]
        if rows:
            seqs = [plan.sequences[b] for b in rows]
            tokens, logprobs = sample_step(logits[rows], seqs[0].params, [s.generator.key for s in seqs],
                                           [len(s.tokens) for s in seqs])
            for seq, token, logprob in zip(seqs, tokens, logprobs):
                seq.accept(token, logprob)
            self.stats["generated_tokens"] += len(rows)

    def _collect(self, seqs: list[Sequence], records: RolloutRecords) -> None:
        """Per-sequence R3 ids (host) and TRACE captures (left on the engine's device) of the whole call."""
        routed, trace = records.finish([s.index for s in seqs])
        for s in seqs:
            s.routed = [routed[s.index]] if routed[s.index] is not None else []
            s.trace = {layer: {role: [cap] for role, cap in roles.items()} for layer, roles in trace[s.index].items()}

    def _to_sample(self, s: Sequence) -> RolloutSample:
        routed = torch.cat(s.routed, dim=0) if s.routed else None
        trace = {layer: {role: concat_rows(chunks) for role, chunks in roles.items()}
                 for layer, roles in s.trace.items()}
        return RolloutSample(
            prompt_ids=s.prompt, tokens=s.tokens,
            logprobs=torch.tensor(s.logprobs, dtype=torch.float32) if s.params.return_logprobs else None,
            finish_reason=s.finish_reason, routed_experts=routed, trace=trace, weight_version=self.version)

    # ------------------------------------------------------------------------------ memory / status
    def release_memory(self) -> None:
        """Colocated mode: drop parameter storage and the KV cache; the packed weights move to host memory."""
        if self.released:
            return
        self._static_loop = None          # its graphs point at the buffers freed below
        self.cache.release()
        self.store.offload()
        if self.kernels is not None:
            self.kernels.drop()
        for name, p in self.model.named_parameters():
            self._param_shapes[name] = p.shape
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.released = True

    def resume_memory(self) -> None:
        """Re-create parameter storage from the weight store (same bytes as before) and the KV cache."""
        if not self.released:
            return
        for name, p in self.model.named_parameters():
            shape = (0,) if name in self.store.packed_only else self._param_shapes[name]
            p.data = torch.empty(shape, dtype=p.dtype, device=p.device)
        self.store.materialize()
        if self.kernels is not None:
            self.kernels.prepare(self.store)
        self.cache.allocate()
        self.released = False

    def health(self) -> dict:
        return {
            "engine": "embedded", "device": str(self.device), "weight_version": self.version,
            "weights": self.format, "scheme": self.scheme, "kv_cache": self.cache.kv_format,
            "kv_cache_packed": self.cache.packed, "memory": "released" if self.released else "resident",
            "weight_store_bytes": self.store.nbytes(), "kv_cache_bytes": self.cache.nbytes(),
            "max_batch_size": self.max_batch_size, "trace_layers": list(self.trace_layers),
            "fp4_kernels": self.kernels is not None, "packed_only_weights": len(self.store.packed_only),
            "decode": self.decode_mode,
            "graphs_captured": self._static_loop.graphs.captures if self._static_loop is not None else 0,
            "graph_failure": self._static_loop.graphs.failure if self._static_loop is not None else None,
            "graph_capture_s": self._static_loop.graphs.capture_s if self._static_loop is not None else 0.0,
            **self.stats,
        }
