"""Countdown verifier: does the response's expression over the given numbers evaluate to the target?

A hand-written recursive-descent parser (no eval, no ast of model text) accepts only non-negative integer
literals, binary + - * /, and parentheses, with limits on length, literal size and nesting depth. Arithmetic
is exact (fractions); division by zero, unknown characters, any limit, or a literal not among the given
numbers (each used at most once; `require_all=True` demands every number) all score 0.
"""
from __future__ import annotations

import re
from collections import Counter
from fractions import Fraction
from typing import Optional, Sequence

MAX_EXPR_CHARS = 256
MAX_DEPTH = 32
MAX_LITERAL_DIGITS = 9

_TOKEN_RE = re.compile(r"\s*(\d+|[-+*/()])")
_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class _Reject(Exception):
    """The expression is malformed or breaks a limit."""


class _Parser:
    """expr := term (('+'|'-') term)*;  term := factor (('*'|'/') factor)*;  factor := INT | '(' expr ')'."""

    def __init__(self, text: str):
        self.toks, pos = [], 0
        text = text.rstrip()
        while pos < len(text):
            m = _TOKEN_RE.match(text, pos)
            if not m:
                raise _Reject(f"unexpected character at {pos}")
            self.toks.append(m.group(1))
            pos = m.end()
        self.i, self.literals = 0, []

    def peek(self) -> Optional[str]:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise _Reject("unexpected end")
        self.i += 1
        return tok

    def parse(self) -> Fraction:
        val = self.expr(0)
        if self.peek() is not None:
            raise _Reject("trailing tokens")
        return val

    def expr(self, depth: int) -> Fraction:
        val = self.term(depth)
        while self.peek() in ("+", "-"):
            op, rhs = self.take(), self.term(depth)
            val = val + rhs if op == "+" else val - rhs
        return val

    def term(self, depth: int) -> Fraction:
        val = self.factor(depth)
        while self.peek() in ("*", "/"):
            op, rhs = self.take(), self.factor(depth)
            if op == "*":
                val = val * rhs
            elif rhs == 0:
                raise _Reject("division by zero")
            else:
                val = val / rhs
        return val

    def factor(self, depth: int) -> Fraction:
        tok = self.take()
        if tok == "(":
            if depth + 1 > MAX_DEPTH:
                raise _Reject("nesting too deep")
            val = self.expr(depth + 1)
            if self.take() != ")":
                raise _Reject("unbalanced parentheses")
            return val
        if tok.isdigit():
            if len(tok) > MAX_LITERAL_DIGITS:
                raise _Reject("literal too long")
            self.literals.append(int(tok))
            return Fraction(int(tok))
        raise _Reject(f"unexpected token {tok!r}")


def evaluate_expression(text: str) -> Optional[tuple[Fraction, list[int]]]:
    """(exact value, literals used) of a + - * / ( ) expression, or None if it is not one (never raises)."""
    if not isinstance(text, str) or len(text) > MAX_EXPR_CHARS:
        return None
    try:
        p = _Parser(text)
        if not p.toks:
            return None
        return p.parse(), p.literals
    except (_Reject, RecursionError, ValueError, ArithmeticError):
        return None


def extract_expression(response: str) -> str:
    """The candidate expression: the last <answer>...</answer>, else the last non-empty line; then the part
    before '=' (so "3*5+2=17" gives "3*5+2")."""
    tags = _ANSWER_TAG_RE.findall(response[-4 * MAX_EXPR_CHARS:])
    text = tags[-1] if tags else next((ln for ln in reversed(response.splitlines()) if ln.strip()), "")
    return text.split("=", 1)[0].strip()


def countdown_reward(response, numbers: Sequence[int], target, require_all: bool = False) -> float:
    """1.0 when the expression uses each given number at most once (all of them if require_all) and equals
    the target exactly; else 0.0."""
    try:
        if not isinstance(response, str):
            return 0.0
        got = evaluate_expression(extract_expression(response))
        if got is None:
            return 0.0
        value, used = got
        avail = Counter(int(n) for n in numbers)
        need = Counter(used)
        if any(need[k] > avail[k] for k in need):
            return 0.0
        if require_all and need != avail:
            return 0.0
        return 1.0 if value == Fraction(target) else 0.0
    except Exception:  # a verifier must never take a run down
        return 0.0
