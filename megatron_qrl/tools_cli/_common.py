"""Shared CLI behaviour: user errors become one readable line and exit code 2; process groups are torn down."""
from __future__ import annotations

import sys
from typing import Callable


def run_command(name: str, body: Callable[[], object]) -> int:
    from megatron_qrl.config import ConfigError
    from megatron_qrl.convert.errors import ConvertError
    from megatron_qrl.trainer.checkpoint import CheckpointError

    try:
        result = body()
    except (ConvertError, ConfigError, CheckpointError) as e:
        print(f"qrl {name}: error: {e}", file=sys.stderr)
        return 2
    finally:
        from megatron_qrl.platform import teardown

        teardown()
    print(f"qrl {name}: wrote {result}")
    return 0


def allow_overrides_after_options(parser) -> None:
    """Accept `SRC DST --config C a.b=1`: plain argparse stops filling a positional list once an option has
    appeared, so trailing overrides would be rejected. Parse this (leaf) parser intermixed instead; the
    parent parser calls `parse_known_args`, which is therefore replaced on this instance."""
    plain = parser.parse_known_args
    state = {"inner": False}

    def parse_known_args(args=None, namespace=None):
        if state["inner"]:  # parse_known_intermixed_args calls back into parse_known_args
            return plain(args, namespace)
        state["inner"] = True
        try:
            return parser.parse_known_intermixed_args(args, namespace)
        finally:
            state["inner"] = False

    parser.parse_known_args = parse_known_args
