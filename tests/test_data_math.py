"""MATH-style data (\\boxed{} answers) and its verifier, math-verify, under the per-sample time limit."""
import json

import pytest

from megatron_qrl.config import from_dict
from megatron_qrl.data import DataError, build_datasets, load_math, task_reward
from megatron_qrl.rl.rewards import compute_rewards
from megatron_qrl.rl.rewards.math_verify_reward import last_boxed, math_verify_reward

ROWS = [{"problem": "Compute $\\sin 60^\\circ$.", "solution": "It is $\\boxed{\\frac{\\sqrt{3}}{2}}$.",
         "level": "Level 2"},
        {"problem": "Solve $x^2 < 4$.", "solution": "So $x \\in \\boxed{(-2, 2)}$.", "answer": "(-2,2)"},
        {"problem": "Simplify.", "solution": "We get \\boxed{\\frac{1}{\\boxed{2}}} hmm, no: \\boxed{x^{2}+1}."}]


def write(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_math_loader_reads_boxed_answers(tmp_path):
    samples = load_math(write(tmp_path / "math.jsonl", ROWS))
    assert [s.answer for s in samples] == ["\\frac{\\sqrt{3}}{2}", "(-2,2)", "x^{2}+1"]   # answer column wins
    assert samples[0].response == ROWS[0]["solution"] and samples[0].task == "math"
    assert samples[0].meta == {"level": "Level 2", "index": 0}
    assert last_boxed("\\boxed{\\frac{a}{b}} then \\boxed{7}") == "7" and last_boxed("no box") is None
    with pytest.raises(DataError, match=r"bad.jsonl:1: no 'answer' column and no \\boxed"):
        load_math(write(tmp_path / "bad.jsonl", [{"problem": "p", "solution": "no final answer"}]))
    with pytest.raises(DataError, match="neither 'answer' nor 'solution'"):
        load_math(write(tmp_path / "bad2.jsonl", [{"problem": "p"}]))


def test_math_task_uses_math_verify(tmp_path):
    path = write(tmp_path / "math.jsonl", ROWS * 4)
    cfg = from_dict({"data": {"task": "math", "path": str(path), "eval_size": 2}}).data
    train, heldout = build_datasets(cfg)
    assert len(train) == 10 and len(heldout) == 2 and train[0].prompt.startswith(("Compute", "Solve", "Simplify"))
    assert task_reward(cfg) == "math_verify"
    assert task_reward(from_dict({"data": {"task": "gsm8k", "path": "x", "reward": "math_verify"}}).data) == \
        "math_verify"
    responses = ["... so the answer is $\\boxed{\\frac{\\sqrt3}{2}}$", "\\boxed{\\frac{1}{2}}"]
    samples = [s for s in train if s.answer == "\\frac{\\sqrt{3}}{2}"][:2]
    assert compute_rewards(responses, samples, task_reward(cfg)) == [1.0, 0.0]


@pytest.mark.parametrize("response, answer, expected", [
    ("so \\boxed{\\frac{1}{2}}", "0.5", 1.0),                       # a number the numeric parser also reads
    ("The answer is $\\frac{\\sqrt{3}}{2}$", "\\frac{\\sqrt3}{2}", 1.0),
    ("$x \\in \\boxed{(-2, 2)}$", "(-2,2)", 1.0),                    # intervals: the numeric parser cannot
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),                          # symbolic equivalence
    ("\\boxed{3}", "4", 0.0),
    ("no answer at all", "7", 0.0),
    ("", "7", 0.0),
])
def test_math_verify_equivalence(response, answer, expected):
    assert math_verify_reward(response, answer) == expected


def test_math_verify_runs_under_the_time_limit():
    response, sample = "\\boxed{x^2+2x+1}", {"answer": "(x+1)^2"}
    assert compute_rewards([response], [sample], "math_verify", time_limit_s=5.0) == [1.0]
    # sympy's parse + simplify takes milliseconds: a 0.1 ms limit interrupts it, which scores 0 (no exception)
    assert compute_rewards([response], [sample], "math_verify", time_limit_s=1e-4) == [0.0]
