"""Why `import kernels` from a checkout gets Hugging Face's `kernels`, not this directory.

This directory installs as `megatron_qrl.kernels` (setup.py); the bare name `kernels` only resolves to it when
the repository root is on sys.path, which it is for every process started from a checkout (`python -m ...`
puts the current directory first). That name belongs to the `kernels` distribution, which transformers >= 5
imports when installed (`from kernels import CUDAProperties, ...`) and now installs as a dependency: with this
directory in its place, `import transformers` failed in any job started from the repository root.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def yield_to_installed() -> None:
    """Rebind sys.modules["kernels"] to the installed distribution when there is one (called at the end of
    this package's __init__ when it was imported as `kernels`); otherwise leave it as it is."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", elsewhere)
    if spec is None or spec.loader is None:
        return
    for name in [n for n in sys.modules if n == "kernels" or n.startswith("kernels.")]:
        del sys.modules[name]
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    spec.loader.exec_module(module)
