"""What a person reading the job's output sees: plain log lines on rank 0, library noise filtered.

Why: a run's output usually goes to a file (Slurm, nohup, CI), where progress bars do not draw; the log
lines (megatron_qrl.logging.run_report) are then all there is. They go through Python logging to stderr,
flushed per line, with a time stamp, so they read the same on a terminal and in a file. Libraries print
warnings at import and build time that tell a user of this project nothing (Transformer Engine / Apex
missing on CPU, GPTModel deprecated, ...): those are dropped once, here. Rank 0 shows the rest of the
libraries' warnings; other ranks show only our warnings and everyone's errors, so N ranks do not print
N copies of the same line.
"""
from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import IO, Mapping, Optional

PACKAGE_LOGGER = "megatron_qrl"
# Substrings of library messages that say nothing actionable to users of this project (checked per line).
LIBRARY_NOISE = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "absl.logging is not installed",
    "GPTModel IS DEPRECATED",
    "full scope is deprecated",
    "is experimental and still under active development",
    "async save is deprecated",
    "torch.distributed.reduce_op is deprecated",
    "TypedStorage is deprecated",
    "torch.distributed is disabled, unavailable or uninitialized",
    "The argument order of load has been changed",
    "Please use DTensor instead and we are deprecating ShardedTensor",
)
_HANDLER_NAME = "qrl-console"


def env_rank(env: Optional[Mapping[str, str]] = None) -> int:
    """This process's rank as the launcher set it (torchrun RANK, Slurm SLURM_PROCID, MPI), before any group."""
    env = os.environ if env is None else env
    for key in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        value = env.get(key, "").strip()
        if value.isdigit():
            return int(value)
    return 0


def is_noise(message: str) -> bool:
    return any(pattern in message for pattern in LIBRARY_NOISE)


class _NoiseFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return not is_noise(record.getMessage())
        except Exception:  # noqa: BLE001 - a malformed record is shown rather than lost
            return True


class _Formatter(logging.Formatter):
    """`[qrl 18:52:49] text`; warnings and errors say so, and name the library when it is not ours."""

    def __init__(self, rank: int):
        super().__init__(datefmt="%H:%M:%S")
        self.where = "qrl" if rank == 0 else f"qrl rank {rank}"

    def format(self, record: logging.LogRecord) -> str:
        head = f"[{self.where} {self.formatTime(record, self.datefmt)}]"
        text = record.getMessage()
        if record.levelno >= logging.WARNING:
            level = record.levelname.lower()
            origin = "" if record.name.startswith(PACKAGE_LOGGER) or record.name == "py.warnings" else \
                f" ({record.name})"
            text = f"{level}{origin}: {text}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return f"{head} {text}"


class _BarSafeHandler(logging.Handler):
    """Writes each line to the stream (default: sys.stderr as it is at that moment, so a replaced stderr,
    e.g. a test's capture, is followed) and through tqdm when a bar is on screen, so lines do not tear it."""

    def __init__(self, stream: Optional[IO] = None):
        super().__init__()
        self._stream = stream

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
            stream = self._stream or sys.stderr
            from tqdm import tqdm

            if getattr(tqdm, "_instances", None):
                tqdm.write(line, file=stream)
            else:
                stream.write(line + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging must never take the run down
            self.handleError(record)


def _log_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """warnings.showwarning -> one log line `Category: message (file.py:LINE)`, through the noise filter."""
    short = "/".join(str(filename).split("/")[-2:])
    logging.getLogger("py.warnings").warning("%s: %s (%s:%s)", category.__name__, message, short, lineno)


def _quiet_warnings(rank: int) -> None:
    for pattern in LIBRARY_NOISE:
        warnings.filterwarnings("ignore", message=f".*{pattern}")
    if rank != 0:  # one copy of a library's warning is enough: rank 0 shows it
        for category in (UserWarning, FutureWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=category)


def setup_console(rank: Optional[int] = None, debug: bool = False, stream: Optional[IO] = None) -> logging.Logger:
    """Install the console handler on the root logger (idempotent); returns the package logger.

    rank 0: our INFO lines and the libraries' warnings (minus LIBRARY_NOISE). Other ranks: our warnings
    and errors only. debug: our DEBUG lines too, and nothing filtered.
    """
    rank = env_rank() if rank is None else rank
    root = logging.getLogger()
    for h in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(h)
    handler = _BarSafeHandler(stream)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(_Formatter(rank))
    if not debug:
        handler.addFilter(_NoiseFilter())
        _quiet_warnings(rank)
    root.addHandler(handler)
    root.setLevel(logging.WARNING if rank == 0 or debug else logging.ERROR)
    warnings.showwarning = _log_warning  # warnings.warn -> logger "py.warnings" -> this handler (and its filter)
    ours = logging.getLogger(PACKAGE_LOGGER)
    ours.setLevel(logging.DEBUG if debug else logging.INFO if rank == 0 else logging.WARNING)
    return ours
