# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Set-up of the HPC_ATTN backend tests in this directory.

* Tests marked ``@pytest.mark.gpu`` are skipped, with the reason, unless an
  sm90 CUDA GPU is present and the ``_hpc_C`` library is loaded (as in
  tests/kernels/hpc/).
* ``hopper_platform_cls``: a vLLM CUDA platform whose device is an sm90 GPU,
  for the CPU tests that run vLLM's selector and configuration code as on a
  Hopper machine.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.kernels.hpc.utils import register_gpu_marker, skip_gpu_tests_below
from vllm.platforms.interface import DeviceCapability

if TYPE_CHECKING:
    from vllm.platforms.cuda import NonNvmlCudaPlatform

# The extension module vllm.platforms.cuda imports at the top.
CUDA_EXTENSION = "vllm._C_stable_libtorch"


def pytest_configure(config: pytest.Config) -> None:
    register_gpu_marker(config)


def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    skip_gpu_tests_below(Path(__file__).parent, items)


def _cuda_platform() -> type[NonNvmlCudaPlatform]:
    """The ``NonNvmlCudaPlatform`` of vLLM, also where no CUDA driver is installed.

    ``vllm.platforms.cuda`` imports vLLM's CUDA extension, which cannot load
    without the driver. The tests that pose as a Hopper GPU never call its
    ops, so where it cannot load, an empty stand-in is in ``sys.modules``
    while ``vllm.platforms.cuda`` is imported and is gone right after: later
    imports of the extension get the real module (or its import error).
    """
    with pytest.MonkeyPatch.context() as mp:
        try:
            importlib.import_module(CUDA_EXTENSION)
        except ImportError:
            mp.setitem(sys.modules, CUDA_EXTENSION, types.ModuleType(CUDA_EXTENSION))
        from vllm.platforms.cuda import NonNvmlCudaPlatform
    return NonNvmlCudaPlatform


@pytest.fixture(scope="module")
def hopper_platform_cls() -> type[NonNvmlCudaPlatform]:
    """A subclass of vLLM's CUDA platform whose device reports compute
    capability ``capability`` (9.0 unless a test sets it); one per module,
    so what a module sets stays there."""

    class HopperPlatform(_cuda_platform()):  # type: ignore[misc]
        capability = DeviceCapability(9, 0)

        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return cls.capability

    return HopperPlatform
