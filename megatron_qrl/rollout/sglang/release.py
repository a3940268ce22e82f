"""The SGLang release this adapter is written against, and how to fetch its wheel for contract checks.

SGLang cannot run on this project's machines (no CPU kernels on PyPI; the GPU image lacks it), so the
adapter is checked against the pinned release's *source*: tests download the wheel with
`pip download --no-deps` (nothing is installed, nothing imported) and read its files with `ast`.

0.5.15.post1 is pinned because it is the first 0.5.x release whose `modelopt_fp4` runs on Hopper
(weight-only Marlin; `ModelOptFp4Config.get_min_capability() == 80`, `--fp4-gemm-backend marlin`,
MoE Marlin fallback on SM80-SM90) and it has routed-expert capture (`--enable-return-routed-experts`,
request field `return_routed_experts`). Its wheel is CPython-3.11 manylinux, so the download names
the platform explicitly and works from any host.
"""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

SGLANG_VERSION = "0.5.15.post1"
WHEEL_PLATFORM = "manylinux_2_34_x86_64"
WHEEL_PYTHON = "3.11"
WHEEL_ABI = "cp311"
WHEEL_NAME = f"sglang-{SGLANG_VERSION}-{WHEEL_ABI}-{WHEEL_ABI}-{WHEEL_PLATFORM}.whl"
CACHE_ENV = "QRL_SGLANG_CACHE"


def default_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "megatron-qrl" / "sglang"))


def download_command(dest: Path) -> list[str]:
    """The pip command that fetches the pinned wheel only (no dependencies, no install)."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--platform", WHEEL_PLATFORM, "--python-version", WHEEL_PYTHON, "--implementation", "cp",
            "--abi", WHEEL_ABI, f"sglang=={SGLANG_VERSION}", "-d", str(dest)]


def fetch_pinned_wheel(cache_dir: Path | None = None, timeout_s: float = 300.0) -> Path:
    """Path of the pinned wheel, downloading it into `cache_dir` once. Raises RuntimeError on failure."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    wheel = cache / WHEEL_NAME
    if wheel.is_file() and zipfile.is_zipfile(wheel):
        return wheel
    cache.mkdir(parents=True, exist_ok=True)
    cmd = download_command(cache)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"downloading sglang=={SGLANG_VERSION} timed out after {timeout_s:.0f} s: "
                           f"{' '.join(cmd)}") from e
    if r.returncode != 0 or not wheel.is_file():
        raise RuntimeError(f"could not download the pinned SGLang wheel ({WHEEL_NAME}) with\n  {' '.join(cmd)}\n"
                           f"pip exit code {r.returncode}; last output:\n{(r.stdout + r.stderr)[-2000:]}\n"
                           f"The SGLang contract tests need PyPI access (or the wheel placed in {cache}, "
                           f"or ${CACHE_ENV} pointing at a folder that holds it).")
    return wheel


class ReleaseSource:
    """Read-only access to the pinned release's Python files inside the wheel (never imported)."""

    def __init__(self, wheel: Path):
        self.wheel = Path(wheel)
        self._zip = zipfile.ZipFile(self.wheel)
        self._names = set(self._zip.namelist())

    def read(self, path: str) -> str:
        """Text of `path` relative to the package root, e.g. 'srt/managers/io_struct.py'."""
        member = f"sglang/{path}"
        if member not in self._names:
            raise FileNotFoundError(f"{member} is not in {self.wheel.name}")
        return self._zip.read(member).decode("utf-8")

    def version(self) -> str:
        """The `Version:` of the wheel's dist-info METADATA."""
        meta = next(n for n in self._names if n.endswith(".dist-info/METADATA"))
        for line in self._zip.read(meta).decode("utf-8").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
        raise ValueError(f"{meta} has no Version line")
