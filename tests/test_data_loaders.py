import json

import pytest

from megatron_qrl.config import DataConfig
from megatron_qrl.data import DataError, build_datasets, load_gsm8k, load_jsonl, load_parquet, split_heldout
from megatron_qrl.rl import compute_rewards


def _write(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    return path


def test_jsonl_keys_and_meta(tmp_path):
    p = _write(tmp_path / "d.jsonl", [{"q": "1+1?", "a": 2, "numbers": [1, 1]}, {"q": "2+2?", "a": "4"}])
    s = load_jsonl(p, prompt_key="q", answer_key="a")
    assert [x.prompt for x in s] == ["1+1?", "2+2?"] and [x.answer for x in s] == ["2", "4"]
    assert s[0].meta == {"numbers": [1, 1], "index": 0} and s[1].meta["index"] == 1


def test_jsonl_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_jsonl(tmp_path / "missing.jsonl")
    p = _write(tmp_path / "d.jsonl", [{"prompt": "x", "solution": "1"}])
    with pytest.raises(DataError, match=r"missing key 'answer'.*data.answer_key"):
        load_jsonl(p)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "answer": 1}\n{not json\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        load_jsonl(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="no rows"):
        load_jsonl(empty)
    with pytest.raises(DataError, match="must be a string"):
        load_jsonl(_write(tmp_path / "n.jsonl", [{"prompt": 3, "answer": 1}]))


def test_gsm8k(tmp_path):
    rows = [{"question": "Natalia sold 48 clips...", "answer": "She sold 48/2 = 24 in May.\n#### 1,072"},
            {"question": "q2", "answer": "easy\n#### -3"}]
    s = load_gsm8k(_write(tmp_path / "gsm.jsonl", rows))
    assert [x.answer for x in s] == ["1072", "-3"] and s[0].response.endswith("#### 1,072")
    assert compute_rewards(["so 1072", "#### -3.0"], s, "gsm8k") == [1.0, 1.0]
    with pytest.raises(DataError, match="####"):
        load_gsm8k(_write(tmp_path / "g2.jsonl", [{"question": "q", "answer": "no marker"}]))


def test_parquet_needs_pyarrow(tmp_path):
    try:
        import pyarrow  # noqa: F401
        has = True
    except ImportError:
        has = False
    p = tmp_path / "d.parquet"
    if not has:
        p.write_bytes(b"PAR1")
        with pytest.raises(DataError, match="pip install pyarrow"):
            load_parquet(p)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.table({"prompt": ["a", "b"], "answer": [1, 2]}), p)
        assert [x.answer for x in load_parquet(p)] == ["1", "2"]
    with pytest.raises(DataError, match="does not exist"):
        load_parquet(tmp_path / "none.parquet")


def test_file_splits_via_config(tmp_path):
    p = _write(tmp_path / "d.jsonl", [{"prompt": f"p{i}", "answer": i} for i in range(20)])
    train, evals = build_datasets(DataConfig(task="jsonl", path=str(p), eval_size=5, seed=3))
    assert len(train) == 15 and len(evals) == 5
    assert not {s.prompt for s in train} & {s.prompt for s in evals}
    assert build_datasets(DataConfig(task="jsonl", path=str(p), eval_size=5, seed=3))[1] == evals
    with pytest.raises(DataError, match="eval_size"):
        split_heldout(train, 15)
    g = _write(tmp_path / "g.jsonl", [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(10)])
    train, evals = build_datasets(DataConfig(task="gsm8k", path=str(g), eval_size=2))
    assert len(train) == 8 and train[0].prompt.startswith("q")
    with pytest.raises(DataError, match="data.path"):
        build_datasets({"task": "jsonl"})
