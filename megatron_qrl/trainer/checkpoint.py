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
Orphans of a killed save (`.*.tmp-*`, `.*.old-*`) are never read and are removed by the next save.
Integrity: the manifest records the size and CRC32 of every file (the ranks split the hashing); `load`
verifies them before touching the model and raises CheckpointCorrupt naming the first bad file.
Loading under another TP/PP/EP layout works because Megatron describes each shard by its global
offsets; the RNG states are then skipped (they belong to ranks that no longer exist).
"""
from __future__ import annotations

import json
import os
import shutil
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from megatron_qrl import fault_inject
from megatron_qrl.platform import cpu as cpu_shim
from megatron_qrl.platform import job_placement

FORMAT = "megatron-qrl-dist-ckpt-v1"
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message says what to do."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint whose files are missing or do not match the manifest's sizes/checksums."""


def _layout_dict(trainer) -> dict:
    lay = trainer.layout
    return {"tp": lay.tp, "pp": lay.pp, "ep": lay.ep, "etp": lay.etp, "dp": ps.get_data_parallel_world_size(),
            "world_size": job_placement().num_trainers}


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


def _saves_optimizer(trainer) -> bool:
    """Megatron's distributed optimizer has no state before its first step (its state_dict asserts on it),
    and a never-stepped optimizer has nothing to restore: such a checkpoint (e.g. a converted start at
    step 0) holds the model only and says so in its manifest. trainer.step is the same on every rank."""
    return trainer.step > 0 or not _is_distributed(trainer.optimizer)


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
        world, rank = job_placement().num_trainers, dist.get_rank()  # trainer ranks are 0..world-1
        state["rng_state"] = ShardedObject("rng_state", None if is_loading else _rng_state(), (world,), (rank,),
                                           replica_id=0)
    return state


def read_manifest(path: str | Path) -> dict:
    p = Path(path) / MANIFEST
    if not p.is_file():
        raise CheckpointError(f"'{path}' is not a complete megatron-qrl checkpoint (no {MANIFEST}); it may be an "
                              "interrupted save: point to another checkpoint directory")
    try:
        manifest = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointCorrupt(f"'{path}': {MANIFEST} is not valid JSON ({err}); the checkpoint is damaged: "
                                "use an earlier one") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"'{path}' has format {got!r}, expected {FORMAT!r}")
    return manifest


def _data_files(root: Path) -> list[str]:
    """Every file under a checkpoint directory (relative paths), the manifest excluded."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def _crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _my_share(names: list[str]) -> list[str]:
    """Each rank hashes every world_size-th file, so a large checkpoint is read once, in parallel."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    return names[rank::world]


def _gather_dicts(local: dict) -> dict:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return local
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return {k: v for part in parts for k, v in part.items()}


def _checksums(root: Path, names: list[str]) -> dict:
    """{file: {"size", "crc32"}} for `names`, computed by all ranks together (collective)."""
    return _gather_dicts({n: {"size": (root / n).stat().st_size, "crc32": _crc32(root / n)}
                          for n in _my_share(names)})


def verify_checkpoint(path: str | Path, manifest: dict) -> None:
    """Raise CheckpointCorrupt unless every file the manifest lists is present with its size and CRC32.

    Collective when a process group is up (ranks split the files and agree on the verdict)."""
    root = Path(path)
    sums = manifest.get("checksums")
    if sums is None:  # a checkpoint written before checksums existed: presence of the listed files only
        sums = {n: None for n in manifest.get("files", []) if n != MANIFEST}
    problems = {}
    for name in _my_share(sorted(sums)):
        f, want = root / name, sums[name]
        if not f.is_file():
            problems[name] = "missing"
        elif want is not None and f.stat().st_size != want["size"]:
            problems[name] = f"size {f.stat().st_size} != {want['size']} in the manifest"
        elif want is not None and (got := _crc32(f)) != want["crc32"]:
            problems[name] = f"crc32 {got} != {want['crc32']} in the manifest"
    problems = _gather_dicts(problems)
    if problems:
        name = sorted(problems)[0]
        raise CheckpointCorrupt(f"checkpoint '{path}' is corrupt: {name}: {problems[name]} ({len(problems)} bad "
                                f"file(s)); it was damaged after it was written. Use an earlier checkpoint "
                                "(resume falls back to one automatically) or restore this one from a copy")


def _remove_orphans(parent: Path, keep: Path) -> None:
    """Temporary/aside directories that a killed save left behind (never checkpoints: no rename happened)."""
    import re

    for d in parent.iterdir():
        if d.is_dir() and d != keep and re.fullmatch(r"\..+\.(tmp|old)-\d+", d.name):
            shutil.rmtree(d, ignore_errors=True)


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
    """Write the trainer state to `path` atomically; returns the final path.

    Collective over the default group. In a disaggregated job the engine ranks are in that group too
    (PyTorch DCP plans over it), so they call save(None, path, {}) at the same point and write nothing."""
    cpu_shim.install()
    _in_process_results_queue()
    path = Path(path).absolute()
    stamp = [f"{int(time.time() * 1e3)}"]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(stamp, src=0)
    tmp = path.parent / f".{path.name}.tmp-{stamp[0]}"
    if dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_orphans(path.parent, keep=tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()

    state = {}  # trainer=None: an engine rank of a disaggregated job, joining the collective with nothing
    if trainer is not None:
        state = _sharded_state(trainer, is_loading=False, with_optimizer=_saves_optimizer(trainer), with_rng=True)
        state["scheduler"] = trainer.scheduler.state_dict()
        state["step"] = trainer.step
        state["optimizer_step"] = _adam_step(trainer.optimizer)
        state["extra_state"] = extra_state
    dist_checkpointing.save(state, str(tmp))
    dist.barrier()
    fault_inject.stall("stall_in_save", extra_state.get("step"), dist.get_rank())  # tests: kill -9 here
    names = [None]
    if dist.get_rank() == 0:
        names = [_data_files(tmp)]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(names, src=0)
    checksums = _checksums(tmp, names[0])

    if dist.get_rank() == 0:
        import megatron.core

        manifest = {"format": FORMAT, "megatron_core": megatron.core.__version__, "step": trainer.step,
                    "optimizer_state": _saves_optimizer(trainer),
                    "layout": _layout_dict(trainer), "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    "model": trainer.cfg.model.model_dump(), "quant": trainer.cfg.quant.model_dump(),
                    "files": names[0], "checksums": checksums}
        with open(tmp / MANIFEST, "w") as f:
            f.write(json.dumps(manifest, indent=1))
            f.flush()
            os.fsync(f.fileno())
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
    verify_checkpoint(path, manifest)
    if trainer is None:  # an engine rank joining the collective load (see save): only the common state
        return dist_checkpointing.load({}, str(path)).get("extra_state", {})
    m = manifest.get("model", {})
    mine = trainer.cfg.model.model_dump()
    diff = [k for k in ("num_layers", "hidden_size", "num_experts", "vocab_size", "num_attention_heads",
                        "num_query_groups", "moe_ffn_hidden_size") if m.get(k) != mine.get(k)]
    if diff:
        raise CheckpointError(f"checkpoint '{path}' was saved for a different model ({', '.join(diff)} differ); "
                              "load it with the config it was saved with")
    same_layout = manifest["layout"] == _layout_dict(trainer)
    load_optimizer = load_optimizer and manifest.get("optimizer_state", True)   # none saved: a fresh optimizer
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
    else:   # bf16 params: the optimizer's fp32 main copies would otherwise put the old weights back at its step
        trainer.optimizer.reload_model_params()
    from megatron_qrl.models import weights_changed

    weights_changed()   # load_state_dict copies through .data: drop the cached FP4 weights
    if same_layout and "rng_state" in loaded:
        _set_rng_state(loaded["rng_state"])
    trainer.step = int(loaded.get("step", manifest["step"]))
    return loaded.get("extra_state", {})
