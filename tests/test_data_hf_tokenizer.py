"""The tokenizer interface with a real Hugging Face tokenizer (a BPE trained here, tests/hf_model_dir.py), and
`model.hf_path` filling and checking the model config."""
import json
import shutil

import pytest

from hf_model_dir import CHATML, SPECIALS, make_hf_model_dir, save_tokenizer

from megatron_qrl.config import ConfigError, from_dict
from megatron_qrl.data import (CharTokenizer, DataError, HFTokenizer, Sample, TokenizerError, build_tokenizer,
                               check_prompts_fit, prepare_inputs)
from megatron_qrl.pipeline.rollout_batch import encode_prompts, sft_batch

SYSTEM = "You are a helpful math assistant."


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_hf_model_dir(tmp_path_factory.mktemp("tok") / "hf")


def test_ids_come_from_the_directory(hf_dir):
    from transformers import AutoTokenizer

    tok, ref = HFTokenizer(hf_dir), AutoTokenizer.from_pretrained(str(hf_dir))
    im_end, eot = ref.convert_tokens_to_ids("<|im_end|>"), ref.convert_tokens_to_ids("<|endoftext|>")
    assert tok.stop_ids == (im_end, eot)          # generation_config.json's list, in its order
    assert tok.eos_id == im_end and tok.pad_id == eot and tok.vocab_size == len(ref) == 300
    text = "Weng earns $12 an hour."             # the character tokenizer turns this into '?eng earns ?12 ...'
    assert tok.decode(tok.encode(text)) == text and tok.encode(text) == ref(text).input_ids
    assert CharTokenizer().decode(CharTokenizer().encode(text)) != text


def test_decode_stops_at_a_stop_id_and_drops_special_tokens(hf_dir):
    tok = HFTokenizer(hf_dir)
    start = tok.hf.convert_tokens_to_ids("<|im_start|>")
    ids = [start] + tok.encode("The answer is 7") + [tok.stop_ids[1]] + tok.encode(" junk")
    assert tok.decode(ids) == "The answer is 7"
    assert tok.decode(tok.encode("72") + [tok.eos_id, tok.pad_id]) == "72"


def test_prompts_go_through_the_chat_template(hf_dir):
    tok = HFTokenizer(hf_dir, system_prompt=SYSTEM)
    assert tok.has_chat_template and tok.use_chat_template          # on by default when there is a template
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 3 plus 4?"}]
    want = tok.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert want.endswith("<|im_start|>assistant\n")
    ids = tok.encode_prompt("What is 3 plus 4?")
    assert tok.hf.decode(ids) == want and ids == tok.hf(want, add_special_tokens=False).input_ids
    assert encode_prompts(tok, [Sample("What is 3 plus 4?", "7")]) == [ids]
    plain = HFTokenizer(hf_dir, chat_template=False)
    assert plain.encode_prompt("What is 3 plus 4?") == plain.encode("What is 3 plus 4?")


def test_chat_template_kwargs_reach_the_template(tmp_path):
    template = "{% if enable_thinking is defined and not enable_thinking %}NOTHINK {% endif %}" + CHATML
    save_tokenizer(tmp_path, chat_template=template)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    on = HFTokenizer(tmp_path).render_prompt("hi")
    off = HFTokenizer(tmp_path, chat_template_kwargs={"enable_thinking": False}).render_prompt("hi")
    assert off == "NOTHINK " + on


def test_sft_batch_learns_only_the_response_and_eos(hf_dir):
    tok = HFTokenizer(hf_dir, system_prompt=SYSTEM)
    s = Sample("What is 3 plus 4?", "7", response="3 + 4 = 7\n#### 7")
    b = sft_batch([s, Sample("Hi?", "1", response="1")], tok)
    p, r = tok.encode_prompt(s.prompt), tok.encode(s.response)
    n = len(p) + len(r) + 1
    assert b["tokens"][0, :n].tolist() == p + r + [tok.eos_id]
    assert b["loss_mask"][0].tolist() == [0.0] * len(p) + [1.0] * (len(r) + 1) + [0.0] * (b["tokens"].shape[1] - n)
    assert set(b["tokens"][1, b["loss_mask"][1].nonzero().max() + 1:].tolist()) <= {tok.pad_id}


def test_tokenizer_errors_name_the_fix(hf_dir, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(hf_dir, bare)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (bare / f).unlink()
    with pytest.raises(TokenizerError, match="has no tokenizer files"):
        HFTokenizer(bare)
    untemplated = tmp_path / "untemplated"
    save_tokenizer(untemplated, chat_template=None)
    assert not HFTokenizer(untemplated).use_chat_template      # default: off without a template
    with pytest.raises(TokenizerError, match=r"has no chat template .*; set data.chat_template=false"):
        HFTokenizer(untemplated, chat_template=True)
    with pytest.raises(TokenizerError, match="need the chat template"):
        HFTokenizer(hf_dir, chat_template=False, system_prompt=SYSTEM)


# ------------------------------------------------------------------------------------ model.hf_path config
def test_hf_path_fills_the_model_fields(hf_dir):
    m = from_dict({"model": {"hf_path": str(hf_dir), "max_sequence_length": 64, "init_method_std": 0.01}}).model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.kv_channels, m.num_experts,
            m.moe_router_topk, m.moe_ffn_hidden_size, m.vocab_size, m.rotary_base) == (2, 64, 4, 2, 16, 4, 2, 32, 320,
                                                                                       10000)
    assert m.max_sequence_length == 64 and m.init_method_std == 0.01 and m.hf_path == str(hf_dir.absolute())
    assert from_dict({"model": {"hf_path": str(hf_dir)}}).model.max_sequence_length == 96  # max_position_embeddings
    # the run's saved config (every field written out) loads back to the same model
    same = from_dict({"model": m.model_dump()}).model
    assert same == m


def test_hf_path_refuses_a_disagreeing_config(hf_dir, tmp_path):
    with pytest.raises(ConfigError) as err:
        from_dict({"model": {"hf_path": str(hf_dir), "num_layers": 4, "vocab_size": 320, "hidden_size": 128}})
    msg = str(err.value)
    assert "model.num_layers" in msg and "has 2, the config says 4" in msg and "has 64, the config says 128" in msg
    assert "vocab_size" not in msg                                     # an agreeing field is fine
    with pytest.raises(ConfigError, match=r"max_sequence_length \(200\) exceeds the model's context"):
        from_dict({"model": {"hf_path": str(hf_dir), "max_sequence_length": 200}})
    with pytest.raises(ConfigError, match="is not a directory"):
        from_dict({"model": {"hf_path": str(tmp_path / "nowhere")}})
    with pytest.raises(ConfigError, match="need a tokenizer with a chat template: set model.hf_path"):
        from_dict({"data": {"chat_template": True}})


def test_vocab_and_prompt_length_checks(hf_dir, tmp_path):
    cfg = from_dict({"model": {"hf_path": str(hf_dir)}})
    assert isinstance(build_tokenizer(cfg), HFTokenizer)
    assert isinstance(build_tokenizer(from_dict({})), CharTokenizer)
    small = make_hf_model_dir(tmp_path / "small", vocab_size=280)
    with pytest.raises(TokenizerError, match=r"300 ids, more than model.vocab_size \(280\)"):
        build_tokenizer(from_dict({"model": {"hf_path": str(small)}}))
    tok = build_tokenizer(cfg)
    samples = [Sample("short", "1", meta={"index": 0}), Sample("a much longer prompt " * 10, "2", meta={"index": 1})]
    check_prompts_fit(tok, samples[:1], 96, 16, "train")
    with pytest.raises(DataError, match=r"1 train prompt\(s\) are too long .* e.g. row 1: \d+ prompt tokens"):
        check_prompts_fit(tok, samples, 96, 16, "train")


def test_prepare_inputs_needs_sft_targets(hf_dir, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps({"q": f"What is {i}?", "a": str(i), "sol": f"It is {i}."})
                              for i in range(12)) + "\n")
    base = {"model": {"hf_path": str(hf_dir)}, "rollout": {"max_new_tokens": 16},
            "data": {"task": "jsonl", "path": str(rows), "prompt_key": "q", "answer_key": "a", "eval_size": 2},
            "run": {"sft_steps": 2}}
    with pytest.raises(DataError, match="set data.response_key"):
        prepare_inputs(from_dict(base))
    base["data"]["response_key"] = "sol"
    tok, train, heldout = prepare_inputs(from_dict(base))
    assert len(train) == 10 and len(heldout) == 2 and all(s.response.startswith("It is") for s in train)
    assert tok.decode(tok.encode(train[0].response)) == train[0].response
    assert SPECIALS[2] in tok.hf.decode(tok.encode_prompt(train[0].prompt))     # chat template applied
