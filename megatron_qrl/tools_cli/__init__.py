"""Argument parsing for the `qrl` subcommands that live outside the library proper (convert, export-nvfp4).

Each module defines `add_arguments(parser)` and `run(args) -> int`; `megatron_qrl.cli` imports only the
chosen one.
"""
