"""A checkpoint write that fails leaves nothing behind and says why when the disk is full.

Why: the trainer writes into `.step_N.tmp-<stamp>` and renames it when complete (trainer/checkpoint.py), so a
failed write never becomes a checkpoint, but its partial directory used to stay and fill the disk further.
And a full disk does not look like one: PyTorch's writer reports `unexpected pos 704 vs 598` and Megatron
wraps it as `Worker failure`, with no errno. So after any failure the partial directory is removed (rank 0,
which created it), and when the failure carries ENOSPC, or the disk had less than LOW_SPACE_BYTES free
at that moment, it becomes DiskFull naming the disk and what to do.
"""
from __future__ import annotations

import shutil
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

from megatron_qrl.errors import LOW_SPACE_BYTES, DiskFull, free_bytes, is_disk_full

from megatron_qrl.run_dir import latest_checkpoint


def remove_partial(path: Path) -> list[Path]:
    """The temporary directories of an unfinished write of `path` (`.NAME.tmp-*`), removed."""
    found = sorted(path.parent.glob(f".{path.name}.tmp-*")) if path.parent.is_dir() else []
    for d in found:
        shutil.rmtree(d, ignore_errors=True)
    return found


@contextmanager
def checkpoint_write(path: Path):
    """Wrap the write of checkpoint `path` (runs/NAME/checkpoints/step_N)."""
    try:
        yield
    except BaseException as err:
        free = free_bytes(path.parent)      # before the partial files are removed: what the writer saw
        if not dist.is_initialized() or dist.get_rank() == 0:
            remove_partial(path)
        failed = not isinstance(err, (KeyboardInterrupt, SystemExit, GeneratorExit))   # PyTorch DCP's
        # CheckpointException is a BaseException, not an Exception
        full = is_disk_full(err) or (failed and free is not None and free < LOW_SPACE_BYTES)
        if not full:
            raise
        latest = latest_checkpoint(path.parent.parent)
        room = f"{free / 2 ** 20:.1f} MiB free" if free is not None else "free space unknown"
        raise DiskFull(f"disk full while writing checkpoint {path.name} to {path.parent} ({room} there; the "
                       "partial checkpoint was removed). Free space on that disk, or set run.output_dir to another "
                       "one, then rerun the same command: it resumes from "
                       f"{latest.name if latest else 'the start (no checkpoint was committed yet)'}") from err
