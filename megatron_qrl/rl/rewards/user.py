"""User reward functions named "package.module:function", called as fn(response, sample) -> float.

Loading fails loudly (RewardFunctionError names the spec and the fix); calling never raises: an exception,
a non-numeric or non-finite return, or exceeding the per-sample time limit scores 0 and is logged (the first
few times), so one bad sample cannot take the run down.
"""
from __future__ import annotations

import importlib
import logging
import math
import signal
import threading
from typing import Any, Callable

log = logging.getLogger(__name__)
_MAX_LOGGED = 5
_logged = {"n": 0}


class RewardFunctionError(ValueError):
    """A user reward spec that cannot be resolved to a callable."""


def load_reward_fn(spec: str) -> Callable[[str, Any], float]:
    """Resolve "module:function" (the module must be importable, e.g. on PYTHONPATH) to a callable."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise RewardFunctionError(f"reward function '{spec}' must look like 'package.module:function' "
                                  "(data.reward=my_rewards:score)")
    mod_name, fn_name = spec.split(":")
    try:
        module = importlib.import_module(mod_name)
    except Exception as err:  # ImportError, or an error raised while importing the user's module
        raise RewardFunctionError(f"cannot import module '{mod_name}' for reward function '{spec}': "
                                  f"{type(err).__name__}: {err}. Put it on PYTHONPATH or fix data.reward") from err
    fn = module
    for part in fn_name.split("."):
        if not hasattr(fn, part):
            raise RewardFunctionError(f"module '{mod_name}' has no attribute '{fn_name}' (reward function "
                                      f"'{spec}'); check the name after ':'")
        fn = getattr(fn, part)
    if not callable(fn):
        raise RewardFunctionError(f"'{spec}' is a {type(fn).__name__}, not a callable reward function "
                                  "fn(response, sample) -> float")
    return fn


def _note(msg: str) -> None:
    if _logged["n"] < _MAX_LOGGED:
        _logged["n"] += 1
        log.warning(msg + ("" if _logged["n"] < _MAX_LOGGED else " (further reward errors not logged)"))


class _Timeout(Exception):
    pass


def _call_limited(fn: Callable, args: tuple, seconds: float):
    """Call fn(*args), interrupting it after `seconds` via SIGALRM when possible (main thread, POSIX);
    elsewhere the call runs unbounded."""
    if not seconds or seconds <= 0 or threading.current_thread() is not threading.main_thread() \
            or not hasattr(signal, "setitimer"):
        return fn(*args)

    def _raise(signum, frame):
        raise _Timeout()

    previous = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn(*args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def call_reward_fn(fn: Callable, response, sample, time_limit_s: float = 0.0) -> float:
    """fn(response, sample) as a finite float; 0.0 on any error, bad return value or timeout."""
    name = getattr(fn, "__name__", repr(fn))
    try:
        value = _call_limited(fn, (response, sample), time_limit_s)
    except _Timeout:
        _note(f"reward function {name} exceeded {time_limit_s}s on a sample; scored 0")
        return 0.0
    except Exception as err:
        _note(f"reward function {name} raised {type(err).__name__}: {err}; scored 0")
        return 0.0
    try:
        value = float(value)
    except (TypeError, ValueError, OverflowError):
        _note(f"reward function {name} returned {type(value).__name__}, not a number; scored 0")
        return 0.0
    if not math.isfinite(value):
        _note(f"reward function {name} returned {value}; scored 0")
        return 0.0
    return value
