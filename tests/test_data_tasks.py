import pytest

from megatron_qrl.config import DataConfig
from megatron_qrl.data import SyntheticTask, build_datasets, task_reward
from megatron_qrl.rl import compute_rewards


@pytest.mark.parametrize("task", ["arithmetic", "countdown"])
def test_deterministic_in_seed_split_index(task):
    a, b = SyntheticTask(task, "train", 1000, seed=7), SyntheticTask(task, "train", 1000, seed=7)
    assert [a[i] for i in (0, 5, 999)] == [b[i] for i in (0, 5, 999)]
    assert a[3] == a[3]  # random access, no hidden iteration state
    other = SyntheticTask(task, "train", 1000, seed=8)
    assert [a[i].prompt for i in range(20)] != [other[i].prompt for i in range(20)]
    with pytest.raises(IndexError):
        a[1000]


def test_arithmetic_sample_format():
    s = SyntheticTask("arithmetic", size=50, seed=0, max_operand=20)
    for i in range(50):
        x = s[i]
        a, rest = x.prompt[:-1].replace("-", "+").split("+")[0], x.prompt
        assert rest.endswith("=") and x.answer == x.response
        assert int(x.answer) == eval(x.prompt[:-1])  # noqa: S307 - our own generated text, not model output
        assert 0 <= int(a) < 20 and int(x.answer) >= 0


@pytest.mark.parametrize("task", ["arithmetic", "countdown"])
def test_sft_responses_earn_full_reward(task):
    ds = SyntheticTask(task, "train", 200, seed=3)
    samples = [ds[i] for i in range(200)]
    assert compute_rewards([s.response for s in samples], samples, task) == [1.0] * 200
    assert compute_rewards(["garbage"] * 200, samples, task) == [0.0] * 200


@pytest.mark.parametrize("task", ["arithmetic", "countdown"])
def test_eval_split_is_held_out(task):
    params = {"max_operand": 50} if task == "arithmetic" else {}
    train = SyntheticTask(task, "train", 3000, seed=1, **params)
    evals = SyntheticTask(task, "eval", 64, seed=1, **params).distinct(64)
    assert len({s.prompt for s in evals}) == 64
    assert not {train[i].prompt for i in range(3000)} & {s.prompt for s in evals}


def test_small_task_space_eval_repeats_all_heldout_problems():
    # operands in [0, 4): 16 sums + 10 differences; ~10% are held out
    evals = SyntheticTask("arithmetic", "eval", 64, seed=0, max_operand=4).distinct(64)
    distinct = list(dict.fromkeys(s.prompt for s in evals))
    assert len(evals) == 64 and 1 <= len(distinct) < 26
    assert [s.prompt for s in evals] == [distinct[i % len(distinct)] for i in range(64)]
    train = SyntheticTask("arithmetic", "train", 500, seed=0, max_operand=4)
    assert not {train[i].prompt for i in range(500)} & set(distinct)


def test_build_datasets_from_config():
    train, evals = build_datasets(DataConfig(task="countdown", eval_size=16, synthetic_size=500, seed=2))
    assert len(train) == 500 and len(evals) == 16 and evals[0].meta["target"] > 0
    assert task_reward(DataConfig(task="countdown")) == "countdown"
    assert task_reward(DataConfig(task="countdown", reward="pkg:fn")) == "pkg:fn"
    train2, evals2 = build_datasets({"task": "countdown", "eval_size": 16, "synthetic_size": 500, "seed": 2})
    assert evals2 == evals and train2[7] == train[7]
