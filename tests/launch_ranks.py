"""The torchrun command line of the multi-process tests (each test compares its ranks with one process)."""
import os
import socket
import subprocess
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


def run_ranks(nproc: int, *target, timeout: int = 300) -> str:
    """Run `target` (as for torchrun_cmd) on nproc local ranks, one OpenMP thread each and warnings off;
    fail the calling test with the output's tail unless the launch exits 0. Returns stdout + stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "PYTHONWARNINGS": "ignore"}
    cmd = torchrun_cmd(nproc, *target)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{out[-8000:]}"
    return out
