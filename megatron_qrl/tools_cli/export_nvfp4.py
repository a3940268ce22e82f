"""`qrl export-nvfp4 CKPT OUT [--config C] [overrides...]`: HF NVFP4 checkpoint for SGLang/vLLM (modelopt_fp4)."""
from __future__ import annotations

import argparse

from ._common import allow_overrides_after_options, run_command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="checkpoint directory (Trainer.save or qrl convert hf-to-mcore)")
    parser.add_argument("out", help="output HF directory (must not exist)")
    parser.add_argument("--config", help="run config YAML; quant.targets picks the FP4 linears "
                                         "(default: the checkpoint's quant settings)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. quant.targets=all_linears")
    parser.add_argument("--hf-config", help="the source HF directory (config + tokenizer files to carry over)")
    parser.add_argument("--dtype", default="bfloat16", help="dtype of the unquantized tensors (default bfloat16)")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (default 5GB)")
    scales = parser.add_argument_group("input_scale (static activation scale of each FP4 linear)")
    scales.add_argument("--calib-tokens", help="JSON/JSONL token id sequences to calibrate activation amax on "
                                               "(recommended: a few hundred tokens of real prompts)")
    scales.add_argument("--calib-samples", type=int, default=8,
                        help="without --calib-tokens: number of random token sequences (default 8)")
    scales.add_argument("--calib-seq-len", type=int, default=128, help="length of the random sequences (default 128)")
    scales.add_argument("--input-amax", type=float,
                        help="skip calibration: input_scale = VALUE/(6*448) for every linear")
    allow_overrides_after_options(parser)


def run(args: argparse.Namespace) -> int:
    from megatron_qrl import convert

    return run_command("export-nvfp4", lambda: convert.export_nvfp4(
        args.checkpoint, args.out, args.config, args.overrides, hf_config=args.hf_config, dtype=args.dtype,
        max_shard_size=args.max_shard_size, calib_tokens=args.calib_tokens, calib_samples=args.calib_samples,
        calib_seq_len=args.calib_seq_len, input_amax=args.input_amax))
