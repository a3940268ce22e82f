"""Prompt sources for the RL loop: tokenizers (character / Hugging Face), synthetic tasks, file loaders,
resumable batches, and the checked (tokenizer, train, eval) of a run."""
from megatron_qrl.data.batches import PromptBatches
from megatron_qrl.data.datasets import build_datasets, split_heldout, task_reward
from megatron_qrl.data.hf_tokenizer import HFTokenizer, TokenizerError
from megatron_qrl.data.inputs import build_tokenizer, check_prompts_fit, prepare_inputs
from megatron_qrl.data.loaders import DataError, load_gsm8k, load_jsonl, load_math, load_parquet
from megatron_qrl.data.sample import Sample
from megatron_qrl.data.synthetic import SyntheticTask, arithmetic_problem, countdown_problem
from megatron_qrl.data.tokenizer import CharTokenizer, Tokenizer

__all__ = ["PromptBatches", "build_datasets", "split_heldout", "task_reward", "DataError", "load_gsm8k",
           "load_jsonl", "load_math", "load_parquet", "Sample", "SyntheticTask", "arithmetic_problem",
           "countdown_problem", "CharTokenizer", "HFTokenizer", "Tokenizer", "TokenizerError", "build_tokenizer",
           "check_prompts_fit", "prepare_inputs"]
