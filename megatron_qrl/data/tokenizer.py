"""The tokenizer interface of the RL job, and the character-level tokenizer of the tiny CPU model.

Every tokenizer the pipeline uses (this one, or data/hf_tokenizer.py's HFTokenizer for `model.hf_path`)
offers: vocab_size, pad_id, eos_id (ends an SFT target), stop_ids (end a generation), encode, decode
(stops at the first stop id, drops special tokens) and encode_prompt (a dataset prompt -> the ids the
policy is conditioned on, through the chat template when there is one).

CharTokenizer: one id per character, vocab < 64; enough characters for the synthetic tasks ("12+7=",
"T:22 N:3,5,7 A:") and short English prompts. Ids 0..3 are PAD, BOS, EOS, UNK; unknown characters encode to
UNK (or raise with strict=True). It has no chat template.
"""
from __future__ import annotations

from typing import Iterable, Protocol


class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int
    eos_id: int
    stop_ids: tuple[int, ...]
    has_chat_template: bool

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def encode_prompt(self, prompt: str) -> list[int]: ...

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARS = "0123456789+-*/()= .,:?<>" + "abcdefghijklmnopqrstuvwxyz" + "AQNT"


class CharTokenizer:
    pad_id, bos_id, eos_id, unk_id = 0, 1, 2, 3
    stop_ids = (eos_id,)
    has_chat_template = False

    def __init__(self, chars: str = CHARS):
        if len(set(chars)) != len(chars):
            raise ValueError("tokenizer characters must be unique")
        self.chars = chars
        self._to_id = {c: i + len(SPECIALS) for i, c in enumerate(chars)}
        self.vocab_size = len(SPECIALS) + len(chars)

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False, strict: bool = False) -> list[int]:
        ids = [self.bos_id] if add_bos else []
        for pos, ch in enumerate(text):
            i = self._to_id.get(ch)
            if i is None:
                if strict:
                    raise ValueError(f"character {ch!r} at position {pos} is not in the tokenizer's vocabulary "
                                     f"({self.chars!r})")
                i = self.unk_id
            ids.append(i)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int], stop_at_eos: bool = True) -> str:
        """Text of `ids`, skipping PAD/BOS, stopping at the first EOS; UNK decodes to U+FFFD."""
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id and stop_at_eos:
                break
            if i in (self.pad_id, self.bos_id, self.eos_id):
                continue
            j = i - len(SPECIALS)
            out.append(self.chars[j] if 0 <= j < len(self.chars) else "\ufffd")
        return "".join(out)

    def encode_prompt(self, prompt: str) -> list[int]:
        """BOS + the prompt's characters (the toy tasks have no chat template)."""
        return self.encode(prompt, add_bos=True)

    def __len__(self) -> int:
        return self.vocab_size

