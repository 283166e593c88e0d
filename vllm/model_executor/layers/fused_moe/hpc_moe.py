# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""FP8 fused-MoE experts on the in-tree HPC kernel (``--moe-backend hpc``).

``HPCExperts`` is the modular-kernel experts class the FP8 MoE oracle picks
for ``Fp8MoeBackend.HPC``. One launch of ``_hpc_C::fused_moe_fp8`` (through
``vllm._hpc_ops.fused_moe_fp8``) runs both grouped GEMMs, the SiLU-and-mul
with the FP8 requantisation of the intermediate, and the weighted top-k
reduction into the output, for two schemes:

* per-tensor: static FP8 weight scales ``[E_local]`` and static per-tensor
  activation scales for both GEMMs (``kFp8StaticTensorSym`` x2);
* block-wise: 128x128-block FP8 weights (scales ``[E_local, 2I/128, H/128]``
  and ``[E_local, H/128, I/128]`` exactly as vLLM loads them) with dynamic
  1x128 activation scales (``kFp8Static128BlockSym`` x ``kFp8Dynamic128Sym``).

It plugs into vLLM's oracle and modular kernel like the other experts
classes (module path, class name, ``moe_config=``/``quant_config=``
constructor, the ``_supports_*`` helpers, ``is_supported_config``); the
backend is available when ``vllm.utils.hpc.has_hpc_kernels()`` says so.

* ``expert_map`` is handed to the kernel, which maps each global expert id to
  its local slot and skips ids that are not on this rank (``-1``), so any
  placement works (round-robin, uneven splits). Without a map the ids are
  already local.
* ``apply_router_weight_on_input``: when the prepare step has already scaled
  the input by the router weight, the kernel uses weight 1.
* The activation scales are passed as vLLM keeps them (``a1q_scale`` from the
  prepare step, ``quant_config.a2_scale``) together with the weight scales.
* ``is_supported_config`` gives a specific reason for every configuration
  the kernel does not handle (device, missing library, quantisation scheme,
  activation, input dtype, alignment, activation format, clamped SwiGLU,
  biases, top-k).
* The kernel's scratch memory is a ``MoeWorkspace`` sized once for the most
  tokens vLLM can hand to one call; it is shared by all layers of the same
  shape and kept by vLLM's workspace manager (one per micro-batch slot), so
  no call allocates and CUDA graphs capture the launch as is. vLLM's own
  ``workspace13``/``workspace2`` are not used: the output may alias
  ``workspace13``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

import torch

import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm import _hpc_ops
from vllm._hpc_ops_validation import validate_moe_workspace
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEParallelConfig,
    FusedMoEQuantConfig,
)
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
    TopKWeightAndReduceNoOP,
)
from vllm.model_executor.layers.quantization.utils.quant_utils import (
    QuantKey,
    kFp8Dynamic128Sym,
    kFp8Static128BlockSym,
    kFp8StaticTensorSym,
)
from vllm.platforms import current_platform
from vllm.utils.hpc import has_hpc_kernels
from vllm.v1.worker.workspace import (
    current_workspace_manager,
    is_workspace_manager_initialized,
)

__all__ = [
    "BLOCK_SHAPE",
    "HPCExperts",
    "MoeWorkspace",
    "SUPPORTED_QUANT_SCHEMES",
    "workspace_max_tokens",
]

PER_TENSOR_SCHEME = (kFp8StaticTensorSym, kFp8StaticTensorSym)
BLOCK_SCHEME = (kFp8Static128BlockSym, kFp8Dynamic128Sym)
SUPPORTED_QUANT_SCHEMES = (PER_TENSOR_SCHEME, BLOCK_SCHEME)
"""Accepted (weight key, activation key) pairs."""

BLOCK_SHAPE = (128, 128)
HIDDEN_ALIGNMENT = 128
INTERMEDIATE_ALIGNMENT_PER_TENSOR = 64
INTERMEDIATE_ALIGNMENT_BLOCK = 128
SUPPORTED_IN_DTYPES = (torch.bfloat16, torch.float16)
REQUIRED_CAPABILITY = 90

_KERNEL = "the HPC fused MoE kernel"
_SCHEMES_TEXT = (
    "FP8 per-tensor static weights with static per-tensor activations "
    "(kFp8StaticTensorSym x kFp8StaticTensorSym) or FP8 128x128-block weights "
    "with dynamic 1x128 activations (kFp8Static128BlockSym x kFp8Dynamic128Sym)"
)
_WORKSPACE_KEY = "hpc_moe.MoeWorkspace"


@dataclasses.dataclass
class MoeWorkspace:
    """Scratch memory of ``vllm._hpc_ops.fused_moe_fp8``: routing tables, the
    quantized activations and the intermediate, sized once for the largest
    batch.

    One workspace serves every MoE layer of a model with the same shapes
    (calls on one stream run one after another). Nothing is allocated per
    call, so the op is CUDA-graph capturable.
    """

    buffer: torch.Tensor  # uint8, flat, on the device
    max_tokens: int
    topk: int
    num_local_experts: int
    hidden_size: int
    intermediate_size: int

    @classmethod
    def create(
        cls,
        *,
        max_tokens: int,
        topk: int,
        num_local_experts: int,
        hidden_size: int,
        intermediate_size: int,
        device: torch.device | str,
    ) -> MoeWorkspace:
        """Allocates a workspace for up to ``max_tokens`` tokens routed to
        ``topk`` experts each, over ``num_local_experts`` experts of shape
        ``hidden_size`` x ``intermediate_size`` (per rank)."""
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"device must be a CUDA device, got {device}")
        validate_moe_workspace(
            max_tokens, topk, num_local_experts, hidden_size, intermediate_size
        )
        nbytes = _hpc_ops.moe_workspace_bytes(
            max_tokens, topk, num_local_experts, hidden_size, intermediate_size
        )
        return cls(
            buffer=torch.zeros(nbytes, dtype=torch.uint8, device=device),
            max_tokens=max_tokens,
            topk=topk,
            num_local_experts=num_local_experts,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
        )


# Workspaces by key when vLLM's workspace manager is not initialised (direct
# use outside a model runner).
_workspaces: dict[Hashable, MoeWorkspace] = {}


def _on_sm90() -> bool:
    return current_platform.is_cuda() and current_platform.is_device_capability(
        REQUIRED_CAPABILITY
    )


def _device_text() -> str:
    if not current_platform.is_cuda():
        return f"a non-CUDA platform ({type(current_platform).__name__})"
    capability = current_platform.get_device_capability()
    name = current_platform.device_name or "CUDA device"
    if capability is None:
        return f"{name} of unknown compute capability"
    return f"{name} (sm{capability.to_int()})"


def _dtype_text(dtype: torch.dtype | None) -> str:
    return str(dtype).removeprefix("torch.")


def _decline_reason(
    moe_config: FusedMoEConfig,
    weight_key: QuantKey | None,
    activation_key: QuantKey | None,
    activation_format: mk.FusedMoEActivationFormat,
) -> str | None:
    """Why the kernel cannot serve this configuration, or None."""
    if not _on_sm90():
        device = _device_text()
        return f"{_KERNEL} runs only on NVIDIA Hopper (sm90) GPUs, not on {device}"
    if not has_hpc_kernels():
        return "the vllm._hpc_C kernel library is not built or failed to load"
    if moe_config.activation != MoEActivation.SILU:
        return (
            f"{_KERNEL} implements only the SiLU-gated MLP (SwiGLU), not "
            f"{moe_config.activation.name}"
        )
    if (weight_key, activation_key) not in SUPPORTED_QUANT_SCHEMES:
        return (
            f"{_KERNEL} accepts only {_SCHEMES_TEXT}; got weights {weight_key} "
            f"and activations {activation_key}"
        )
    if moe_config.in_dtype not in SUPPORTED_IN_DTYPES:
        return (
            f"{_KERNEL} takes bfloat16 or float16 model activations, not "
            f"{_dtype_text(moe_config.in_dtype)}"
        )
    if moe_config.hidden_dim % HIDDEN_ALIGNMENT != 0:
        return (
            f"{_KERNEL} needs the hidden size to be a multiple of "
            f"{HIDDEN_ALIGNMENT}, got {moe_config.hidden_dim}"
        )
    block = (weight_key, activation_key) == BLOCK_SCHEME
    align = INTERMEDIATE_ALIGNMENT_BLOCK if block else INTERMEDIATE_ALIGNMENT_PER_TENSOR
    inter = moe_config.intermediate_size_per_partition
    if inter % align != 0:
        return (
            f"{_KERNEL} needs the per-rank intermediate size to be a multiple of "
            f"{align} with {'block-wise' if block else 'per-tensor'} FP8, got "
            f"{inter}"
        )
    if activation_format != mk.FusedMoEActivationFormat.Standard:
        return (
            f"{_KERNEL} takes the standard token-major activation format, not "
            f"{activation_format.name} (used by the DeepEP low-latency and NIXL "
            "EP all-to-all backends)"
        )
    if (
        moe_config.swiglu_limit is not None
        or moe_config.swiglu_alpha is not None
        or moe_config.swiglu_beta is not None
    ):
        return (
            f"{_KERNEL} does not implement the clamped SwiGLU variant "
            "(swiglu_limit/swiglu_alpha/swiglu_beta)"
        )
    if moe_config.has_bias:
        return f"{_KERNEL} does not add expert biases"
    if not 1 <= moe_config.experts_per_token <= _hpc_ops.MOE_MAX_TOPK:
        return (
            f"{_KERNEL} routes each token to 1..{_hpc_ops.MOE_MAX_TOPK} experts, "
            f"not {moe_config.experts_per_token}"
        )
    return None


def workspace_max_tokens(moe_config: FusedMoEConfig) -> int:
    """Most tokens vLLM hands to one ``apply`` call of these experts.

    ``max_num_tokens`` is the scheduler's token budget per step and rank.
    Prepare steps that gather tokens from other ranks (all-to-all kernels
    across the EP group, the naive all-gather across DP/PCP ranks) can hand
    over that many per contributing rank. Larger calls would still be
    correct: ``apply`` then runs the kernel on slices of this size.
    """
    parallel = moe_config.moe_parallel_config
    if parallel.use_all2all_kernels:
        ranks = parallel.ep_size
    else:
        ranks = parallel.dp_size * parallel.pcp_size
    return moe_config.max_num_tokens * max(ranks, 1)


def _rows(t: torch.Tensor, start: int, end: int, whole: bool) -> torch.Tensor:
    return t if whole else t[start:end]


class HPCExperts(mk.FusedMoEExpertsModular):
    """FP8 MoE experts on the in-tree HPC kernel (NVIDIA Hopper only).

    Takes FP8 activations quantised by the prepare step, writes the weighted
    sum over the top-k experts into ``output`` (zero rows for tokens that
    have no expert on this rank) and needs no vLLM workspace.
    """

    def __init__(
        self,
        moe_config: FusedMoEConfig,
        quant_config: FusedMoEQuantConfig,
    ):
        super().__init__(moe_config, quant_config)
        self._check_quant_config(quant_config)

        parallel = moe_config.moe_parallel_config
        self.device = moe_config.device
        self.num_experts = moe_config.num_local_experts
        self.ep_rank = parallel.ep_rank
        self.ep_size = parallel.ep_size
        self.tp_rank = parallel.tp_rank
        self.tp_size = parallel.tp_size
        self.out_dtype = moe_config.in_dtype
        self.block_wise = quant_config.is_block_quantized
        self.max_workspace_tokens = workspace_max_tokens(moe_config)

    @staticmethod
    def _check_quant_config(quant_config: FusedMoEQuantConfig) -> None:
        fp8 = torch.float8_e4m3fn
        if quant_config.quant_dtype != fp8 or quant_config.weight_quant_dtype != fp8:
            raise ValueError(
                f"{_KERNEL} needs float8_e4m3fn weights and activations, got "
                f"weights {quant_config.weight_quant_dtype} and activations "
                f"{quant_config.quant_dtype}"
            )
        if quant_config.per_act_token_quant or quant_config.per_out_ch_quant:
            raise ValueError(
                f"{_KERNEL} has no per-token activation or per-channel weight "
                f"scales; it accepts {_SCHEMES_TEXT}"
            )
        if quant_config.w1_scale is None or quant_config.w2_scale is None:
            raise ValueError(f"{_KERNEL} needs the weight scales w1_scale/w2_scale")
        if quant_config.w1_bias is not None or quant_config.w2_bias is not None:
            raise ValueError(f"{_KERNEL} does not add expert biases")
        if any(
            value is not None
            for value in (
                quant_config.gemm1_alpha,
                quant_config.gemm1_beta,
                quant_config.gemm1_clamp_limit,
            )
        ):
            raise ValueError(f"{_KERNEL} does not implement the clamped SwiGLU")
        block_shape = quant_config.block_shape
        if block_shape is not None:
            if tuple(block_shape) != BLOCK_SHAPE:
                raise ValueError(
                    f"{_KERNEL} supports 128x128 weight blocks only, got {block_shape}"
                )
            if quant_config.is_scale_transposed:
                raise ValueError(
                    f"{_KERNEL} reads the activation scales as [M, H/128] "
                    "(is_scale_transposed=False)"
                )
            if quant_config.a2_scale is not None:
                raise ValueError(
                    f"{_KERNEL} quantises the intermediate dynamically per "
                    "1x128 group in block-wise mode; a static a2_scale is not "
                    "accepted"
                )
        elif not quant_config.is_per_tensor or (
            quant_config.a1_scale is None or quant_config.a2_scale is None
        ):
            raise ValueError(
                f"{_KERNEL} needs static per-tensor activation scales "
                "(a1_scale and a2_scale) with per-tensor FP8 weights"
            )

    # -- what the oracle and the modular kernel ask ----------------------

    @property
    def expects_unquantized_inputs(self) -> bool:
        # The prepare step quantises the input (per tensor or per 1x128).
        return False

    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    @staticmethod
    def is_supported_config(
        cls: type[mk.FusedMoEExperts],
        moe_config: FusedMoEConfig,
        weight_key: QuantKey | None,
        activation_key: QuantKey | None,
        activation_format: mk.FusedMoEActivationFormat,
    ) -> tuple[bool, str | None]:
        reason = _decline_reason(
            moe_config, weight_key, activation_key, activation_format
        )
        if reason is not None:
            return False, reason
        # The remaining generic checks (routing, LoRA, batch invariance, ...).
        return mk.FusedMoEExperts.is_supported_config(
            cls, moe_config, weight_key, activation_key, activation_format
        )

    @staticmethod
    def _supports_current_device() -> bool:
        return _on_sm90() and has_hpc_kernels()

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False

    @staticmethod
    def _supports_quant_scheme(
        weight_key: QuantKey | None,
        activation_key: QuantKey | None,
    ) -> bool:
        return (weight_key, activation_key) in SUPPORTED_QUANT_SCHEMES

    @staticmethod
    def _supports_activation(activation: MoEActivation) -> bool:
        return activation == MoEActivation.SILU

    @staticmethod
    def _supports_shape(hidden_dim: int) -> bool:
        return hidden_dim % HIDDEN_ALIGNMENT == 0

    @staticmethod
    def _supports_parallel_config(moe_parallel_config: FusedMoEParallelConfig) -> bool:
        # Any placement: the kernel follows expert_map.
        return True

    def supports_expert_map(self) -> bool:
        return True

    def supports_chunking(self) -> bool:
        return True

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        # The kernel applies the top-k weights and reduces.
        return TopKWeightAndReduceNoOP()

    def workspace_shapes(
        self,
        M: int,
        N: int,
        K: int,
        topk: int,
        global_num_experts: int,
        local_num_experts: int,
        expert_tokens_meta: mk.ExpertTokensMetadata | None,
        activation: MoEActivation,
    ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        # Only the output: the kernel's scratch is its own MoeWorkspace.
        return (0,), (0,), (M, K)

    # -- the kernel call -----------------------------------------------------

    def _workspace(
        self,
        device: torch.device,
        topk: int,
        num_local_experts: int,
        hidden_size: int,
        intermediate_size: int,
    ) -> MoeWorkspace:
        """The workspace for these sizes, created on first use."""
        key = (
            _WORKSPACE_KEY,
            device,
            self.max_workspace_tokens,
            topk,
            num_local_experts,
            hidden_size,
            intermediate_size,
        )

        def create() -> MoeWorkspace:
            return MoeWorkspace.create(
                max_tokens=self.max_workspace_tokens,
                topk=topk,
                num_local_experts=num_local_experts,
                hidden_size=hidden_size,
                intermediate_size=intermediate_size,
                device=device,
            )

        if is_workspace_manager_initialized():
            # Created during the warm-up runs, one per micro-batch slot.
            return current_workspace_manager().get_persistent_resource(key, create)
        workspace = _workspaces.get(key)
        if workspace is None:
            workspace = _workspaces[key] = create()
        return workspace

    def apply(
        self,
        output: torch.Tensor,
        hidden_states: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: MoEActivation,
        global_num_experts: int,
        expert_map: torch.Tensor | None,
        a1q_scale: torch.Tensor | None,
        a2_scale: torch.Tensor | None,
        workspace13: torch.Tensor | None,
        workspace2: torch.Tensor | None,
        expert_tokens_meta: mk.ExpertTokensMetadata | None,
        apply_router_weight_on_input: bool | None,
    ) -> None:
        if activation != MoEActivation.SILU:
            raise ValueError(f"{_KERNEL} implements SiLU only, got {activation}")
        quant = self.quant_config
        w13_scale, w2_scale = quant.w1_scale, quant.w2_scale
        if w13_scale is None or w2_scale is None:
            raise ValueError(f"{_KERNEL} needs the FP8 weight scales")
        a1: torch.Tensor | None
        a2: torch.Tensor | None
        if self.block_wise:
            if a1q_scale is None:
                raise ValueError(
                    f"{_KERNEL} needs the [M, H/128] activation scales of the "
                    "prepare step in block-wise mode"
                )
            a1, a2 = a1q_scale, None
        else:
            a1 = a1q_scale if a1q_scale is not None else quant.a1_scale
            a2 = quant.a2_scale

        num_tokens, topk = topk_ids.shape
        if num_tokens == 0:
            return None
        if topk_weights.dtype != torch.float32:
            topk_weights = topk_weights.to(torch.float32)
        if topk_ids.dtype not in (torch.int32, torch.int64):
            topk_ids = topk_ids.to(torch.int32)
        topk_weights = topk_weights.contiguous()
        topk_ids = topk_ids.contiguous()
        if expert_map is not None and expert_map.dtype != torch.int32:
            expert_map = expert_map.to(torch.int32)

        workspace = self._workspace(
            hidden_states.device,
            topk,
            int(w1.shape[0]),
            int(w1.shape[2]),
            int(w2.shape[2]),
        )
        step = workspace.max_tokens
        for start in range(0, num_tokens, step):
            end = min(start + step, num_tokens)
            whole = start == 0 and end == num_tokens
            _hpc_ops.fused_moe_fp8(
                _rows(hidden_states, start, end, whole),
                w1,
                w2,
                _rows(topk_weights, start, end, whole),
                _rows(topk_ids, start, end, whole),
                _rows(output, start, end, whole),
                workspace,
                w13_scale=w13_scale,
                w2_scale=w2_scale,
                # Block-wise scales are per token row; per-tensor ones whole.
                a1_scale=(
                    _rows(a1, start, end, whole)
                    if a1 is not None and self.block_wise
                    else a1
                ),
                a2_scale=a2,
                block_shape=BLOCK_SHAPE if self.block_wise else None,
                expert_map=expert_map,
                expert_offset=0,
                apply_router_weight_on_input=bool(apply_router_weight_on_input),
                global_num_experts=max(int(global_num_experts), int(w1.shape[0])),
            )
        return None
