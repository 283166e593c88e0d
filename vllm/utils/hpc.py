# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Entry points of the HPC kernels for the rest of vLLM.

Callers import only the wrappers defined here.

* ``has_hpc()`` reports whether the in-tree ``vllm._hpc_C`` library (loaded
  through ``vllm._hpc_ops``) is usable. The fused RoPE/QK-Norm/KV-write layer
  (``HpcRopeNorm``) runs on it.
* ``has_hpc_moe()`` additionally requires the fused FP8 MoE kernel: the
  ``vllm._hpc_ops.fused_moe_fp8`` and ``moe_workspace_bytes`` entry points
  and the library's ``fused_moe_fp8`` op. ``HPCExperts``
  (``--moe-backend hpc``) needs it.
* ``hpc_fuse_moe`` and ``hpc_fuse_moe_blockwise`` keep the signatures of the
  wrappers that used to forward to the separately installed ``hpc`` package
  and now run ``vllm._hpc_ops.fused_moe_fp8``. They translate that package's
  conventions (combined per-expert dequantisation factors, a contiguous range
  of experts per EP rank, output allocated on demand) into the op's. Being
  compatibility shims, they size their kernel workspace from the batch they
  are given and grow it when a larger one arrives; code that needs a fixed
  workspace (CUDA graphs) calls ``fused_moe_fp8`` with its own
  ``MoeWorkspace`` (``vllm.model_executor.layers.fused_moe.hpc_moe``), as
  ``HPCExperts`` does.
"""

import functools
import importlib
from types import ModuleType
from typing import Any

import torch

from vllm.logger import init_logger

logger = init_logger(__name__)

__all__ = [
    "has_hpc",
    "has_hpc_moe",
    "hpc_fuse_moe",
    "hpc_fuse_moe_blockwise",
]

# What the op module must provide for the fused MoE.
_MOE_ENTRY_POINTS = ("fused_moe_fp8", "moe_workspace_bytes")
# Smallest token capacity of a workspace created by the wrappers below.
_MIN_WRAPPER_TOKENS = 256
# Workspaces of the wrappers by (device, topk, local experts, hidden, inter).
_wrapper_workspaces: dict[tuple[torch.device, int, int, int, int], Any] = {}
# A float32 one per device: the activation scale when the weight scale passed
# to the op already holds the activation's.
_unit_scales: dict[torch.device, torch.Tensor] = {}


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
def has_hpc_moe() -> bool:
    """Return ``True`` when the fused FP8 MoE kernel of ``vllm._hpc_C`` is usable.

    That is: ``has_hpc()``, the op module has ``fused_moe_fp8`` and
    ``moe_workspace_bytes``, and the loaded library registers the
    ``fused_moe_fp8`` op (a library built before the MoE kernel existed does
    not).
    """
    if not has_hpc():
        return False
    _hpc_ops = importlib.import_module("vllm._hpc_ops")
    missing = [
        name for name in _MOE_ENTRY_POINTS if getattr(_hpc_ops, name, None) is None
    ]
    if missing:
        logger.info_once(
            "HPC fused MoE unavailable: vllm._hpc_ops has no %s.", ", ".join(missing)
        )
        return False
    if not hasattr(torch.ops._hpc_C, "fused_moe_fp8"):
        logger.info_once(
            "HPC fused MoE unavailable: the loaded vllm._hpc_C has no "
            "fused_moe_fp8 op; rebuild it."
        )
        return False
    return True


def _moe_ops(caller: str) -> ModuleType:
    """``vllm._hpc_ops`` when it has the fused MoE entry points, else raise."""
    try:
        _hpc_ops = importlib.import_module("vllm._hpc_ops")
    except ImportError as exc:
        raise ImportError(f"{caller} needs vllm._hpc_ops, which failed: {exc}") from exc
    for name in _MOE_ENTRY_POINTS:
        if getattr(_hpc_ops, name, None) is None:
            raise ImportError(
                f"{caller} needs vllm._hpc_ops.{name}, which this build of the "
                "HPC op layer does not provide."
            )
    return _hpc_ops


def _wrapper_workspace(
    num_tokens: int,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
) -> Any:
    """A workspace for ``num_tokens`` tokens, reused while it is large enough."""
    if w13.dim() != 3 or w2.dim() != 3 or topk_ids.dim() != 2:
        raise ValueError(
            "gate_up_weight and down_weight must be 3-D and topk_ids 2-D, got "
            f"{tuple(w13.shape)}, {tuple(w2.shape)} and {tuple(topk_ids.shape)}"
        )
    key = (
        w13.device,
        int(topk_ids.shape[1]),
        int(w13.shape[0]),
        int(w13.shape[2]),
        int(w2.shape[2]),
    )
    workspace = _wrapper_workspaces.get(key)
    if workspace is None or workspace.max_tokens < num_tokens:
        capacity = max(_MIN_WRAPPER_TOKENS, 1 << max(num_tokens - 1, 0).bit_length())
        device, topk, experts, hidden, inter = key
        # Imported here: hpc_moe imports this module.
        from vllm.model_executor.layers.fused_moe.hpc_moe import MoeWorkspace

        # Drop the old buffer before allocating the larger one.
        _wrapper_workspaces.pop(key, None)
        workspace = MoeWorkspace.create(
            max_tokens=capacity,
            topk=topk,
            num_local_experts=experts,
            hidden_size=hidden,
            intermediate_size=inter,
            device=device,
        )
        _wrapper_workspaces[key] = workspace
    return workspace


def _expert_offset(rank_ep: int, num_local: int, num_expert_total: int) -> int:
    """First global expert of ``rank_ep`` when each rank holds a contiguous range."""
    if rank_ep < 0 or (rank_ep + 1) * num_local > num_expert_total:
        raise ValueError(
            f"rank_ep={rank_ep} with {num_local} local experts does not fit "
            f"num_expert_total={num_expert_total}: rank r holds experts "
            f"[r * {num_local}, (r + 1) * {num_local})"
        )
    return rank_ep * num_local


def _output_for(
    x: torch.Tensor,
    shared_output: torch.Tensor | None,
    output: torch.Tensor | None,
) -> torch.Tensor:
    if output is not None:
        return output
    dtype = shared_output.dtype if shared_output is not None else torch.bfloat16
    return torch.empty(x.shape, dtype=dtype, device=x.device)


def _unit_scale(device: torch.device) -> torch.Tensor:
    scale = _unit_scales.get(device)
    if scale is None:
        scale = torch.ones(1, dtype=torch.float32, device=device)
        _unit_scales[device] = scale
    return scale


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
    """FP8 per-tensor fused MoE on ``vllm._hpc_ops.fused_moe_fp8``.

    ``x``: FP8 ``[T, H]`` quantised with the static input scale;
    ``gate_up_scale``/``down_scale``: ``[E_local]`` products of the weight and
    activation scales of each GEMM; ``act_and_mul_scale``: the reciprocal of
    the static scale of the intermediate activation. Rank ``rank_ep`` holds
    the global experts ``[rank_ep * E_local, (rank_ep + 1) * E_local)``; other
    ids are skipped. ``use_bf16_mul`` is accepted for compatibility; the
    kernel always weights the expert outputs in float32. Returns ``output``
    (allocated as bfloat16 when not given).
    """
    _hpc_ops = _moe_ops("hpc_fuse_moe")
    num_local = int(gate_up_weight.shape[0])
    offset = _expert_offset(rank_ep, num_local, num_expert_total)
    out = _output_for(x, shared_output, output)
    if x.shape[0] == 0:
        return out
    workspace = _wrapper_workspace(
        int(x.shape[0]), gate_up_weight, down_weight, topk_ids
    )
    # The kernel dequantises x with a1_scale and the gate/up GEMM with
    # w13_scale: a unit a1_scale keeps the combined factor. The intermediate
    # is quantised with a2_scale = 1 / act_and_mul_scale and dequantised with
    # w2_scale * a2_scale, which must equal down_scale.
    act_scale = act_and_mul_scale.reshape(1).to(torch.float32)
    _hpc_ops.fused_moe_fp8(
        x,
        gate_up_weight,
        down_weight,
        topk_scale,
        topk_ids,
        out,
        workspace,
        w13_scale=gate_up_scale,
        w2_scale=down_scale.to(torch.float32) * act_scale,
        a1_scale=_unit_scale(x.device),
        a2_scale=1.0 / act_scale,
        block_shape=None,
        expert_offset=offset,
        shared_output=shared_output,
        global_num_experts=num_expert_total,
    )
    return out


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
    """FP8 128x128-block fused MoE on ``vllm._hpc_ops.fused_moe_fp8``.

    ``x``: FP8 ``[T, H]`` with ``x_scale`` ``[T, H / 128]`` (1x128 groups);
    weight scales in vLLM's layout ``[E_local, 2I / 128, H / 128]`` and
    ``[E_local, H / 128, I / 128]``. Scales whose last dimension is padded
    beyond that are cut to it. Expert ranges and ``output`` as in
    ``hpc_fuse_moe``.
    """
    _hpc_ops = _moe_ops("hpc_fuse_moe_blockwise")
    num_local = int(gate_up_weight.shape[0])
    offset = _expert_offset(rank_ep, num_local, num_expert_total)
    out = _output_for(x, shared_output, output)
    if x.shape[0] == 0:
        return out
    workspace = _wrapper_workspace(
        int(x.shape[0]), gate_up_weight, down_weight, topk_ids
    )
    hidden_blocks = int(gate_up_weight.shape[2]) // 128
    inter_blocks = int(down_weight.shape[2]) // 128
    _hpc_ops.fused_moe_fp8(
        x,
        gate_up_weight,
        down_weight,
        topk_scale,
        topk_ids,
        out,
        workspace,
        w13_scale=_unpadded(gate_up_weight_scale, hidden_blocks),
        w2_scale=_unpadded(down_weight_scale, inter_blocks),
        a1_scale=x_scale,
        a2_scale=None,
        block_shape=(128, 128),
        expert_offset=offset,
        shared_output=shared_output,
        global_num_experts=num_expert_total,
    )
    return out


def _unpadded(scale: torch.Tensor, blocks: int) -> torch.Tensor:
    if scale.dim() == 3 and scale.shape[2] > blocks > 0:
        return scale[..., :blocks].contiguous()
    return scale
