# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Entry points of the HPC kernels for the rest of vLLM.

Callers import only the wrappers defined here.

* ``has_hpc()`` reports whether the in-tree ``vllm._hpc_C`` library (loaded
  through ``vllm._hpc_ops``) is usable. The fused RoPE/QK-Norm/KV-write layer
  (``HpcRopeNorm``) runs on it.
* ``hpc_fuse_moe`` and ``hpc_fuse_moe_blockwise`` have no in-tree kernel yet.
  Until they do, they forward to the separately installed ``hpc`` package
  with unchanged signatures, and raise ``ImportError`` naming the missing
  piece when that package (or the entry point) is absent.
  ``has_hpc_package()`` reports whether that package can be found.
"""

import functools
import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from vllm.logger import init_logger

logger = init_logger(__name__)

__all__ = [
    "has_hpc",
    "has_hpc_package",
    "hpc_fuse_moe",
    "hpc_fuse_moe_blockwise",
]


@functools.cache
def has_hpc() -> bool:
    """Return ``True`` when the in-tree ``vllm._hpc_C`` kernels are loaded."""
    try:
        _hpc_ops = importlib.import_module("vllm._hpc_ops")
    except ImportError as exc:
        logger.info_once("HPC kernels unavailable: vllm._hpc_ops failed: %s", exc)
        return False
    if not _hpc_ops.hpc_ops_available():
        logger.info_once(
            "HPC kernels unavailable: vllm._hpc_C is not built or failed to load."
        )
        return False
    return True


@functools.cache
def has_hpc_package() -> bool:
    """Return ``True`` when the separately installed ``hpc`` package exists.

    Only the MoE wrappers below still depend on it. ``find_spec`` is used so
    that the check does not import the package (and touch CUDA).
    """
    return importlib.util.find_spec("hpc") is not None


def _hpc_package_entry(name: str, caller: str) -> Callable[..., Any]:
    """Return ``hpc.<name>`` or raise an ``ImportError`` saying what is missing."""
    if not has_hpc_package():
        raise ImportError(
            f"{caller} needs `hpc.{name}` from the separately installed `hpc` "
            "package (hpc-ops), which is not installed. The in-tree vllm._hpc_C "
            "library has no fused MoE kernel yet; install hpc-ops or choose "
            "another MoE backend."
        )
    module = importlib.import_module("hpc")
    entry = getattr(module, name, None)
    if entry is None:
        raise ImportError(
            f"{caller} needs `hpc.{name}`, but the installed `hpc` package "
            f"({getattr(module, '__file__', '?')}) does not provide it; "
            "upgrade hpc-ops or choose another MoE backend."
        )
    return entry


def hpc_fuse_moe(
    x: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down_scale: torch.Tensor,
    act_and_mul_scale: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_scale: torch.Tensor,
    rank_ep: int,
    num_expert_total: int,
    use_bf16_mul: bool = True,
    shared_output: torch.Tensor | None = None,
    output: torch.Tensor | None = None,
) -> torch.Tensor:
    """FP8 per-tensor fused MoE (``hpc.fuse_moe``)."""
    fuse_moe = _hpc_package_entry("fuse_moe", "hpc_fuse_moe")
    return fuse_moe(
        x,
        gate_up_weight,
        down_weight,
        gate_up_scale,
        down_scale,
        act_and_mul_scale,
        topk_ids,
        topk_scale,
        rank_ep,
        num_expert_total,
        use_bf16_mul,
        shared_output,
        output=output,
    )


def hpc_fuse_moe_blockwise(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    gate_up_weight: torch.Tensor,
    gate_up_weight_scale: torch.Tensor,
    down_weight: torch.Tensor,
    down_weight_scale: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_scale: torch.Tensor,
    rank_ep: int,
    num_expert_total: int,
    shared_output: torch.Tensor | None = None,
    output: torch.Tensor | None = None,
) -> torch.Tensor:
    """FP8 block-quantised fused MoE (``hpc.fuse_moe_blockwise``)."""
    fuse_moe_blockwise = _hpc_package_entry(
        "fuse_moe_blockwise", "hpc_fuse_moe_blockwise"
    )
    return fuse_moe_blockwise(
        x,
        x_scale,
        gate_up_weight,
        gate_up_weight_scale,
        down_weight,
        down_weight_scale,
        topk_ids,
        topk_scale,
        rank_ep,
        num_expert_total,
        shared_output,
        output=output,
    )
