# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Availability checks of the HPC kernels.

* ``has_hpc()``: the separately installed ``hpc`` package, which the layers
  that import it (``hpc_ihc``, ``gated_mla``) need.
* ``has_hpc_kernels()``: the in-tree ``vllm._hpc_C`` library, built with
  vLLM, which the ``HPC_ATTN`` backend, ``HpcRopeNorm`` and the ``hpc`` MoE
  backend run on.
"""

import functools
import importlib
import importlib.util

from vllm.logger import init_logger

logger = init_logger(__name__)

__all__ = ["has_hpc", "has_hpc_kernels"]


@functools.cache
def has_hpc() -> bool:
    """Return `True` if hpc package is available."""
    # Use find_spec to check if the module exists without importing it
    # This avoids potential CUDA initialization side effects
    if importlib.util.find_spec("hpc") is None:
        logger.warning_once(
            "HPC attention requires the hpc module to be installed. "
            "Please install it from https://github.com/Tencent/hpc-ops"
        )
        return False
    return True


@functools.cache
def has_hpc_kernels() -> bool:
    """Return ``True`` when the in-tree ``vllm._hpc_C`` library is loaded."""
    try:
        hpc_ops = importlib.import_module("vllm._hpc_ops")
    except ImportError as exc:
        logger.info_once("HPC kernels unavailable: vllm._hpc_ops failed: %s", exc)
        return False
    if not hpc_ops.hpc_ops_available():
        logger.info_once("HPC kernels unavailable: vllm._hpc_C failed to load.")
        return False
    return True
