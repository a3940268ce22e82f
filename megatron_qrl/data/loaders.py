"""Local prompt files: JSONL, parquet (needs pyarrow), GSM8K ({"question", "answer": "... #### 42"}) and
MATH-style sets ({"problem", "solution": "... \\boxed{\\frac{1}{2}}", optionally "answer"}).

Each row becomes a Sample: prompt = row[prompt_key], answer = str(row[answer_key]), response = row[response_key]
when given (an SFT target), meta = the other fields (so e.g. countdown rows keep "numbers"/"target") plus the
row index. Errors name the file, the line/row and the config field to fix.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable, Optional

from megatron_qrl.data.sample import Sample


class DataError(ValueError):
    """A prompt file that is missing or does not have the expected shape."""


def _check_file(path: str | Path) -> Path:
    p = Path(path)
    if not p.is_file():
        raise DataError(f"data file '{p}' does not exist; set data.path to a local .jsonl or .parquet file")
    return p


def _to_sample(row: Any, where: str, prompt_key: str, answer_key: str, response_key: Optional[str],
               task: str, index: int) -> Sample:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object per row, got {type(row).__name__}")
    for key, field in ((prompt_key, "data.prompt_key"), (answer_key, "data.answer_key")):
        if key not in row:
            raise DataError(f"{where}: missing key '{key}' (row keys: {sorted(row)}); set {field} to one of them")
    prompt = row[prompt_key]
    if not isinstance(prompt, str):
        raise DataError(f"{where}: '{prompt_key}' must be a string, got {type(prompt).__name__}")
    response = row.get(response_key, "") if response_key else ""
    meta = {k: v for k, v in row.items() if k not in (prompt_key, answer_key, response_key)}
    meta["index"] = index
    return Sample(prompt=prompt, answer=str(row[answer_key]), response=str(response or ""), meta=meta, task=task)


def _jsonl_rows(p: Path) -> Iterable[tuple[str, Any]]:
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{p}:{lineno}", json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{p}:{lineno}: not valid JSON ({err.msg}); each line must be one JSON object") \
                    from None


def _parquet_rows(p: Path) -> Iterable[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"reading parquet ('{p}') needs pyarrow: pip install pyarrow, or convert the file to "
                        "JSONL and set data.task=jsonl") from None
    for i, row in enumerate(pq.read_table(p).to_pylist()):
        yield f"{p} row {i}", row


def _rows(path: str | Path) -> Iterable[tuple[str, Any]]:
    p = _check_file(path)
    return _parquet_rows(p) if p.suffix == ".parquet" else _jsonl_rows(p)


def _load(rows, prompt_key, answer_key, response_key, task) -> list[Sample]:
    out = [_to_sample(row, where, prompt_key, answer_key, response_key, task, i)
           for i, (where, row) in enumerate(rows)]
    if not out:
        raise DataError("the data file holds no rows")
    return out


def load_jsonl(path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer",
               response_key: Optional[str] = None, task: str = "jsonl") -> list[Sample]:
    return _load(_jsonl_rows(_check_file(path)), prompt_key, answer_key, response_key, task)


def load_parquet(path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer",
                 response_key: Optional[str] = None, task: str = "parquet") -> list[Sample]:
    return _load(_parquet_rows(_check_file(path)), prompt_key, answer_key, response_key, task)


_GSM8K_FINAL = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)


def load_gsm8k(path: str | Path, prompt_key: str = "question", answer_key: str = "answer") -> list[Sample]:
    """GSM8K rows (JSONL or parquet): the answer text's '#### N' becomes `answer`; the full solution text
    (rationale + '#### N') is the SFT response."""
    out = []
    for s in _load(_rows(path), prompt_key, answer_key, None, "gsm8k"):
        m = _GSM8K_FINAL.search(s.answer)
        if not m:
            raise DataError(f"{path} row {s.meta['index']}: GSM8K answer has no '#### N' final line: "
                            f"{s.answer[-80:]!r}")
        out.append(Sample(prompt=s.prompt, answer=m.group(1).replace(",", ""), response=s.answer,
                          meta=s.meta, task="gsm8k"))
    return out


def load_math(path: str | Path, prompt_key: str = "problem", answer_key: str = "answer",
              solution_key: str = "solution") -> list[Sample]:
    """MATH-style rows (JSONL or parquet; e.g. MATH, MATH-500): `answer` is the row's answer column when it has
    one, else the last \\boxed{...} of the solution; the solution text is the SFT response."""
    from megatron_qrl.rl.rewards.math_verify_reward import last_boxed

    out = []
    for i, (where, row) in enumerate(_rows(path)):
        if isinstance(row, dict) and answer_key not in row:
            if solution_key not in row:
                raise DataError(f"{where}: neither '{answer_key}' nor '{solution_key}' in the row (keys: "
                                f"{sorted(row)}); set data.answer_key to the column with the final answer")
            boxed = last_boxed(str(row[solution_key]))
            if boxed is None:
                raise DataError(f"{where}: no '{answer_key}' column and no \\boxed{{...}} in '{solution_key}': "
                                f"{str(row[solution_key])[-80:]!r}; set data.answer_key")
            row = {**row, answer_key: boxed}
        s = _to_sample(row, where, prompt_key, answer_key, None, "math", i)
        solution = row.get(solution_key, "") if isinstance(row, dict) else ""
        meta = {k: v for k, v in s.meta.items() if k != solution_key}
        out.append(Sample(prompt=s.prompt, answer=s.answer.strip(), response=str(solution or ""), meta=meta,
                          task="math"))
    if not out:
        raise DataError(f"the data file '{path}' holds no rows")
    return out
