import pytest

from megatron_qrl.data import PromptBatches, SyntheticTask


def _prompts(batch):
    return [s.prompt for s in batch]


def test_epochs_cover_dataset_and_are_deterministic():
    ds = SyntheticTask("arithmetic", size=10, seed=0)
    it = PromptBatches(ds, 3, seed=1)
    epoch0 = [_prompts(next(it)) for _ in range(3)]  # 9 of 10; the tail is skipped
    assert it.state_dict()["epoch"] == 0
    first_e1 = _prompts(next(it))
    assert it.state_dict()["epoch"] == 1 and it.state_dict()["position"] == 3
    assert len({p for b in epoch0 for p in b}) == len({ds[i].prompt for i in range(10)} & {p for b in epoch0
                                                                                          for p in b})
    again = PromptBatches(ds, 3, seed=1)
    assert [_prompts(next(again)) for _ in range(4)] == epoch0 + [first_e1]
    unshuffled = PromptBatches(ds, 5, shuffle=False)
    assert _prompts(next(unshuffled)) == [ds[i].prompt for i in range(5)]


def test_resume_from_state_dict():
    ds = SyntheticTask("countdown", size=20, seed=0)
    a = PromptBatches(ds, 4, seed=9)
    for _ in range(7):
        next(a)
    state = a.state_dict()
    expected = [_prompts(next(a)) for _ in range(6)]
    b = PromptBatches(ds, 4, seed=9)
    b.load_state_dict(state)
    assert [_prompts(next(b)) for _ in range(6)] == expected
    with pytest.raises(ValueError, match="same data settings"):
        PromptBatches(ds, 5, seed=9).load_state_dict(state)


def test_batch_larger_than_dataset():
    with pytest.raises(ValueError, match="fewer than one batch"):
        PromptBatches(SyntheticTask("arithmetic", size=3), 4)
