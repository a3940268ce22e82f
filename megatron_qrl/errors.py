"""One presentation of errors for every `qrl` command (and the torchrun entry points).

Why: a user who typed a wrong path or field needs one line naming the problem, the file or field and the
fix, not a 60-line traceback around it. So:
    bad input (config, data file, checkpoint dir, ...)  one line `qrl CMD: error: ...`, exit status 2
    disk full (ENOSPC / EDQUOT, anywhere in the chain)  one line naming it, exit status 1
    Ctrl-C or SIGTERM                                     one line: what was saved, how to resume; 130
    anything else (a bug)                                 the traceback, as Python prints it
`--debug` or QRL_DEBUG=1 prints the traceback in every case. Only rank 0 reports bad input and
interrupts (every rank sees the same ones); other errors are reported on the rank where they happened.
"""
from __future__ import annotations

import errno
import os
import shutil
import signal
import sys
import traceback
from typing import Callable, Iterator, Optional

EXIT_ENVIRONMENT = 1
EXIT_INPUT = 2
EXIT_INTERRUPTED = 130

# Exception classes that mean bad input, as "module:Class". A class is looked up only when its module is
# already imported: an exception of it cannot exist otherwise, and `qrl --help` stays free of torch.
INPUT_ERRORS = ("megatron_qrl.errors:InputError", "megatron_qrl.config:ConfigError",
                "megatron_qrl.data.loaders:DataError", "megatron_qrl.trainer.checkpoint:CheckpointError",
                "megatron_qrl.convert.errors:ConvertError", "megatron_qrl.trace.errors:TraceBudgetError")
# Failures of the machine or a service, not of the input: one line with the message (it says what to check).
ENVIRONMENT_ERRORS = ("megatron_qrl.pipeline.guards:EngineFailure",)
LOW_SPACE_BYTES = 64 << 20   # a write that failed with less than this free on its disk failed of a full disk


class InputError(ValueError):
    """Bad input from the user; the message names the problem, the file or field, and the fix."""


class PromptTooLong(InputError):
    """A prompt that leaves no room for the response in the model's context."""


class DiskFull(OSError):
    """A write failed because its disk is full; the message says which write and what to do."""

    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class Interrupted(KeyboardInterrupt):
    """Ctrl-C / SIGTERM, carrying what was saved and how to resume (the command builds the text)."""


def debug_enabled(flag: Optional[bool] = None) -> bool:
    return bool(flag) or os.environ.get("QRL_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """The exception, its causes/contexts, and the per-rank failures PyTorch DCP wraps (CheckpointException)."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f for f in failures.values() if isinstance(f, BaseException)]


def _is_known(exc: BaseException, specs: tuple) -> bool:
    for spec in specs:
        module, name = spec.split(":")
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None and isinstance(exc, cls):
            return True
    return False


def is_input_error(exc: BaseException) -> bool:
    return _is_known(exc, INPUT_ERRORS)


def is_disk_full(exc: BaseException) -> bool:
    return any(isinstance(e, DiskFull) or (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT))
               or "No space left on device" in str(e) for e in _chain(exc))


def free_bytes(path) -> Optional[int]:
    """Free bytes on the disk holding `path` (its nearest existing parent); None when it cannot be read."""
    from pathlib import Path

    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def disk_full_message(exc: BaseException) -> str:
    """The DiskFull's own text, else one naming the file that could not be written."""
    for e in _chain(exc):
        if isinstance(e, DiskFull):
            return e.message
    name = next((e.filename for e in _chain(exc) if isinstance(e, OSError) and e.filename), None)
    where = f" writing '{name}'" if name else ""
    return (f"disk full{where} (No space left on device): free space on that disk, or point run.output_dir to "
            "another one; then rerun the same command (a run resumes from its last checkpoint)")


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def _rank() -> int:
    from megatron_qrl.logging.console import env_rank

    return env_rank()


def _groups_started() -> bool:
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def present(command: str, body: Callable[[], object], debug: Optional[bool] = None) -> int:
    """Run `body` (a command) and turn what it raises into the presentation above; returns the exit status."""
    from megatron_qrl.logging.console import setup_console

    debug = debug_enabled(debug)
    rank = _rank()
    setup_console(rank, debug=debug)
    previous = None
    try:
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)   # Slurm / torchrun stop a job with SIGTERM
    except ValueError:   # not the main thread (e.g. called from a test's worker thread)
        pass
    try:
        return int(body() or 0)
    except KeyboardInterrupt as err:
        if debug:
            traceback.print_exc()
        if rank == 0:
            note = str(err) if isinstance(err, Interrupted) else ""
            print(f"qrl {command}: interrupted" + (f"; {note}" if note else ""), file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except (SystemExit, GeneratorExit):
        raise
    except BaseException as err:  # noqa: BLE001 - PyTorch DCP's CheckpointException is a BaseException
        if is_disk_full(err):
            status, text = EXIT_ENVIRONMENT, disk_full_message(err)
        elif is_input_error(err):
            status, text = EXIT_INPUT, str(err)
        elif _is_known(err, ENVIRONMENT_ERRORS):
            status, text = EXIT_ENVIRONMENT, str(err)
        else:
            raise   # a bug: its traceback is the useful output
        if debug:
            traceback.print_exc()
        if rank == 0 or status != EXIT_INPUT or _groups_started():   # before the groups: all ranks say the same
            print(f"qrl {command}: error: {text}", file=sys.stderr, flush=True)
        return status
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if "megatron_qrl.platform.distributed" in sys.modules:   # process groups this command started
            sys.modules["megatron_qrl.platform.distributed"].teardown()


def script_main(command: str, prog: str, add_arguments: Callable, run: Callable) -> int:
    """`python -m megatron_qrl.launch.<script>`: parse the command's arguments (+ --debug) and present(run)."""
    import argparse

    parser = argparse.ArgumentParser(prog=prog)
    add_arguments(parser)
    parser.add_argument("--debug", action="store_true", help="show tracebacks (also QRL_DEBUG=1)")
    args = parser.parse_args()
    return present(command, lambda: run(args), debug=args.debug)
