"""The pinned SGLang release's source for the contract tests: the wheel (downloaded, never installed or imported)
as a module-scoped `release` fixture, and the ast readers both contract test files use."""
from __future__ import annotations

import ast

import pytest

from megatron_qrl.rollout.sglang.release import ReleaseSource, fetch_pinned_wheel


@pytest.fixture(scope="module")
def release() -> ReleaseSource:
    """A failed download FAILS the test (no skip): the contract tests are the only evidence the adapter matches
    SGLang."""
    try:
        return ReleaseSource(fetch_pinned_wheel())
    except RuntimeError as e:
        pytest.fail(f"SGLang contract tests cannot run without the pinned wheel:\n{e}")


def tree(release: ReleaseSource, path: str) -> ast.Module:
    """The parsed source of `path` inside the release (e.g. srt/server_args.py)."""
    return ast.parse(release.read(path))


def class_node(t: ast.AST, name: str) -> ast.ClassDef:
    """The first class called `name` anywhere in `t`."""
    found = [n for n in ast.walk(t) if isinstance(n, ast.ClassDef) and n.name == name]
    assert found, f"class {name} not found"
    return found[0]
