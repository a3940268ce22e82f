"""Megatron's optimizer and LR schedule for the trainer, with the CPU choice documented.

GPU: `get_megatron_optimizer` with the distributed optimizer when cfg.trainer.use_distributed_optimizer
(optimizer states sharded over data-parallel ranks, grads reduce-scattered).
CPU: Megatron's distributed optimizer checks for `torch.cuda.*Tensor` parameter types and rejects CPU
tensors, so on CPU we use Megatron's *non-distributed* optimizer (FP32Optimizer / mixed precision,
chained for expert and dense parameters). It is the same Megatron code path otherwise: grads are
all-reduced over data-parallel ranks by Megatron's DDP and finalize_model_grads, and gradient
clipping computes the norm across model-parallel ranks (Megatron's get_grad_norm_fp32, with the CPU
shim's clip patch).
"""
from __future__ import annotations

import torch
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_qrl.platform.distributed import default_group_is_trainers


def use_distributed_optimizer(cfg) -> bool:
    return bool(cfg.trainer.use_distributed_optimizer) and torch.cuda.is_available()


def optimizer_config(cfg) -> OptimizerConfig:
    t = cfg.trainer
    return OptimizerConfig(
        optimizer="adam",
        lr=t.lr,
        min_lr=t.min_lr,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        clip_grad=t.clip_grad,
        bf16=t.bf16,
        params_dtype=torch.bfloat16 if t.bf16 else torch.float32,
        use_distributed_optimizer=use_distributed_optimizer(cfg),
    )


def build_optimizer(cfg, chunks: list):
    with default_group_is_trainers():   # Megatron aligns param groups over the default group
        return get_megatron_optimizer(optimizer_config(cfg), chunks)


def total_optimizer_steps(cfg) -> int:
    return max(1, cfg.run.total_steps * cfg.rl.updates_per_batch)


def build_scheduler(cfg, optimizer) -> OptimizerParamScheduler:
    t = cfg.trainer
    steps = total_optimizer_steps(cfg)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if t.lr_warmup_steps else t.lr,
        max_lr=t.lr,
        min_lr=t.min_lr,
        lr_warmup_steps=t.lr_warmup_steps,
        lr_decay_steps=max(steps, t.lr_warmup_steps + 1),
        lr_decay_style=t.lr_decay_style,
        start_wd=t.weight_decay,
        end_wd=t.weight_decay,
        wd_incr_steps=steps,
        wd_incr_style="constant",
    )
