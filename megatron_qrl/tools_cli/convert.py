"""`qrl convert hf-to-mcore SRC DST [--config C] [overrides...]` and `qrl convert mcore-to-hf SRC DST`."""
from __future__ import annotations

import argparse

from ._common import allow_overrides_after_options, run_command


def _direction(sub, name: str, summary: str, description: str, src: str, dst: str) -> argparse.ArgumentParser:
    """One conversion direction: SRC is read, DST is written and must not exist yet (docs/convert.md)."""
    parser = sub.add_parser(name, help=summary, description=description)
    parser.add_argument("src", help=src)
    parser.add_argument("dst", help=f"{dst} (must not exist)")
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="direction", required=True, metavar="{hf-to-mcore,mcore-to-hf}")
    a = _direction(sub, "hf-to-mcore", "Qwen3-MoE / Qwen3 HF safetensors directory -> Megatron dist checkpoint",
                   "Convert a Qwen3-MoE or dense Qwen3 Hugging Face checkpoint (config.json + *.safetensors) into a "
                   "model-only Megatron dist checkpoint that Trainer.load(path, load_optimizer=False) reads under "
                   "any TP/PP/EP layout.", "HF checkpoint directory", "output checkpoint directory")
    a.add_argument("--config", help="run config YAML for the non-architecture sections (quant, trainer, ...)")
    a.add_argument("overrides", nargs="*", help="dotted overrides, e.g. quant.targets=all_linears")
    allow_overrides_after_options(a)
    b = _direction(sub, "mcore-to-hf", "Megatron checkpoint (any layout) -> Qwen3-MoE / Qwen3 HF directory",
                   "Convert a checkpoint written by Trainer.save or `qrl convert hf-to-mcore` into a Hugging Face "
                   "Qwen3MoeForCausalLM (or, for num_experts=0, Qwen3ForCausalLM) directory.",
                   "checkpoint directory (with manifest.json)", "output HF directory")
    b.add_argument("--hf-config", help="the source HF directory (or its config.json): config and tokenizer files to "
                                       "write alongside; default: the config stored at conversion time")
    b.add_argument("--dtype", help="weight dtype: bfloat16 | float16 | float32 (default: the source config's)")
    b.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (default 5GB)")


def run(args: argparse.Namespace) -> int:
    from megatron_qrl import convert

    if args.direction == "hf-to-mcore":
        return run_command("convert hf-to-mcore",
                           lambda: convert.hf_to_mcore(args.src, args.dst, args.config, args.overrides))
    return run_command("convert mcore-to-hf", lambda: convert.mcore_to_hf(
        args.src, args.dst, hf_config=args.hf_config, dtype=args.dtype, max_shard_size=args.max_shard_size))
