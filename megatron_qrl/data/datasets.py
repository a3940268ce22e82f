"""From a DataConfig to (train split, eval split) and the reward the verifier should use."""
from __future__ import annotations

import random
from typing import Any, Sequence

from megatron_qrl.data.loaders import DataError, load_gsm8k, load_jsonl, load_math, load_parquet
from megatron_qrl.data.sample import Sample
from megatron_qrl.data.synthetic import SyntheticTask
from megatron_qrl.rl.importance import cfg_get


def split_heldout(samples: Sequence[Sample], eval_size: int, seed: int = 0) -> tuple[list[Sample], list[Sample]]:
    """A seeded random `eval_size` rows become the eval split (kept in file order), the rest train."""
    if len(samples) <= eval_size:
        raise DataError(f"the dataset has {len(samples)} rows; data.eval_size={eval_size} would leave none for "
                        "training: lower data.eval_size")
    picked = set(random.Random(f"heldout|{seed}").sample(range(len(samples)), eval_size))
    train = [s for i, s in enumerate(samples) if i not in picked]
    return train, [samples[i] for i in sorted(picked)]


def build_datasets(cfg: Any) -> tuple[Sequence[Sample], list[Sample]]:
    """(train, eval) for data.task: arithmetic/countdown generate themselves; jsonl/parquet/gsm8k/math read
    data.path.
    cfg: a DataConfig, or any object/dict with the same field names."""
    get = lambda name, default=None: cfg_get(cfg, name, default)  # noqa: E731
    task, seed, eval_size = get("task", "arithmetic"), int(get("seed", 0)), int(get("eval_size", 64))
    if task in ("arithmetic", "countdown"):
        params = ({"max_operand": int(get("max_operand", 20))} if task == "arithmetic" else
                  {"count": int(get("countdown_numbers", 3)), "max_number": int(get("countdown_max_number", 10))})
        train = SyntheticTask(task, "train", int(get("synthetic_size", 100_000)), seed, **params)
        return train, SyntheticTask(task, "eval", eval_size, seed, **params).distinct(eval_size)
    path = get("path")
    if not path:
        raise DataError(f"data.task={task} reads a local file: set data.path=/path/to/file")
    if task == "gsm8k":
        keys = {k: get(f, d) for k, f, d in (("prompt_key", "prompt_key", "question"),
                                             ("answer_key", "answer_key", "answer"))}
        if keys["prompt_key"] == "prompt":  # the generic default: GSM8K calls it "question"
            keys["prompt_key"] = "question"
        samples = load_gsm8k(path, **keys)
    elif task == "math":
        prompt_key = get("prompt_key", "problem")
        samples = load_math(path, "problem" if prompt_key == "prompt" else prompt_key, get("answer_key", "answer"))
    elif task in ("jsonl", "parquet"):
        loader = load_jsonl if task == "jsonl" else load_parquet
        samples = loader(path, get("prompt_key", "prompt"), get("answer_key", "answer"), get("response_key"),
                         task=task)
    else:
        raise DataError(f"unknown data.task '{task}'; choose arithmetic, countdown, jsonl, parquet, gsm8k or math")
    return split_heldout(samples, eval_size, seed)


# tasks whose verifier is not named like the task: MATH answers are LaTeX, checked by math-verify
TASK_VERIFIERS = {"math": "math_verify"}


def task_reward(cfg: Any) -> str:
    """The reward spec for compute_rewards: data.reward ('module:function' or a verifier name) if set, else the
    task's verifier."""
    task = cfg_get(cfg, "task", "arithmetic")
    return cfg_get(cfg, "reward", None) or TASK_VERIFIERS.get(task, task)
