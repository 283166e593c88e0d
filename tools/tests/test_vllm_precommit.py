# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM 0.33.0's own pre-commit checks on the files the PR adds or changes.

The patch set is applied to vLLM's sources (``VLLM_SDIST``) and each check
runs there, under vLLM's configuration, on the files that differ from
0.33.0: its scripts for forbidden imports, ``torch.cuda`` calls and SPDX
headers, ruff, clang-format on the kernel sources, typos on every changed
file, and mypy on the package files the PR adds through
``tools/pre_commit/mypy.py`` (the upstream files it edits in place carry
upstream's own findings). Skips without the sources, and names the tool
that is missing when one is.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from patchset_tool import TOOL_PATH, git

CXX_SUFFIXES = (".cu", ".cuh", ".h", ".hpp", ".cpp")
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def patched(vllm_checkout: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    """vLLM's sources with the patch set applied, and the files it added
    (status ``??``) or changed (`` M``); restored afterwards."""
    root = vllm_checkout
    subprocess.run(
        [sys.executable, str(TOOL_PATH), "--vllm-src", str(root)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    status = git(root, "status", "--porcelain", "--untracked-files=all")
    changed = {line[3:]: line[:2] for line in status.splitlines() if line[3:]}
    try:
        yield root, changed
    finally:
        git(root, "reset", "-q", "--hard")
        git(root, "clean", "-fdxq")


def _tool(name: str) -> str:
    path = BIN / name
    if path.is_file():
        return str(path)
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed")
    return found


def _run(root: Path, *cmd: str) -> None:
    result = subprocess.run(
        list(cmd), cwd=root, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]


def _python(changed: dict[str, str]) -> list[str]:
    return sorted(f for f in changed if f.endswith(".py"))


@pytest.mark.parametrize(
    "script", ["check_forbidden_imports", "check_torch_cuda", "check_spdx_header"]
)
def test_vllm_checks(patched: tuple[Path, dict[str, str]], script: str) -> None:
    root, changed = patched
    _run(root, sys.executable, f"tools/pre_commit/{script}.py", *_python(changed))


def test_ruff(patched: tuple[Path, dict[str, str]]) -> None:
    root, changed = patched
    ruff = _tool("ruff")
    _run(root, ruff, "check", *_python(changed))
    _run(root, ruff, "format", "--check", *_python(changed))


def test_clang_format(patched: tuple[Path, dict[str, str]]) -> None:
    root, changed = patched
    sources = sorted(
        f for f in changed if f.startswith("csrc/") and f.endswith(CXX_SUFFIXES)
    )
    assert sources
    _run(root, _tool("clang-format"), "--dry-run", "-Werror", "--style=file", *sources)


def test_typos(patched: tuple[Path, dict[str, str]]) -> None:
    """Every file the PR adds or changes, as vLLM's typos hook checks them
    (with ``--force-exclude``, under the [tool.typos] of its pyproject.toml)."""
    root, changed = patched
    _run(root, _tool("typos"), "--force-exclude", *sorted(changed))


def test_mypy(patched: tuple[Path, dict[str, str]]) -> None:
    """The package files the PR adds and every test file it adds or edits,
    as vLLM's hook checks them: it groups files by directory and follows
    imports silently, and its SILENT_GROUPS hold the PR's test directories
    (tests/kernels, tests/v1/attention, tests/model_executor,
    tests/benchmarks), so they are checked like the package."""
    root, changed = patched
    _tool("mypy")
    package = [
        f
        for f in _python(changed)
        if (f.startswith("vllm/") and changed[f] == "??") or f.startswith("tests/")
    ]
    assert any(f.startswith("vllm/") for f in package)
    assert any(f.startswith("tests/") for f in package)
    env_path = f"{BIN}:{Path(shutil.which('git') or '/usr/bin/git').parent}"
    result = subprocess.run(
        [sys.executable, "tools/pre_commit/mypy.py", "local", *package],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=1200,
        env={"PATH": env_path, "HOME": str(root)},
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
