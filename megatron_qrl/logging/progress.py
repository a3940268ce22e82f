"""Progress bars for long loops (RL steps, generation, conversion), shown only where a person watches.

Only rank 0 draws, and only on a terminal: batch logs (Slurm output files, CI) would otherwise fill with
carriage-return garbage. QRL_NO_PROGRESS=1 turns bars off everywhere.
"""
from __future__ import annotations

import os
import sys
from typing import IO, Any, Iterable, Mapping, Optional

from tqdm import tqdm


def progress_enabled(rank: int = 0, stream: Optional[IO] = None, env: Optional[Mapping[str, str]] = None) -> bool:
    """True on rank 0 writing to a TTY, unless QRL_NO_PROGRESS is set to a true value."""
    env = os.environ if env is None else env
    if env.get("QRL_NO_PROGRESS", "").strip().lower() in ("1", "true", "yes", "on"):
        return False
    if rank != 0:
        return False
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def progress_bar(iterable: Optional[Iterable] = None, total: Optional[int] = None, desc: str = "",
                 rank: int = 0, unit: str = "it", initial: int = 0, **kwargs: Any) -> tqdm:
    """A tqdm bar (disabled unless `progress_enabled`); use as an iterator or call .update()/.set_postfix().

    A disabled bar is a cheap no-op with the same methods, so callers never branch on rank or TTY.
    `initial` lets a resumed run start the bar at its restored step.
    """
    stream = kwargs.pop("file", None) or sys.stderr
    return tqdm(iterable, total=total, desc=desc, unit=unit, initial=initial, file=stream,
                disable=not progress_enabled(rank, stream), dynamic_ncols=True, **kwargs)
