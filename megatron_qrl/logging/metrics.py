"""The per-step metrics stream: `{output_dir}/metrics.jsonl`, mirrored to W&B.

Why JSONL first: it is durable (flushed and fsync'd every step, so a preempted job loses nothing it logged),
readable without any service, and is what `qrl plot` reads. On resume, lines for steps that will be run
again are cut off atomically, so the stream has each step once. Only rank 0 writes.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Mapping, Optional

from megatron_qrl import fault_inject
from megatron_qrl.logging.wandb_sink import WandbSink, resolve_wandb_mode

METRICS_FILE = "metrics.jsonl"
Scalar = Optional[bool | int | float | str]


def _to_scalar(key: str, value: Any) -> Scalar:
    """One metric value as a JSON scalar; non-finite floats become None (JSON has no NaN)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    item = getattr(value, "item", None)  # torch tensors and numpy scalars/arrays with one element
    if callable(item):
        size = getattr(value, "numel", None)
        count = size() if callable(size) else getattr(value, "size", 1)
        if count != 1:
            raise TypeError(f"metric '{key}' is an array with {count} elements; log a scalar "
                            "(e.g. its mean) instead")
        return _to_scalar(key, item())
    raise TypeError(f"metric '{key}' has type {type(value).__name__}; log numbers, bools or strings")


def sanitize_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Scalar]:
    """Flatten nested dicts with '/' and turn every value into a JSON scalar (non-finite -> None)."""
    out: dict[str, Scalar] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(sanitize_metrics(value, prefix=f"{name}/"))
        else:
            out[name] = _to_scalar(name, value)
    return out


def _parse_lines(text: str) -> tuple[list[dict], bool]:
    """Records in a metrics file, and whether any line was torn or garbled (a crash mid-write)."""
    records, damaged = [], False
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            damaged = True
            continue
        if isinstance(rec, dict):
            records.append(rec)
        else:
            damaged = True
    return records, damaged or (bool(text) and not text.endswith("\n"))


def read_metrics(path: str | Path) -> list[dict]:
    """All step records of a metrics.jsonl (a run dir is accepted too); a torn last line is skipped."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    return _parse_lines(path.read_text())[0]


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def truncate_metrics(path: str | Path, from_step: int) -> int:
    """Drop records with step >= from_step (and damaged lines) by an atomic rename; returns records kept.

    Why: after a restart from the checkpoint of step N the loop logs N, N+1, ... again; without this
    the stream would hold those steps twice.
    """
    path = Path(path)
    if not path.exists():
        return 0
    records, damaged = _parse_lines(path.read_text())
    kept = [r for r in records if not isinstance(r.get("step"), int) or r["step"] < from_step]
    if len(kept) == len(records) and not damaged:
        return len(kept)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r, allow_nan=False) + "\n" for r in kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    return len(kept)


class MetricsLogger:
    """Append one JSON line per step to {output_dir}/metrics.jsonl and mirror it to W&B (rank 0 only).

    start_step: the first step this process will log (0 for a fresh run, the step after the restored
    checkpoint on resume). Records with step >= start_step are dropped first, and the W&B run whose id
    is stored in output_dir is continued when cfg.run.resume is true.
    """

    def __init__(self, output_dir: str | Path, cfg: Any = None, rank: int = 0, start_step: int = 0,
                 env: Optional[Mapping[str, str]] = None):
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / METRICS_FILE
        self.rank = rank
        self._file = None
        self._wandb: Optional[WandbSink] = None
        if rank != 0:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        truncate_metrics(self.path, start_step)
        self._file = open(self.path, "a")
        run = getattr(cfg, "run", None)
        mode = resolve_wandb_mode(getattr(run, "wandb_mode", None), os.environ if env is None else env)
        if mode != "disabled":
            self._wandb = WandbSink(
                self.output_dir,
                project=getattr(run, "wandb_project", None) or "megatron-qrl",
                mode=mode,
                config=cfg.model_dump() if hasattr(cfg, "model_dump") else None,
                resume=bool(getattr(run, "resume", True)),
            )

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def log(self, metrics: Mapping[str, Any], step: int) -> Optional[dict[str, Scalar]]:
        """Write one step durably (flush + fsync) and mirror it to W&B; returns the record written."""
        if self._file is None:
            return None
        record: dict[str, Scalar] = {"step": int(step), "time": round(time.time(), 3)}
        record.update(sanitize_metrics(metrics))
        record["step"] = int(step)
        line = json.dumps(record, allow_nan=False) + "\n"
        torn = fault_inject.fires("torn_metrics", step, self.rank)   # tests: a kill in the middle of the write
        self._file.write(line[: len(line) // 2] if torn else line)
        self._file.flush()
        os.fsync(self._file.fileno())
        if torn:
            fault_inject.sigkill()
        fault_inject.kill("kill_after_metrics", step, self.rank)  # tests: the line is durable, the checkpoint not
        if self._wandb is not None:
            self._wandb.log(record)
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
