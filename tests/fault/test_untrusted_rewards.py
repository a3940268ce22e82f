"""Untrusted model output in rewards: the verifiers never evaluate model text (no eval/exec/compile anywhere in
the reward code), code-shaped responses are inert, and hostile inputs score 0 within the parser limits. The
per-sample time limit of user reward functions and the adversarial-input timings are in tests/test_rl_rewards.py."""
import ast
import time
from pathlib import Path

import pytest

from megatron_qrl.data import Sample
from megatron_qrl.rl.rewards import compute_rewards, countdown_reward, evaluate_expression

from .helpers import ROOT

REWARD_CODE = sorted((ROOT / "megatron_qrl/rl/rewards").glob("*.py")) + sorted((ROOT / "megatron_qrl/data").glob("*.py"))


@pytest.mark.parametrize("path", REWARD_CODE, ids=[p.name for p in REWARD_CODE])
def test_reward_code_never_evaluates_text(path: Path):
    calls = [n.func for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)]
    bare = {f.id for f in calls if isinstance(f, ast.Name)} & {"eval", "exec", "compile", "__import__"}
    attrs = {f.attr for f in calls if isinstance(f, ast.Attribute)} & {"literal_eval", "eval", "exec", "system",
                                                                       "popen", "run", "call", "Popen"}
    assert not bare | attrs, f"{path.name} calls {bare | attrs}"  # re.compile (a regex, not code) is fine


def test_code_shaped_responses_are_inert(tmp_path):
    marker = tmp_path / "pwned"
    hostile = [f"<answer>__import__('os').system('touch {marker}')</answer>",
               f"<answer>(lambda: open('{marker}', 'w'))()</answer>", "<answer>2**2**2**2**2**2</answer>",
               "<answer>" + "9" * 5000 + "</answer>", "<answer>" + "(" * 10_000 + "1" + ")" * 10_000 + "</answer>"]
    t0 = time.perf_counter()
    for text in hostile:
        assert countdown_reward(text, [1, 2, 3], 6) == 0.0
        assert evaluate_expression(text.removeprefix("<answer>").removesuffix("</answer>")) is None
        assert compute_rewards([text], [Sample("p", "6")], "math") == [0.0]
    assert time.perf_counter() - t0 < 1.0 and not marker.exists()
