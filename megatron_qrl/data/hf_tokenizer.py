"""The tokenizer of a local Hugging Face model directory (`model.hf_path`), behind the pipeline's interface.

Loaded with transformers' AutoTokenizer from local files only (never a hub download). What the pipeline
needs beyond encode/decode comes from the directory too:
- stop ids: generation_config.json's `eos_token_id` (an id or a list: chat models stop at the end-of-turn
  token and at end-of-text) plus the tokenizer's own eos token; eos_id, the token an SFT target ends with,
  is the first of them (generation_config.json's first, e.g. Qwen3's <|im_end|>).
- pad id: the tokenizer's pad token, else generation_config.json's, else eos_id (padding is masked anyway).
- prompts: with the chat template on, a prompt becomes [system message,] user message + the generation
  prompt (`add_generation_prompt=True`), rendered to text by the template and encoded without adding
  special tokens again; with it off, the plain prompt with the tokenizer's own special tokens (e.g. BOS).
- responses: decoded up to the first stop id, special tokens dropped.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Optional

# the files one of which a Hugging Face tokenizer is built from (fast, sentencepiece, or BPE vocab + merges)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
_PROMPT_CACHE_SIZE = 1 << 16


class TokenizerError(ValueError):
    """A model directory whose tokenizer cannot serve the run; the message names the file/field and the fix."""


def _id_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def read_generation_config(directory: Path) -> dict:
    """generation_config.json of the model directory ({} when absent)."""
    f = directory / "generation_config.json"
    if not f.is_file():
        return {}
    try:
        data = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise TokenizerError(f"'{f}' is not valid JSON ({e}); re-save it with transformers") from None
    return data if isinstance(data, dict) else {}


class HFTokenizer:
    """AutoTokenizer(local_files_only=True) of `directory` with the pipeline's tokenizer interface."""

    def __init__(self, directory: str | Path, chat_template: Optional[bool] = None,
                 system_prompt: Optional[str] = None, chat_template_kwargs: Optional[dict[str, Any]] = None):
        directory = Path(directory)
        present = [f for f in TOKENIZER_FILES if (directory / f).is_file()]
        if not present:
            raise TokenizerError(f"model.hf_path '{directory}' has no tokenizer files (none of "
                                 f"{', '.join(TOKENIZER_FILES)}); copy the model's tokenizer files "
                                 "(tokenizer.json, tokenizer_config.json, ...) into it")
        from transformers import AutoTokenizer

        try:
            self.hf = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except Exception as e:  # transformers raises OSError/ValueError/... depending on what is broken
            raise TokenizerError(f"transformers cannot load the tokenizer of model.hf_path '{directory}' "
                                 f"({type(e).__name__}: {e}); check its tokenizer files") from None
        self.directory = directory
        self.has_chat_template = bool(getattr(self.hf, "chat_template", None))
        if chat_template and not self.has_chat_template:
            raise TokenizerError(f"data.chat_template=true, but the tokenizer of '{directory}' has no chat template "
                                 "(no chat_template.jinja, no chat_template in tokenizer_config.json); set "
                                 "data.chat_template=false or add the model's template")
        self.use_chat_template = self.has_chat_template if chat_template is None else bool(chat_template)
        if not self.use_chat_template and (system_prompt or chat_template_kwargs):
            raise TokenizerError("data.system_prompt / data.chat_template_kwargs need the chat template: set "
                                 "data.chat_template=true (or leave it unset) or drop them")
        self.system_prompt = system_prompt
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        gen = read_generation_config(directory)
        stops = _id_list(gen.get("eos_token_id")) + _id_list(self.hf.eos_token_id)
        if not stops:
            raise TokenizerError(f"'{directory}' names no end-of-sequence token (generation_config.json "
                                 "eos_token_id, tokenizer eos_token); generation could never stop: add one")
        self.stop_ids = tuple(dict.fromkeys(stops))
        self.eos_id = self.stop_ids[0]
        pads = _id_list(self.hf.pad_token_id) or _id_list(gen.get("pad_token_id")) or [self.eos_id]
        self.pad_id = pads[0]
        self.bos_id = self.hf.bos_token_id
        ids = list(self.hf.get_vocab().values())
        self.vocab_size = max(len(self.hf), max(ids) + 1 if ids else 0)
        self._special = set(self.hf.all_special_ids)
        self._prompts: dict[str, list[int]] = {}

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Plain text -> ids, without the tokenizer's automatic special tokens (BOS/EOS only when asked)."""
        ids = list(self.hf.encode(text, add_special_tokens=False))
        if add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids + [self.eos_id] if add_eos else ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids` up to the first stop id, special tokens dropped."""
        out = []
        for i in ids:
            i = int(i)
            if i in self.stop_ids:
                break
            if i not in self._special:
                out.append(i)
        return self.hf.decode(out, skip_special_tokens=True)

    def render_prompt(self, prompt: str) -> str:
        """The text the policy sees for a dataset prompt (the chat template applied when it is on)."""
        if not self.use_chat_template:
            return prompt
        messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else []) + \
            [{"role": "user", "content": prompt}]
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                           **self.chat_template_kwargs)

    def encode_prompt(self, prompt: str) -> list[int]:
        """A dataset prompt -> the ids generation starts from (cached: prompts repeat every epoch and group)."""
        ids = self._prompts.get(prompt)
        if ids is None:
            text = self.render_prompt(prompt)
            # the template writes its special tokens as text: do not add BOS/EOS a second time
            ids = list(self.hf.encode(text, add_special_tokens=not self.use_chat_template))
            if len(self._prompts) < _PROMPT_CACHE_SIZE:
                self._prompts[prompt] = ids
        return list(ids)

    def __len__(self) -> int:
        return self.vocab_size
