# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Set-up of the HPC_ATTN backend tests in this directory.

* Tests marked ``@pytest.mark.gpu`` are skipped, with the reason, unless an
  sm90 CUDA GPU is present and the ``_hpc_C`` library is loaded (as in
  tests/kernels/hpc/).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.kernels.hpc.utils import register_gpu_marker, skip_gpu_tests_below


def pytest_configure(config: pytest.Config) -> None:
    register_gpu_marker(config)


def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    skip_gpu_tests_below(Path(__file__).parent, items)
