# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Shared test setup.

* Makes ``vllm._hpc_ops`` importable. The sparse tree's ``vllm`` has no
  ``__init__.py``, so the repository root is appended to ``sys.path`` (never
  prepended): an installed vLLM keeps winning the ``vllm`` name, and with no
  vLLM installed the tree's directory is a namespace package. When an
  installed vLLM lacks ``_hpc_ops`` (the patch set is not applied to it), the
  tree's ``vllm/_hpc_ops.py``, which imports torch only, is loaded under that
  name.
* Tests marked ``@pytest.mark.gpu`` are skipped, with the reason, unless an
  sm90 CUDA GPU is present and the ``_hpc_C`` library is loaded.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
GPU_MARKER = "gpu: needs an sm90 GPU and the built _hpc_C"


def _vllm_search_locations() -> list[str]:
    if "vllm" in sys.modules:
        return list(getattr(sys.modules["vllm"], "__path__", []))
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        return []
    return list(spec.submodule_search_locations or [])


def _load_tree_hpc_ops() -> ModuleType:
    path = REPO_ROOT / "vllm" / "_hpc_ops.py"
    spec = importlib.util.spec_from_file_location("vllm._hpc_ops", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load vllm._hpc_ops from {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["vllm._hpc_ops"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["vllm._hpc_ops"]
        raise
    return module


def ensure_hpc_ops_importable() -> None:
    """Make ``import vllm._hpc_ops`` work, without shadowing a real vLLM."""
    if "vllm._hpc_ops" in sys.modules:
        return
    root = str(REPO_ROOT)
    if root not in sys.path:
        sys.path.append(root)
    locations = _vllm_search_locations()
    if not any(Path(p, "_hpc_ops.py").is_file() for p in locations):
        _load_tree_hpc_ops()


ensure_hpc_ops_importable()


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
