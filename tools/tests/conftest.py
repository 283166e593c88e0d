# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM 0.33.0's sources (``VLLM_SDIST``: the source distribution or its
unpacked directory) as a git repository, for the tests of the whole PR,
which skip without them."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from patchset_tool import SDIST_HINT, git, load_tool


@pytest.fixture(scope="session")
def vllm_checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """vLLM 0.33.0's sources, unpacked once and committed to a git repository.

    Each test leaves it as it found it (see ``pristine``).
    """
    tool = load_tool()
    given = os.environ.get("VLLM_SDIST")
    if not given:
        pytest.skip(f"needs vLLM's sources: {SDIST_HINT}")
    if shutil.which("git") is None:
        pytest.skip("needs git")
    source = Path(given)
    work = tmp_path_factory.mktemp("sdist")
    if source.is_dir():
        root = work / "vllm"
        shutil.copytree(source, root, symlinks=True)
    elif source.is_file():
        # The "data" filter drops the archive's owners, so the tree is the
        # extracting user's (git refuses a repository another user owns).
        shutil.unpack_archive(source, work, filter="data")
        (root,) = [p for p in work.iterdir() if p.is_dir()]
    else:
        pytest.skip(f"VLLM_SDIST={given} does not exist; {SDIST_HINT}")
    if not (root / "cmake" / "utils.cmake").is_file():
        pytest.skip(f"{source} has no cmake/utils.cmake; {SDIST_HINT}")
    if tool.read_version(root / "vllm") != tool.BASE_VERSION:
        pytest.skip(f"{source} is not vLLM {tool.BASE_VERSION}")
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "0.33")
    return root


@pytest.fixture
def pristine(vllm_checkout: Path):
    yield vllm_checkout
    git(vllm_checkout, "reset", "-q", "--hard")
    git(vllm_checkout, "clean", "-fdxq")
