"""Trainer checkpoints with megatron.core.dist_checkpointing: sharded, atomic, layout-independent.

Directory layout (one checkpoint = one directory):
    <path>/                     Megatron dist-checkpoint (torch_dist backend, PyTorch DCP files):
        model.*                 the GPTModel's sharded_state_dict (global tensors: any TP/PP/EP can load)
        optimizer.*             Adam moments as ShardedTensors following the model's sharding
        rng_state               per-rank RNG states (ShardedObject, restored only under the same layout)
        common.pt               scheduler state, trainer step, extra_state (e.g. the data position)
    <path>/manifest.json        format, megatron-core version, layout, world size, step, model config

Atomicity: every rank writes into `<parent>/.<name>.tmp-<stamp>`; after all ranks finished (barrier)
rank 0 writes the manifest last and renames the directory to `<path>` (a previous `<path>` is moved
aside first and removed after the rename). A directory without manifest.json is never a checkpoint.
Loading under another TP/PP/EP layout works because Megatron describes each shard by its global
offsets; the RNG states are then skipped (they belong to ranks that no longer exist).
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from megatron_qrl.platform import cpu as cpu_shim

FORMAT = "megatron-qrl-dist-ckpt-v1"
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message says what to do."""


def _layout_dict(trainer) -> dict:
    lay = trainer.layout
    return {"tp": lay.tp, "pp": lay.pp, "ep": lay.ep, "etp": lay.etp, "dp": ps.get_data_parallel_world_size(),
            "world_size": dist.get_world_size()}


def _rng_state() -> dict:
    import random

    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    import random

    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _model_sharded_state_dict(trainer) -> dict:
    if len(trainer.model) != 1:
        raise CheckpointError("virtual pipeline chunks are not supported by this checkpoint format")
    return trainer.model[0].module.sharded_state_dict()  # DDP -> (Float16Module ->) GPTModel


# Keys of the optimizer state follow the model's sharded keys only (no "chained_<i>." prefix): how
# Megatron splits parameters into chained optimizers (dense vs expert) depends on the layout, so prefixed
# keys would not load under another layout. The distributed optimizer (GPU) saves fully reshardable.
OPTIMIZER_METADATA = {"chained_optim_avoid_prefix": True, "distrib_optim_sharding_type": "fully_reshardable"}


def _drop_common_steps(tree) -> None:
    """Remove Megatron's per-optimizer 'common_step' (its place depends on the chaining); we keep one step."""
    if isinstance(tree, dict):
        state = tree.get("state")
        if isinstance(state, dict):
            state.pop("common_step", None)
        for v in tree.values():
            _drop_common_steps(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            _drop_common_steps(v)


def _torch_optimizers(optimizer) -> list:
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o.optimizer for o in subs if getattr(o, "optimizer", None) is not None]


def _is_distributed(optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(o, DistributedOptimizer) for o in getattr(optimizer, "chained_optimizers", [optimizer]))


def _adam_step(optimizer) -> int:
    steps = [int(st["step"]) for opt in _torch_optimizers(optimizer) for st in opt.state.values() if "step" in st]
    return max(steps, default=0)


def _with_current_param_groups(optimizer, loaded, step: int):
    """The loaded optimizer state with this optimizer's own param groups.

    Parameter-group hyperparameters (lr, wd, ...) live in the checkpoint's common part, whose nesting
    follows the *saving* layout's chaining (dense/expert optimizers); under another layout they do not
    line up. They are fully determined by the config and the LR scheduler (restored separately), so we
    take them from the current optimizer and keep only the loaded per-parameter state tensors, plus
    the Adam step (saved once as `optimizer_step`: every parameter steps on every update).
    """
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(subs) == 1:
        parts = [loaded]
    else:
        parts = [loaded[i] for i in range(len(subs))]
    for sub, part in zip(subs, parts):
        part["param_groups"] = sub.optimizer.state_dict()["param_groups"]
        part["state"] = {k: {**v, "step": torch.tensor(float(step))}
                         for k, v in part["state"].items() if isinstance(k, int)}
    return parts[0] if len(subs) == 1 else {i: p for i, p in enumerate(parts)}


def _sharded_state(trainer, is_loading: bool, with_optimizer: bool, with_rng: bool) -> dict:
    model_sd = _model_sharded_state_dict(trainer)
    state = {"model": model_sd}
    if with_optimizer:
        osd = trainer.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=OPTIMIZER_METADATA)
        _drop_common_steps(osd)
        state["optimizer"] = osd
    if with_rng:
        world, rank = dist.get_world_size(), dist.get_rank()
        state["rng_state"] = ShardedObject("rng_state", None if is_loading else _rng_state(), (world,), (rank,),
                                           replica_id=0)
    return state


def read_manifest(path: str | Path) -> dict:
    p = Path(path) / MANIFEST
    if not p.is_file():
        raise CheckpointError(f"'{path}' is not a complete megatron-qrl checkpoint (no {MANIFEST}); it may be an "
                              "interrupted save: point to another checkpoint directory")
    manifest = json.loads(p.read_text())
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"'{path}' has format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def _in_process_results_queue() -> None:
    """Megatron's synchronous torch_dist save still asks for a multiprocessing *Manager* queue, which
    spawns a helper process that re-imports the caller's __main__ (slow, and it breaks scripts without
    a main guard). The synchronous path only touches the queue from this process (writer threads),
    so an in-process queue.Queue is equivalent; we install it once unless something else already did.
    Its writer also reads the process RSS through psutil only for a debug log line; without psutil
    (not a dependency of ours) that line reports 0 instead of failing the save."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    if not filesystem_async.HAVE_PSUTIL:
        filesystem_async._process_memory = lambda: 0


def save(trainer, path: str | Path, extra_state: dict) -> str:
    """Write the trainer state to `path` atomically; returns the final path."""
    cpu_shim.install()
    _in_process_results_queue()
    path = Path(path).absolute()
    stamp = [f"{int(time.time() * 1e3)}"]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(stamp, src=0)
    tmp = path.parent / f".{path.name}.tmp-{stamp[0]}"
    if dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()

    state = _sharded_state(trainer, is_loading=False, with_optimizer=True, with_rng=True)
    state["scheduler"] = trainer.scheduler.state_dict()
    state["step"] = trainer.step
    state["optimizer_step"] = _adam_step(trainer.optimizer)
    state["extra_state"] = extra_state
    dist_checkpointing.save(state, str(tmp))
    dist.barrier()

    if dist.get_rank() == 0:
        import megatron.core

        manifest = {"format": FORMAT, "megatron_core": megatron.core.__version__, "step": trainer.step,
                    "layout": _layout_dict(trainer), "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    "model": trainer.cfg.model.model_dump(), "quant": trainer.cfg.quant.model_dump(),
                    "files": sorted(os.listdir(tmp))}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        old = path.parent / f".{path.name}.old-{stamp[0]}"
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return str(path)


def load(trainer, path: str | Path, load_optimizer: bool = True) -> dict:
    """Restore model (+ optimizer, scheduler, step; RNG when the layout is unchanged); returns extra_state."""
    cpu_shim.install()
    path = Path(path).absolute()
    manifest = read_manifest(path)
    m = manifest.get("model", {})
    mine = trainer.cfg.model.model_dump()
    diff = [k for k in ("num_layers", "hidden_size", "num_experts", "vocab_size", "num_attention_heads",
                        "num_query_groups", "moe_ffn_hidden_size") if m.get(k) != mine.get(k)]
    if diff:
        raise CheckpointError(f"checkpoint '{path}' was saved for a different model ({', '.join(diff)} differ); "
                              "load it with the config it was saved with")
    same_layout = manifest["layout"] == _layout_dict(trainer)
    state = _sharded_state(trainer, is_loading=True, with_optimizer=load_optimizer, with_rng=same_layout)
    loaded = dist_checkpointing.load(state, str(path))
    trainer.model[0].module.load_state_dict(loaded["model"], strict=True)
    if load_optimizer:
        if _is_distributed(trainer.optimizer):  # Megatron's fully reshardable format restores itself
            trainer.optimizer.load_state_dict(loaded["optimizer"])
        else:
            step = int(loaded.get("optimizer_step", loaded.get("step", 0)))
            trainer.optimizer.load_state_dict(_with_current_param_groups(trainer.optimizer, loaded["optimizer"], step))
        trainer.scheduler.load_state_dict(loaded["scheduler"])
    if same_layout and "rng_state" in loaded:
        _set_rng_state(loaded["rng_state"])
    trainer.step = int(loaded.get("step", manifest["step"]))
    return loaded.get("extra_state", {})
