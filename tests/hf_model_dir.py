"""A tiny Hugging Face model directory as a real one looks on disk, made offline for the tests.

Qwen3MoeForCausalLM (or dense Qwen3ForCausalLM) with random weights (save_pretrained), a byte-level BPE
tokenizer trained with the `tokenizers` library on a few sentences (with Qwen's special tokens
<|endoftext|>, <|im_start|>, <|im_end|>), a Qwen-style ChatML chat template, and generation_config.json
whose eos ids are [<|im_end|>, <|endoftext|>] as Qwen3's instruct releases have.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")
CORPUS = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
          "How many clips did Natalia sell altogether in April and May?", "Weng earns $12 an hour for babysitting.",
          "The answer is 72. Let me think step by step.", "What is 3 plus 4? The answer is 7.",
          "system user assistant You are a helpful math assistant."] * 4
TOKENIZER_VOCAB = 300      # 256 byte symbols + 3 specials + merges
TINY_MOE = dict(vocab_size=320, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                norm_topk_prob=True, max_position_embeddings=96, rope_theta=10000.0, rms_norm_eps=1e-6,
                tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[])

TINY_DENSE = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=96, rope_theta=10000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=True)


def save_tokenizer(path: Path, vocab_size: int = TOKENIZER_VOCAB, chat_template: str | None = CHATML):
    """Train a byte-level BPE and save it as transformers' fast tokenizer (tokenizer.json + tokenizer_config)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    if chat_template is not None:
        tok.chat_template = chat_template
    tok.save_pretrained(str(path))
    return tok


def make_hf_model_dir(path: Path, seed: int = 0, tokenizer_vocab: int = TOKENIZER_VOCAB,
                      chat_template: str | None = CHATML, dense: bool = False, **config) -> Path:
    """config.json + model.safetensors + generation_config.json + tokenizer files in `path`; dense=True: a
    Qwen3ForCausalLM of the same attention shape (intermediate_size 128, tied embeddings)."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    if dense:
        model = Qwen3ForCausalLM(Qwen3Config(**{**TINY_DENSE, **config}))
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**TINY_MOE, **config}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    model.save_pretrained(str(path))
    tok = save_tokenizer(path, tokenizer_vocab, chat_template)
    ids = tok.convert_tokens_to_ids
    GenerationConfig(eos_token_id=[ids("<|im_end|>"), ids("<|endoftext|>")], pad_token_id=ids("<|endoftext|>"),
                     do_sample=True, temperature=0.7).save_pretrained(str(path))
    return path


def write_gsm8k(path: Path, rows: int = 24) -> Path:
    """GSM8K-format JSONL ({"question", "answer": "... #### N"})."""
    lines = [json.dumps({"question": f"What is {i} plus {i + 3}?", "answer": f"{i} + {i + 3} = {2 * i + 3}\n"
                         f"#### {2 * i + 3}"}) for i in range(rows)]
    path.write_text("\n".join(lines) + "\n")
    return path
