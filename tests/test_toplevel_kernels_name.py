"""The repository's top-level kernels/ directory must not hide Hugging Face's `kernels` distribution.

A process started from a checkout has the repository root first on sys.path, where kernels/ (installed as
megatron_qrl.kernels) would answer `import kernels`; transformers >= 5 imports that name from the installed
distribution, so such jobs failed at `import transformers` (kernels/_toplevel_name.py)."""
import importlib.machinery
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS = os.path.join(ROOT, "kernels", "__init__.py")


def _run_from_checkout(code: str) -> list:
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


def test_import_kernels_from_the_checkout_gets_the_installed_distribution():
    elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != ROOT]
    installed = importlib.machinery.PathFinder.find_spec("kernels", elsewhere)
    top, ours = _run_from_checkout("import kernels, megatron_qrl.kernels as K; print(kernels.__file__, K.__file__)")
    assert ours == OURS                                  # our package keeps its own name
    assert top == (installed.origin if installed is not None else OURS)


def test_transformers_imports_from_the_checkout():
    """What broke: transformers' hub-kernel integration importing `kernels` from the repository root."""
    (name,) = _run_from_checkout("import transformers.integrations.hub_kernels as h; print(h.__name__)")
    assert name == "transformers.integrations.hub_kernels"
