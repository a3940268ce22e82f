"""Prompt sources for the RL loop: char tokenizer, synthetic tasks, file loaders, resumable batches."""
from megatron_qrl.data.batches import PromptBatches
from megatron_qrl.data.datasets import build_datasets, split_heldout, task_reward
from megatron_qrl.data.loaders import DataError, load_gsm8k, load_jsonl, load_parquet
from megatron_qrl.data.sample import Sample
from megatron_qrl.data.synthetic import SyntheticTask, arithmetic_problem, countdown_problem
from megatron_qrl.data.tokenizer import CharTokenizer

__all__ = ["PromptBatches", "build_datasets", "split_heldout", "task_reward", "DataError", "load_gsm8k",
           "load_jsonl", "load_parquet", "Sample", "SyntheticTask", "arithmetic_problem", "countdown_problem",
           "CharTokenizer"]
