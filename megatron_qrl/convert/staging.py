"""Outputs appear whole or not at all: write into a hidden directory beside the destination, then rename.

A crash or an error mid-way leaves no half-written checkpoint at DST (the temporary directory is removed
on error; after a hard kill a `.NAME.tmp-*` directory may remain beside DST and can be deleted).
"""
from __future__ import annotations

import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .errors import ConvertError


def require_new_output(dst: str | Path) -> Path:
    """DST must not exist yet (conversions never overwrite); returns its absolute path."""
    dst = Path(dst).absolute()
    if dst.exists():
        raise ConvertError(f"output '{dst}' already exists; choose a new path or remove it first "
                           "(conversions never overwrite)")
    if not dst.parent.is_dir():
        raise ConvertError(f"the parent directory of the output '{dst}' does not exist; create "
                           f"'{dst.parent}' first")
    return dst


@contextmanager
def staged_output(dst: str | Path) -> Iterator[Path]:
    """Yield a fresh temporary directory beside `dst`; rename it to `dst` when the block succeeds."""
    dst = require_new_output(dst)
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}-{int(time.time() * 1e3)}"
    tmp.mkdir()
    try:
        yield tmp
        if dst.exists():  # created by someone else while we worked
            raise ConvertError(f"output '{dst}' appeared while converting; nothing was written there. "
                               "Choose a new path")
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
