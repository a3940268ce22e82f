"""Final-numeric-answer verifier (GSM8K style). Pure string parsing: model text is never evaluated.

Extraction order (the first rule that finds a number wins): the last "#### N", the last "\\boxed{N}",
the last "answer is N" / "answer: N", otherwise the last number in the text. Numbers may carry thousands
commas, a sign, decimals, a fraction a/b or \\frac{a}{b}, a trailing % or $ prefix. Comparison is exact on
rationals with a small relative tolerance (1e-6), so "0.75", "3/4" and "\\frac{3}{4}" all match 0.75.
"""
from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Optional

MAX_CHARS = 20_000     # only the tail of longer responses is searched (the final answer is at the end)
MAX_NUMBER_CHARS = 40  # longer digit strings are not answers (and would be slow to convert)
REL_TOL = 1e-6

# a '-' right after a digit, letter or ')' is a binary minus ("12-7"), not a sign
_NUM = r"(?:(?<![\w.)])-)?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+(?:\.\d+)?)?|(?:(?<![\w.)])-)?\.\d+"
_NUM_RE = re.compile(_NUM)
_FRAC_RE = re.compile(r"(-?)\\d?frac\{\s*(-?\d+(?:\.\d+)?)\s*\}\{\s*(-?\d+(?:\.\d+)?)\s*\}")
_HASH_RE = re.compile(r"####\s*([^\n]*)")
_ANSWER_IS_RE = re.compile(r"answer\s*(?:is|:|=)\s*:?\s*([^\n]*)", re.IGNORECASE)


def parse_number(text: str) -> Optional[Fraction]:
    """'1,234.5' | '-3/4' | '$12' | '\\frac{3}{4}' | '50%' -> Fraction, else None (never raises)."""
    try:
        s = text.strip().rstrip(".").strip()
        m = _FRAC_RE.fullmatch(s)
        if m:
            num, den = Fraction(m.group(2)), Fraction(m.group(3))
            if den == 0:
                return None
            return (-1 if m.group(1) else 1) * num / den
        s = s.replace("$", "").replace(",", "").replace(" ", "").rstrip("%")
        if not s or len(s) > MAX_NUMBER_CHARS or not re.fullmatch(r"-?(\d+(\.\d+)?|\.\d+)(/\d+(\.\d+)?)?", s):
            return None
        if "/" in s:
            a, b = s.split("/")
            b_val = Fraction(b)
            return None if b_val == 0 else Fraction(a) / b_val
        return Fraction(s)
    except (ValueError, ZeroDivisionError, ArithmeticError):
        return None


def _boxed_contents(text: str) -> list[str]:
    """Contents of every \\boxed{...}, with balanced nested braces (bounded scan, no recursion)."""
    out, start = [], 0
    while True:
        i = text.find("\\boxed{", start)
        if i < 0:
            return out
        j, depth = i + len("\\boxed{"), 1
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        if depth:
            return out
        out.append(text[i + len("\\boxed{"): j - 1])
        start = j


def _last_number(segment: str) -> Optional[Fraction]:
    frac = list(_FRAC_RE.finditer(segment))
    nums = list(_NUM_RE.finditer(segment))
    cands = [(m.end(), m.group(0)) for m in frac] + [(m.end(), m.group(0)) for m in nums]
    for _, tok in sorted(cands, key=lambda c: c[0], reverse=True):
        val = parse_number(tok)
        if val is not None:
            return val
    return None


def _first_number(segment: str) -> Optional[Fraction]:
    whole = parse_number(segment)
    if whole is not None:
        return whole
    frac = _FRAC_RE.search(segment)
    num = _NUM_RE.search(segment)
    for m in sorted([x for x in (frac, num) if x], key=lambda x: x.start()):
        val = parse_number(m.group(0))
        if val is not None:
            return val
    return None


def extract_answer(text) -> Optional[Fraction]:
    """The response's final numeric answer, or None when there is none (never raises)."""
    if not isinstance(text, str) or not text:
        return None
    text = text[-MAX_CHARS:]
    try:
        hashes = _HASH_RE.findall(text)
        if hashes:
            return _first_number(hashes[-1])
        boxed = _boxed_contents(text)
        if boxed:
            return _first_number(boxed[-1])
        said = _ANSWER_IS_RE.findall(text)
        if said:
            val = _first_number(said[-1])
            if val is not None:
                return val
        return _last_number(text)
    except (ValueError, ArithmeticError, RecursionError):
        return None


def numbers_match(a: Fraction, b: Fraction, rel_tol: float = REL_TOL) -> bool:
    return abs(a - b) <= rel_tol * max(Fraction(1), abs(b))


def math_reward(response, answer) -> float:
    """1.0 when the response's final number equals the reference answer (a number or text like '#### 42')."""
    try:
        if isinstance(answer, (Fraction, int)):
            ref = Fraction(answer)
        elif isinstance(answer, float):
            ref = Fraction(answer) if math.isfinite(answer) else None
        else:
            ref = extract_answer(str(answer))
        if ref is None:
            return 0.0
        got = extract_answer(response)
        return 1.0 if got is not None and numbers_match(got, ref) else 0.0
    except Exception:  # a verifier must never take a run down
        return 0.0
