# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Set-up of the HPC kernel tests.

* Makes ``vllm._hpc_ops`` and the attention workspaces
  (``vllm.v1.attention.ops.hpc_attn_workspace``) importable before the test
  modules import them: from the installed vLLM when it has them, else from
  this tree's files, which import torch only (``utils.import_attn_workspace``).
  So the kernel tests also run against a vLLM the patch set was not applied
  to, or with no vLLM at all. In a vLLM checkout the checkout's own modules
  are used.
* Tests marked ``@pytest.mark.gpu`` are skipped, with the reason, unless an
  sm90 CUDA GPU is present and the ``_hpc_C`` library is loaded.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.kernels.hpc.utils import (
    gpu_skip_reason,
    import_attn_workspace,
    register_gpu_marker,
    skip_gpu_tests_below,
)

import_attn_workspace()


def pytest_configure(config: pytest.Config) -> None:
    register_gpu_marker(config)


def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    skip_gpu_tests_below(Path(__file__).parent, items)


@pytest.fixture
def hpc_gpu() -> None:
    """For tests that need the GPU without the marker: skip with the reason."""
    reason = gpu_skip_reason()
    if reason is not None:
        pytest.skip(f"gpu test: {reason}")
