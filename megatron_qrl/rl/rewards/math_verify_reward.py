"""MATH-style answers (LaTeX fractions, radicals, intervals, expressions) checked by the math-verify library.

The safe numeric parser (math_answer.py) only compares final numbers; MATH answers such as
"\\frac{\\sqrt{3}}{2}" or "(-\\infty, 2]" need symbolic equivalence, which math-verify (Hugging Face's
maintained verifier, sympy-based) decides. Its parsing and comparison can be slow on adversarial text, so
the reward is registered as time-limited: compute_rewards runs it under data.reward_time_limit_s per sample
(SIGALRM, the same limit user rewards get; a timeout scores 0). math-verify's own signal-based timeouts
are switched off here so that the two alarms do not overwrite each other.
"""
from __future__ import annotations

from typing import Optional

from megatron_qrl.rl.rewards.math_answer import MAX_CHARS, _boxed_contents

INSTALL_HINT = "the math_verify reward needs the math-verify package: pip install 'math-verify==0.9.0'"


def last_boxed(text: str) -> Optional[str]:
    """The contents of the last \\boxed{...} of `text` (balanced braces), or None."""
    found = _boxed_contents(text) if isinstance(text, str) else []
    return found[-1] if found else None


def _gold_text(answer: str) -> str:
    """A reference answer as math-verify reads gold best: inside \\boxed{} unless already delimited."""
    answer = answer.strip()
    return answer if ("\\boxed" in answer or "$" in answer) else f"\\boxed{{{answer}}}"


def require_math_verify() -> None:
    """Fail at setup (not per sample) when the library is missing."""
    try:
        import math_verify  # noqa: F401
    except ImportError:
        raise ImportError(INSTALL_HINT) from None


def math_verify_reward(response, answer) -> float:
    """1.0 when math-verify finds the response's final answer equivalent to the reference, else 0.0."""
    from math_verify import parse, verify

    if not isinstance(response, str) or not response or answer is None:
        return 0.0
    gold = parse(_gold_text(str(answer)), parsing_timeout=None)
    pred = parse(response[-MAX_CHARS:], parsing_timeout=None)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0
