"""A run's tokenizer and prompt splits, checked before any process group starts or any file is written.

The tokenizer is the character tokenizer for the toy configs, or the model directory's (`model.hf_path`).
Checked here, each with the field to change: the tokenizer's ids fit the model's embedding, every prompt of
a file dataset leaves room for rollout.max_new_tokens within model.max_sequence_length, and an SFT warm
start has reference responses to learn from.
"""
from __future__ import annotations

from typing import Any, Sequence

from megatron_qrl.data.datasets import build_datasets
from megatron_qrl.data.hf_tokenizer import TokenizerError
from megatron_qrl.data.loaders import DataError
from megatron_qrl.data.sample import Sample
from megatron_qrl.data.tokenizer import CharTokenizer, Tokenizer


def build_tokenizer(cfg: Any) -> Tokenizer:
    """The run's tokenizer: model.hf_path's (with data.chat_template / system_prompt), else CharTokenizer."""
    m, d = cfg.model, cfg.data
    if m.hf_path:
        from megatron_qrl.data.hf_tokenizer import HFTokenizer

        tokenizer = HFTokenizer(m.hf_path, d.chat_template, d.system_prompt, d.chat_template_kwargs)
        origin = f"the tokenizer of '{m.hf_path}'"
    else:
        tokenizer, origin = CharTokenizer(), "the character tokenizer"
    if tokenizer.vocab_size > m.vocab_size:
        fix = ("the tokenizer does not belong to this model: use the model's own tokenizer files"
               if m.hf_path else f"set model.vocab_size >= {tokenizer.vocab_size}")
        raise TokenizerError(f"{origin} has {tokenizer.vocab_size} ids, more than model.vocab_size "
                             f"({m.vocab_size}) embedding rows; {fix}")
    return tokenizer


def check_prompts_fit(tokenizer: Tokenizer, samples: Sequence[Sample], max_sequence_length: int,
                      max_new_tokens: int, split: str) -> None:
    """Every prompt (as encoded for generation) + max_new_tokens must fit the model's context."""
    room = max_sequence_length - max_new_tokens
    too_long = [(s, n) for s in samples if (n := len(tokenizer.encode_prompt(s.prompt))) > room]
    if too_long:
        s, n = max(too_long, key=lambda x: x[1])
        where = f"row {s.meta['index']}" if "index" in s.meta else repr(s.prompt[:40])
        raise DataError(f"{len(too_long)} {split} prompt(s) are too long for the model's context, e.g. {where}: "
                        f"{n} prompt tokens + rollout.max_new_tokens ({max_new_tokens}) > model.max_sequence_length "
                        f"({max_sequence_length}); raise model.max_sequence_length (up to the model's context), "
                        "lower rollout.max_new_tokens, or remove the long prompts from data.path")


def prepare_inputs(cfg: Any) -> tuple[Tokenizer, Sequence[Sample], list[Sample]]:
    """(tokenizer, train split, eval split) of a run config, every check above passed."""
    tokenizer = build_tokenizer(cfg)
    train, heldout = build_datasets(cfg.data)
    for split, samples in (("train", train), ("eval", heldout)):
        if isinstance(samples, list):   # file datasets (synthetic tasks generate short prompts on demand)
            check_prompts_fit(tokenizer, samples, cfg.model.max_sequence_length, cfg.rollout.max_new_tokens, split)
    if cfg.run.sft_steps and isinstance(train, list) and not any(s.response for s in train):
        raise DataError(f"run.sft_steps={cfg.run.sft_steps} needs reference responses, but the data.task="
                        f"{cfg.data.task} rows of '{cfg.data.path}' have none; set data.response_key to the column "
                        "that holds them, or run.sft_steps=0")
    return tokenizer, train, heldout
