# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the tool's tests share: the tool module, git, and where vLLM
0.33.0's sources come from (``VLLM_SDIST``)."""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parents[2]
TOOL_PATH = REPO_ROOT / "tools" / "apply_patchset.py"
SDIST_HINT = (
    "set VLLM_SDIST to vLLM 0.33.0's source distribution (vllm-0.33.0.tar.gz "
    "from PyPI) or to its unpacked directory"
)


@functools.cache
def load_tool(name: str = "apply_patchset") -> ModuleType:
    """``tools/<name>.py`` as the module ``name``."""
    path = REPO_ROOT / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def git(root: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(root), *args],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "GIT_CONFIG_GLOBAL": os.devnull},
    ).stdout
