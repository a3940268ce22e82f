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
