"""Where checkpoints live and which one is the latest: `{output_dir}/checkpoints/step_XXXXXX`, plus a
`latest` pointer written atomically (temp file + rename) only after the checkpoint itself is complete,
so a crash mid-write never makes a partial checkpoint 'latest'. Resume does not trust the pointer alone:
it takes the newest complete checkpoint whose checksums verify (`complete_checkpoints`, setup.py)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional


def checkpoint_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def step_path(output_dir: str | Path, step: int) -> Path:
    return checkpoint_dir(output_dir) / f"step_{step:06d}"


def latest_checkpoint(output_dir: str | Path) -> Optional[Path]:
    pointer = checkpoint_dir(output_dir) / "latest"
    if not pointer.is_file():
        return None
    path = checkpoint_dir(output_dir) / pointer.read_text().strip()
    return path if path.is_dir() else None


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Resume candidates, newest first: `step_*` directories holding a manifest (written last, so a save
    killed midway never qualifies; its `.step_*.tmp-*` directory does not match either). Checksums are
    verified when one is loaded (trainer/checkpoint.py)."""
    found = [d for d in checkpoint_dir(output_dir).glob("step_*")
             if d.is_dir() and d.name[5:].isdigit() and (d / "manifest.json").is_file()]
    return sorted(found, key=lambda d: int(d.name[5:]), reverse=True)


def mark_latest(output_dir: str | Path, path: str | Path) -> None:
    pointer = checkpoint_dir(output_dir) / "latest"
    tmp = pointer.with_suffix(".tmp")
    tmp.write_text(Path(path).name + "\n")
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, pointer)
