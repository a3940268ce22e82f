"""Self-generating tasks for the tiny CPU model: `arithmetic` ("12+7=" -> "19") and `countdown`
("T:22 N:3,5,7 A:" -> "(3+5)*7-..."). Sample i of a split is a pure function of (task params, seed, split, i),
so runs are reproducible and resumable without storing data.

Held-out split: a prompt belongs to eval iff a hash of (seed, prompt) falls in the held-out fraction; the
train split rejects those prompts, so eval problems are never trained on even when the problem space is small.
"""
from __future__ import annotations

import hashlib
import random
from typing import Callable, Optional

from megatron_qrl.data.sample import Sample

HELDOUT_FRACTION = 0.1
_MAX_TRIES = 10_000


def _heldout(seed: int, prompt: str, fraction: float) -> bool:
    h = int.from_bytes(hashlib.blake2b(f"{seed}|{prompt}".encode(), digest_size=8).digest(), "big")
    return (h % 1_000_000) < fraction * 1_000_000


def arithmetic_problem(rng: random.Random, max_operand: int = 20, ops: str = "+-") -> Sample:
    """a op b with operands in [0, max_operand); subtraction is ordered so results are >= 0."""
    a, b, op = rng.randrange(max_operand), rng.randrange(max_operand), rng.choice(ops)
    if op == "-" and a < b:
        a, b = b, a
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return Sample(prompt=f"{a}{op}{b}=", answer=str(value), response=str(value), task="arithmetic")


def countdown_problem(rng: random.Random, count: int = 3, max_number: int = 10) -> Sample:
    """Random numbers combined by a random expression tree (+, -, *, exact /) whose value is the target;
    the tree's expression (each number used once) is the SFT response."""
    while True:
        numbers = [rng.randint(1, max_number) for _ in range(count)]
        items = [(n, str(n), True) for n in numbers]  # (value, text, is_atom)
        while len(items) > 1:
            (x, xs, xa), (y, ys, ya) = items.pop(rng.randrange(len(items))), items.pop(rng.randrange(len(items)))
            ops = ["+", "*"] + (["-"] if x != y else []) + (["/"] if y > 0 and x % y == 0 and y != 1 else [])
            op = rng.choice(ops)
            if op == "-" and x < y:
                (x, xs, xa), (y, ys, ya) = (y, ys, ya), (x, xs, xa)
            value = {"+": x + y, "-": x - y, "*": x * y, "/": x // y if op == "/" else 0}[op]
            lhs = xs if xa or op in "+-" or (op in "*/" and _top_op(xs) in "*/") else f"({xs})"
            rhs = ys if ya else f"({ys})"
            items.append((value, f"{lhs}{op}{rhs}", False))
        target, expr, _ = items[0]
        if target > 0:
            break
    prompt = f"T:{target} N:{','.join(str(n) for n in sorted(numbers))} A:"
    return Sample(prompt=prompt, answer=str(target), response=expr, task="countdown",
                  meta={"numbers": sorted(numbers), "target": target})


def _top_op(expr: str) -> str:
    """The lowest-precedence operator outside parentheses ('' for an atom): '+-' wins over '*/'."""
    depth, found = 0, ""
    for ch in expr:
        depth += (ch == "(") - (ch == ")")
        if depth == 0 and ch in "+-":
            return ch
        if depth == 0 and ch in "*/":
            found = found or ch
    return found


class SyntheticTask:
    """Indexable split of a synthetic task: len() = size, [i] -> Sample, deterministic in (seed, split, i)."""

    def __init__(self, name: str, split: str = "train", size: int = 100_000, seed: int = 0,
                 heldout_fraction: float = HELDOUT_FRACTION, **params):
        makers: dict[str, Callable[..., Sample]] = {"arithmetic": arithmetic_problem, "countdown": countdown_problem}
        if name not in makers:
            raise ValueError(f"unknown synthetic task '{name}'; choose arithmetic or countdown")
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval' (got '{split}')")
        if not 0 < heldout_fraction < 1:
            raise ValueError(f"heldout_fraction must be in (0, 1) (got {heldout_fraction})")
        self.name, self.split, self.size, self.seed = name, split, int(size), int(seed)
        self.heldout_fraction, self.params, self._make = heldout_fraction, params, makers[name]

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Sample:
        if not 0 <= index < self.size:
            raise IndexError(f"sample {index} out of range for {self.name}/{self.split} of size {self.size}")
        return self._draw(random.Random(f"{self.name}|{self.seed}|{self.split}|{index}"))

    def _draw(self, rng: random.Random, avoid: Optional[set] = None) -> Optional[Sample]:
        """Rejection-sample a problem of this split (and, with `avoid`, a new prompt; None if none is found)."""
        want_heldout = self.split == "eval"
        for _ in range(_MAX_TRIES):
            s = self._make(rng, **self.params)
            if _heldout(self.seed, s.prompt, self.heldout_fraction) == want_heldout and \
                    (avoid is None or s.prompt not in avoid):
                return s
        if avoid is not None:
            return None
        raise RuntimeError(f"{self.name}: no {self.split} problem found in {_MAX_TRIES} draws; widen the task "
                           "(data.max_operand / countdown_max_number) or change heldout_fraction")

    def distinct(self, count: int) -> list[Sample]:
        """`count` samples with distinct prompts (used for the eval set). When the split has fewer distinct
        problems (a small task space), all of them are used and then repeated in order."""
        rng, seen, out = random.Random(f"{self.name}|{self.seed}|{self.split}|distinct"), set(), []
        while len(out) < count:
            s = self._draw(rng, seen)
            if s is None:
                if not out:
                    raise RuntimeError(f"{self.name}: the {self.split} split is empty; widen the task")
                return out + [out[i % len(out)] for i in range(count - len(out))]
            seen.add(s.prompt)
            out.append(s)
        return out
