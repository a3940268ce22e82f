"""`qrl`: the command line. Each subcommand imports its module lazily so `qrl --help` stays fast."""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module with `add_arguments(parser)` and `run(args)`, one-line help)
SUBCOMMANDS = {
    "train": ("megatron_qrl.launch.train", "run the RL job (single process, or under torchrun/srun/mpirun)"),
    "eval": ("megatron_qrl.launch.evaluate", "held-out accuracy of a checkpoint on a task"),
    "convert": ("megatron_qrl.tools_cli.convert", "convert checkpoints: hf-to-mcore | mcore-to-hf"),
    "export-nvfp4": ("megatron_qrl.tools_cli.export_nvfp4", "export an HF NVFP4 checkpoint for SGLang/vLLM"),
    "bench": ("megatron_qrl.tools_cli.bench", "run a benchmark under tools/ (codec, kernels, rollout, trainer)"),
    "plot": ("megatron_qrl.plotting", "PNG plots of a run directory's metrics.jsonl"),
}


def _available() -> dict:
    found = {}
    for name, (module, help_text) in SUBCOMMANDS.items():
        if importlib.util.find_spec(module.rsplit(".", 1)[0]) is None:
            continue
        try:
            if importlib.util.find_spec(module) is not None:
                found[name] = (module, help_text)
        except ModuleNotFoundError:
            continue
    return found


EPILOG = ("Configuration: every field, its default and meaning is in docs/configuration.md; override any field "
          "on the command line as section.field=value (e.g. run.total_steps=10). Print the resolved config "
          "without running: qrl train --config C [overrides] --dry-run. Errors print one line and exit 2 for bad "
          "input; --debug (or QRL_DEBUG=1) shows the traceback.")


def version() -> str:
    try:
        from importlib.metadata import version as dist_version

        return dist_version("megatron-qrl")
    except Exception:  # noqa: BLE001 - a plain checkout on PYTHONPATH (not pip-installed)
        return "unknown (not installed: pip install -e .)"


def main(argv: list[str] | None = None) -> int:
    from megatron_qrl.errors import present

    argv = list(sys.argv[1:] if argv is None else argv)
    available = _available()
    parser = argparse.ArgumentParser(prog="qrl", description="megatron-qrl: FP4 RL post-training for MoE LLMs",
                                     epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"qrl (megatron-qrl) {version()}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks (also QRL_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    module = None
    for name, (module_name, help_text) in available.items():
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=EPILOG)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show tracebacks (also QRL_DEBUG=1)")
        if name == chosen:  # only the chosen subcommand's module is imported
            module = importlib.import_module(module_name)
            module.add_arguments(p)
    args = parser.parse_args(argv)
    return present(args.command, lambda: module.run(args), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
