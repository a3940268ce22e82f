"""The torchrun command line of the multi-process tests (each test compares its ranks with one process)."""
import socket
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_cmd(nproc: int, *target) -> list[str]:
    """`python -m torch.distributed.run` on a free local port; target: a script path and its arguments, or
    "-m", a module and its arguments."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
            str(free_port()), *map(str, target)]
