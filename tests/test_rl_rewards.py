import sys
import textwrap
import time
from fractions import Fraction

import pytest

from megatron_qrl.data import Sample
from megatron_qrl.rl.rewards import (RewardFunctionError, compute_rewards, countdown_reward, evaluate_expression,
                                     extract_answer, load_reward_fn, math_reward)


@pytest.mark.parametrize("text,value", [
    ("so she has #### 42", 42), ("#### 1,234", 1234), ("The answer is -7.5.", Fraction(-15, 2)),
    ("\\boxed{\\frac{3}{4}}", Fraction(3, 4)), ("we get \\boxed{{12}} apples", 12), ("3/4", Fraction(3, 4)),
    ("first 3 then 5 then 19", 19), ("12-7=5", 5), ("Answer: $1,000,000", 1_000_000), ("it is 50%", 50),
    ("\\boxed{1} ... #### 2", 2), ("x = -0.25", Fraction(-1, 4)),
])
def test_extract_answer(text, value):
    assert extract_answer(text) == value


def test_math_reward_matches_numerically():
    assert math_reward("#### 0.75", "3/4") == 1.0
    assert math_reward("The answer is 42", "Natalia sold 48/2 = 24 ... #### 42") == 1.0
    assert math_reward("\\boxed{42.0000000001}", 42) == 1.0  # within the 1e-6 relative tolerance
    assert math_reward("#### 43", "42") == 0.0
    assert math_reward("19", 19.0) == 1.0


ADVERSARIAL = [
    None, "", "   ", 123, b"bytes", "1" * 100_000, "9" * 5000 + "/" + "0", "#### " + "9" * 10_000,
    "\\boxed{" * 10_000, "(" * 10_000 + "1" + ")" * 10_000, "__import__('os').system('echo pwned')",
    "eval('1+1')", "#### 1/0", "\\boxed{\\frac{1}{0}}", "answer is " + "-" * 50_000, "1e309", "nan", "inf",
    "\x00\xff\ud800", "1" + "," * 50_000 + "2", "((((" + "1+" * 40_000 + "1",
]


@pytest.mark.parametrize("text", ADVERSARIAL, ids=range(len(ADVERSARIAL)))
def test_adversarial_outputs_score_zero_fast(text):
    t0 = time.perf_counter()
    assert math_reward(text, "3") == 0.0
    assert countdown_reward(text, [1, 2, 3], 6) == 0.0
    assert compute_rewards([text], [Sample("p", "3")], "math") == [0.0]
    # a guard against catastrophic backtracking / unbounded evaluation (minutes), not a speed target: the
    # slowest case takes ~0.3 s alone and 1.07 s on a loaded 2-core CI host (2026-12-02), hence the margin
    assert time.perf_counter() - t0 < 10.0


def test_countdown_expressions():
    nums = [3, 5, 7]
    assert countdown_reward("(3+5)*7", nums, 56) == 1.0
    assert countdown_reward("<answer> 7*(5 + 3) </answer>", nums, 56) == 1.0
    assert countdown_reward("thinking...\n(3+5)*7 = 56", nums, 56) == 1.0
    assert countdown_reward("7*8", nums, 56) == 0.0          # 8 is not given
    assert countdown_reward("7*7+7", nums, 56) == 0.0        # 7 used more than once
    assert countdown_reward("5+3", nums, 8) == 1.0           # a number may stay unused...
    assert countdown_reward("5+3", nums, 8, require_all=True) == 0.0  # ...unless all are required
    assert countdown_reward("15/(7-5)", [15, 7, 5], Fraction(15, 2)) == 1.0  # exact fractions
    assert countdown_reward("3/(5-5)", [3, 5, 5], 0) == 0.0  # division by zero
    assert countdown_reward("-3+5", nums, 2) == 0.0          # no unary minus
    for bad in ("3**5", "3^5", "__import__('os')", "abs(3)", "3 5", "(3+5", "3+5)", "3.5+1", "[3]", "3+",
                "((((((((((((((((((((((((((((((((((3))))))))))))))))))))))))))))))))))"):
        assert countdown_reward(bad, [3, 5], 8) == 0.0, bad
    assert evaluate_expression("(" * 20 + "3" + ")" * 20) == (3, [3])  # modest nesting is fine


def test_compute_rewards_tasks():
    samples = [Sample("T:8 N:3,5 A:", "8", meta={"numbers": [3, 5], "target": 8}),
               Sample("T:8 N:3,5 A:", "8", meta={"numbers": [3, 5], "target": 8})]
    assert compute_rewards(["3+5", "3*5"], samples, "countdown") == [1.0, 0.0]
    assert compute_rewards(["12", "#### 12"], [{"answer": "12"}, {"answer": 12}], "gsm8k") == [1.0, 1.0]
    with pytest.raises(ValueError, match="responses"):
        compute_rewards(["1"], [], "math")
    with pytest.raises(RewardFunctionError, match="unknown reward"):
        compute_rewards(["1"], [{}], "no_such_task")


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(textwrap.dedent("""
        import time
        NOT_CALLABLE = 3
        def length(response, sample):
            return len(response) / 10
        def boom(response, sample):
            raise RuntimeError("bug")
        def slow(response, sample):
            time.sleep(5)
            return 1.0
        def weird(response, sample):
            return {"r": 1} if response == "a" else float("nan")
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards_mod"
    sys.modules.pop("my_rewards_mod", None)


def test_user_reward_functions(user_module):
    s = [Sample("p", "x")] * 2
    assert compute_rewards(["abc", "abcdefghij"], s, f"{user_module}:length") == [0.3, 1.0]
    assert compute_rewards(["a", "b"], s, f"{user_module}:boom") == [0.0, 0.0]
    assert compute_rewards(["a", "b"], s, f"{user_module}:weird") == [0.0, 0.0]
    t0 = time.perf_counter()
    assert compute_rewards(["a"], s[:1], f"{user_module}:slow", time_limit_s=0.2) == [0.0]
    assert time.perf_counter() - t0 < 2.0
    assert compute_rewards(["ab"], s[:1], lambda r, smp: 2.0) == [2.0]


@pytest.mark.parametrize("spec,match", [
    ("no_colon", "module:function"), ("a:b:c", "module:function"), (":f", "module:function"),
    ("surely_not_a_module_xyz:f", "cannot import"), ("os:no_such_fn", "no attribute"),
])
def test_user_reward_spec_errors(spec, match):
    with pytest.raises(RewardFunctionError, match=match):
        load_reward_fn(spec)


def test_user_reward_not_callable(user_module):
    with pytest.raises(RewardFunctionError, match="not a callable"):
        load_reward_fn(f"{user_module}:NOT_CALLABLE")
