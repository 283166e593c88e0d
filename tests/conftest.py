# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Shared test setup.

* Makes ``vllm._hpc_ops`` and the attention workspaces
  (``vllm.v1.attention.ops.hpc_attn_workspace``) importable. The sparse
  tree's ``vllm`` has no ``__init__.py``, so the repository root is appended
  to ``sys.path`` (never prepended): an installed vLLM keeps winning the
  ``vllm`` name, and with no vLLM installed the tree's directory is a
  namespace package. When an installed vLLM lacks them (the patch set is not
  applied to it), the tree's files, which import torch only, are loaded under
  those names. In a vLLM checkout this file is tests/kernels/hpc/conftest.py and the
  checkout's own module is used.
* Tests marked ``@pytest.mark.gpu`` are skipped, with the reason, unless an
  sm90 CUDA GPU is present and the ``_hpc_C`` library is loaded.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
# The root of the tree that holds the ``vllm`` directory: this repository, or
# a vLLM checkout, where this file sits in tests/kernels/hpc/.
REPO_ROOT = next((p for p in _HERE.parents if (p / "vllm").is_dir()), _HERE.parent)
GPU_MARKER = "gpu: needs an sm90 GPU and the built _hpc_C"


# The kernel tests' helpers (as pytest's default import mode would expose
# them to the test modules in that directory) hold the one loader of the op
# module. Here they are in tests/kernels/; in a vLLM checkout, beside this file.
_KERNEL_DIR = _HERE / "kernels"
if not (_KERNEL_DIR / "rope_norm_reference.py").is_file():
    _KERNEL_DIR = _HERE
_KERNEL_TESTS = str(_KERNEL_DIR)
if _KERNEL_TESTS not in sys.path:
    sys.path.insert(0, _KERNEL_TESTS)
from rope_norm_reference import import_attn_workspace  # noqa: E402

import_attn_workspace(REPO_ROOT)


@functools.cache
def gpu_skip_reason() -> str | None:
    """Why ``gpu`` tests cannot run here, or None when they can."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU is available"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        name = torch.cuda.get_device_name()
        return f"needs an sm90 (Hopper) GPU; found {name} (sm{major}{minor})"
    from vllm._hpc_ops import hpc_ops_available

    if not hpc_ops_available():
        return "the _hpc_C library is not built or could not be loaded"
    return None


def pytest_configure(config: pytest.Config) -> None:
    declared = config.getini("markers")
    if not any(str(line).startswith("gpu:") for line in declared):
        config.addinivalue_line("markers", GPU_MARKER)


def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    reason = gpu_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"gpu test: {reason}")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture
def hpc_gpu() -> None:
    """For tests that need the GPU without the marker: skip with the reason."""
    reason = gpu_skip_reason()
    if reason is not None:
        pytest.skip(f"gpu test: {reason}")
