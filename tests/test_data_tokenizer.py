import pytest

from megatron_qrl.config import ModelConfig
from megatron_qrl.data import CharTokenizer, SyntheticTask
from megatron_qrl.data.tokenizer import CHARS


def test_round_trip_and_specials():
    tok = CharTokenizer()
    assert tok.vocab_size == len(tok) <= 64 and tok.vocab_size <= ModelConfig().vocab_size
    text = CHARS + " T:22 N:3,5,7 A:(3+5)*7-1/2"
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and len(ids) == len(text) + 2
    assert tok.decode(ids) == text
    assert len({tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id}) == 4
    assert max(ids) < tok.vocab_size
    # decoding skips padding and stops at EOS (generated continuations after EOS are ignored)
    assert tok.decode([tok.pad_id] + tok.encode("12") + [tok.eos_id] + tok.encode("99")) == "12"
    assert tok.decode(tok.encode("12") + [tok.eos_id] + tok.encode("9"), stop_at_eos=False) == "129"


def test_unknown_characters():
    tok = CharTokenizer()
    assert tok.encode("1€") == [tok.encode("1")[0], tok.unk_id]
    assert tok.decode([tok.unk_id, 999]) == "\ufffd\ufffd"
    with pytest.raises(ValueError, match="not in the tokenizer"):
        tok.encode("1€", strict=True)


@pytest.mark.parametrize("task", ["arithmetic", "countdown"])
def test_synthetic_tasks_fit_the_tokenizer(task):
    tok = CharTokenizer()
    for split in ("train", "eval"):
        ds = SyntheticTask(task, split, size=300, seed=5)
        for i in range(len(ds)):
            s = ds[i]
            for text in (s.prompt, s.response):
                assert tok.unk_id not in tok.encode(text, strict=True)
