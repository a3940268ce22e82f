"""The Megatron-Core trainer used by the RL loop: log-probs, GRPO updates, checkpoints.

    trainer = Trainer(cfg, trace=replay)         # process groups, model chunks (DDP), optimizer, LR schedule
    logp = trainer.logprobs(batch)               # [B, T] per-token log-probs, forward only, on every rank
    stats = trainer.train_step(batch, loss_fn)   # one optimizer step over the whole batch
    trainer.save(path, extra_state) / trainer.load(path)

Both passes run through Megatron's `get_forward_backward_func` (micro-batches, the 1F1B pipeline
schedule under PP). Log-probs are token-aligned: logp[:, t] = log p(tokens[:, t] | tokens[:, :t]) for
t >= 1 and logp[:, 0] = 0. They come from the labels path of GPTModel, i.e. Megatron's vocab-parallel
cross entropy, so under TP no rank ever gathers the full [tokens, vocab] logits.
`logprobs` results are gathered over data-parallel ranks on the last pipeline stage and broadcast over
the pipeline group, so every rank returns the full [B, T] tensor.

loss_fn(logp_new [mb, T'], micro_batch) -> (loss, stats) is supplied by the RL code. The trainer
minimises the SUM of `loss` over all micro-batches of all data-parallel ranks (Megatron's
calculate_per_token_loss mode: no implicit averaging), so a global token mean is written
`(terms * mb["loss_mask"]).sum() / mb["num_global_tokens"]` and a sample mean
`(per_sample * mb["sample_mask"]).sum() / mb["num_global_samples"]`; this makes the objective, and
therefore the update, independent of the parallel layout and of micro-batching. T' is T padded to a
multiple of TP under sequence parallelism (padding has loss_mask 0). Stats values are summed the same
way and returned on every rank. See megatron_qrl.trainer.batch for the batch format.

TRACE: `trace` (a trace.TraceReplay, or None) is the trainer's one source of guided rounding. Every guided pass
asks it once for the pass (`begin_pass`) and per micro-batch for the FP4 linears' guide provider
(`for_micro_batch`); its metrics (code mismatch of the first pass after a load, the transfer) come back in
train_step's stats (the KL reference's pass runs without it: trainer/reference.py).
"""
from __future__ import annotations

import time
from functools import partial
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module

from megatron_qrl.models import (build_model, clear_replay, guided_fallback_stats, pop_router_agreement,
                                 r3_routers, sequence_parallel_enabled, set_guide_provider, transformer_config,
                                 weights_changed)
from megatron_qrl.platform import Layout, device, init_distributed, trainer_group

from . import checkpoint as ckpt
from .batch import ShardedBatch, replay_ids_for_router, shard, token_logprobs
from .entropy_probe import EntropyProbe
from .optim import build_optimizer, build_scheduler, use_distributed_optimizer

LossFn = Callable[[torch.Tensor, dict], tuple]


class Trainer:
    """Megatron-Core policy trainer; see the module docstring for the API contract."""

    def __init__(self, cfg, layout: Optional[Layout] = None, trace=None):
        if cfg.trainer.bf16 and not torch.cuda.is_available():
            raise ValueError("trainer.bf16=true needs CUDA: Megatron's mixed-precision optimizer accepts only "
                             "torch.cuda tensors; set trainer.bf16=false on CPU (fp32)")
        self.cfg = cfg
        self.layout = init_distributed(cfg, layout)
        self.device = device()
        self.config = transformer_config(cfg)
        self.sequence_parallel = sequence_parallel_enabled(cfg)
        chunks = build_model(cfg, self.config)
        self.unwrapped = chunks  # the GPTModel chunks (for hooks, inspection and the rollout engine)
        if cfg.trainer.bf16:  # Megatron's mixed precision: bf16 params/activations, fp32 logits and master
            chunks = [Float16Module(self.config, c) for c in chunks]
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=use_distributed_optimizer(cfg), check_for_nan_in_grad=False)
        self.model = [DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=c) for c in chunks]
        self.optimizer = build_optimizer(cfg, self.model)
        self.scheduler = build_scheduler(cfg, self.optimizer)
        self.step = 0
        self.routers = r3_routers(self.model)
        self.entropy = EntropyProbe(self.unwrapped)   # policy/entropy of the update pass (mb['policy_entropy'])
        self.trace = trace                 # TRACE replay (trace/guidance.py) or None

    # ------------------------------------------------------------------ layout helpers
    @property
    def dp_rank(self) -> int:
        return ps.get_data_parallel_rank()

    @property
    def dp_size(self) -> int:
        return ps.get_data_parallel_world_size()

    def is_last_stage(self) -> bool:
        return ps.is_pipeline_last_stage()

    def _shard(self, batch: dict) -> ShardedBatch:
        ids = batch.get("r3_expert_ids") if self.cfg.r3.enabled else None
        if ids is not None and ids.numel():   # checked once per batch, not by every router per micro-batch
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.cfg.model.num_experts:
                raise ValueError(f"batch['r3_expert_ids'] must lie in [0, {self.cfg.model.num_experts}), got "
                                 f"[{lo}, {hi}]")
        mult = ps.get_tensor_model_parallel_world_size() if self.sequence_parallel else 1
        return shard(batch, self.dp_rank, self.dp_size, self.cfg.trainer.micro_batch_size, mult, self.device)

    # ------------------------------------------------------------------ per micro-batch hooks
    def _set_micro_batch_hooks(self, mb: dict) -> None:
        ids = mb.get("r3_expert_ids") if self.cfg.r3.enabled else None
        tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        counted = None   # tokens r3/router_agreement counts: routed by the engine, not padding
        if ids is not None:
            real = mb["sample_mask"][:, None].expand(-1, ids.shape[1]).clone()
            real[:, mb["num_real_positions"]:] = 0
            if mb.get("r3_mask") is not None:
                real = real * mb["r3_mask"]
            counted = (replay_ids_for_router(real.unsqueeze(-1), tp_rank, tp, self.sequence_parallel)[:, 0] > 0
                       ).to(self.device)   # once per micro-batch, not per router
        for router in self.routers:
            if ids is None:
                router.set_replay(None)
            else:
                if router.layer_index >= ids.shape[2]:
                    raise ValueError(f"batch['r3_expert_ids'] has {ids.shape[2]} layers; MoE layer "
                                     f"{router.layer_index} needs ids")
                router.set_replay(replay_ids_for_router(ids[:, :, router.layer_index], tp_rank, tp,
                                                        self.sequence_parallel), counted)
        guides = self.trace.for_micro_batch(mb["sample_ids"], mb["batch_rows"]) if self.trace is not None else None
        set_guide_provider(self.model, guides)

    def _clear_hooks(self) -> None:
        clear_replay(self.model)
        set_guide_provider(self.model, None)

    def _forward_step(self, loss_fn: Optional[LossFn]):
        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            self._set_micro_batch_hooks(mb)
            tokens = mb["tokens"]
            labels = torch.roll(tokens, shifts=-1, dims=1)
            output = model(tokens, mb["position_ids"], None, labels=labels)
            mb["policy_entropy"] = self.entropy.take()
            return output, partial(self._loss_func, mb, loss_fn)

        return forward_step

    @staticmethod
    def _loss_func(mb: dict, loss_fn: Optional[LossFn], output: torch.Tensor):
        logp = token_logprobs(output.float())
        num_tokens = mb["loss_mask"].sum().to(torch.int)
        if loss_fn is None:
            return output.sum() * 0.0, num_tokens, {"logp": logp.detach()}
        loss, stats = loss_fn(logp, mb)
        if not torch.is_tensor(loss) or loss.dim() != 0:
            raise TypeError("loss_fn must return (scalar loss tensor, stats dict)")
        reduced = {"loss": loss.detach().float()}
        for k, v in (stats or {}).items():
            reduced[k] = v.detach().float().sum() if torch.is_tensor(v) else torch.tensor(float(v))
        return loss, num_tokens, reduced

    def _run(self, sb: ShardedBatch, loss_fn: Optional[LossFn], forward_only: bool) -> list:
        fb = get_forward_backward_func()
        if self.trace is not None:
            self.trace.begin_pass([(mb["sample_ids"], mb["batch_rows"]) for mb in sb.micro_batches])
        try:
            return fb(forward_step_func=self._forward_step(loss_fn), data_iterator=iter(sb.micro_batches),
                      model=self.model, num_microbatches=len(sb.micro_batches), seq_length=sb.padded_seq_len,
                      micro_batch_size=self.cfg.trainer.micro_batch_size, forward_only=forward_only)
        finally:
            if self.trace is not None:
                self.trace.end_pass()
            self._clear_hooks()

    # ------------------------------------------------------------------ public API
    @torch.no_grad()
    def logprobs(self, batch: dict) -> torch.Tensor:
        """Per-token log-probs [B, T] (float32) of batch['tokens'] under the current weights, on every rank,
        on the device of batch['tokens'] (the loop's RL math runs where the batch lives)."""
        sb = self._shard(batch)
        out = self._run(sb, None, forward_only=True)
        per_rank = sb.padded_size // sb.dp_size
        if self.is_last_stage():
            local = torch.cat([o["logp"] for o in out], dim=0).float()
            if self.dp_size > 1:
                parts = [torch.empty_like(local) for _ in range(self.dp_size)]
                dist.all_gather(parts, local.contiguous(), group=ps.get_data_parallel_group())
                local = torch.cat(parts, dim=0)
        else:
            local = torch.empty(per_rank * sb.dp_size, sb.padded_seq_len, dtype=torch.float32, device=self.device)
        if ps.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(local, src=ps.get_pipeline_model_parallel_last_rank(),
                           group=ps.get_pipeline_model_parallel_group())
        return local[:sb.global_size, :sb.seq_len].to(torch.as_tensor(batch["tokens"]).device)

    def train_step(self, batch: dict, loss_fn: LossFn) -> dict:
        """Forward/backward over all micro-batches, grad sync, clipping, optimizer step, LR schedule."""
        t0 = time.perf_counter()
        sb = self._shard(batch)
        for chunk in self.model:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        # MoE aux/z losses: in per-token-loss mode Megatron multiplies them by the router's local token
        # count and expects finalize_model_grads to divide by the global token count; we keep the loss a
        # plain sum (num_tokens=None), so the division happens here. Net effect: Megatron's usual mean of
        # the aux loss over micro-batches and data-parallel ranks.
        self.config.moe_grad_scale_func = lambda n=float(sb.padded_size * sb.padded_seq_len): 1.0 / n
        self.entropy.armed = True
        try:
            out = self._run(sb, loss_fn, forward_only=False)
        finally:
            self.entropy.armed = False
        finalize_model_grads(self.model, num_tokens=None)
        ok, grad_norm, _ = self.optimizer.step()
        weights_changed()   # bf16 optimizers write the params through .data: drop the cached FP4 weights
        if ok:
            self.scheduler.step(increment=1)
            self.step += 1
        stats = self._reduce_stats(out)
        hits, total = pop_router_agreement(self.model)
        agreement = torch.stack([torch.as_tensor(hits, dtype=torch.float64, device=self.device),
                                 torch.as_tensor(total, dtype=torch.float64, device=self.device)])
        dist.all_reduce(agreement, group=trainer_group())
        if agreement[1] > 0:
            stats["r3/router_agreement"] = float(agreement[0] / agreement[1])
        fallback = guided_fallback_stats(self.model)
        if fallback["guided_elements"]:
            stats["trace/guided_fallback"] = fallback["guided_fallback"] / fallback["guided_elements"]
        if self.trace is not None:
            stats.update(self.trace.metrics())
        stats.update({"grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                      "lr": float(self.optimizer.param_groups[0]["lr"]), "update_successful": float(bool(ok)),
                      "num_micro_batches": float(len(sb.micro_batches)), "step": float(self.step),
                      "time/train_step_s": time.perf_counter() - t0})
        return stats

    def _reduce_stats(self, out: list) -> dict:
        """Sum micro-batch stats over micro-batches and DP ranks; the last stage broadcasts to the pipeline."""
        keys = sorted(out[0].keys()) if (self.is_last_stage() and out) else []
        if ps.get_pipeline_model_parallel_world_size() > 1:
            holder = [keys]
            dist.broadcast_object_list(holder, src=ps.get_pipeline_model_parallel_last_rank(),
                                       group=ps.get_pipeline_model_parallel_group())
            keys = holder[0]
        values = torch.zeros(len(keys), dtype=torch.float64, device=self.device)
        if self.is_last_stage():
            for o in out:
                values += torch.stack([o[k].double().to(self.device) for k in keys]) if keys else 0
            if self.dp_size > 1:
                dist.all_reduce(values, group=ps.get_data_parallel_group())
        if ps.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(values, src=ps.get_pipeline_model_parallel_last_rank(),
                           group=ps.get_pipeline_model_parallel_group())
        return {k: float(v) for k, v in zip(keys, values.tolist())}

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str, extra_state: Optional[dict] = None) -> str:
        """Sharded checkpoint (model, optimizer, scheduler, RNG, step, extra_state) written atomically."""
        return ckpt.save(self, path, extra_state or {})

    def load(self, path: str, load_optimizer: bool = True) -> dict:
        """Load a checkpoint saved under any TP/PP/EP layout; returns its extra_state."""
        return ckpt.load(self, path, load_optimizer=load_optimizer)
