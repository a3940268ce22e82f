"""Start, watch and restart `python -m sglang.launch_server` processes (disaggregated placement).

A server that dies (or stops answering /health) is restarted with the same argv, at most
`max_restarts` times over the process's life; a restarted server holds the checkpoint's weights again,
so the adapter marks its weights stale and the next update_weights re-joins the update group.
"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Callable, Optional

from .payloads import engine_environment


class EngineStartError(RuntimeError):
    """An SGLang server did not come up, or died more often than allowed."""


class ServerProcess:
    """One launch_server process: argv, log file, health probe, bounded restarts."""

    def __init__(self, argv: list[str], is_healthy: Callable[[], bool], log_path: Path, *,
                 max_restarts: int = 2, startup_timeout_s: float = 1800.0, poll_s: float = 2.0,
                 env: Optional[dict] = None, popen=subprocess.Popen):
        self.argv = list(argv)
        self.is_healthy = is_healthy
        self.log_path = Path(log_path)
        self.max_restarts = max_restarts
        self.startup_timeout_s = startup_timeout_s
        self.poll_s = poll_s
        self.env = {**os.environ, **engine_environment(), **(env or {})}
        self.popen = popen
        self.proc = None
        self.restarts = 0

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        try:
            self.proc = self.popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                   start_new_session=True)
        finally:
            log.close()
        self.wait_ready()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineStartError(f"SGLang server exited with code {self.proc.returncode} during startup; "
                                       f"see {self.log_path}\n  argv: {' '.join(self.argv)}")
            if self.is_healthy():
                return
            time.sleep(self.poll_s)
        self.stop()
        raise EngineStartError(f"SGLang server not healthy after {self.startup_timeout_s:.0f} s; see {self.log_path}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and self.is_healthy()

    def ensure_alive(self) -> bool:
        """True if a restart happened. Raises EngineStartError once the restart budget is spent."""
        if self.alive():
            return False
        if self.restarts >= self.max_restarts:
            code = None if self.proc is None else self.proc.poll()
            raise EngineStartError(f"SGLang server is down (exit code {code}) and was already restarted "
                                   f"{self.restarts} time(s) (rollout.sglang_max_restarts); see {self.log_path}")
        self.stop()
        self.restarts += 1
        self.start()
        return True

    def stop(self, grace_s: float = 30.0) -> None:
        """Terminate this server's process group (launch_server spawns scheduler/detokenizer children)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
