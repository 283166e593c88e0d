# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU tests of HPCExperts (``--moe-backend hpc``) in a patched vLLM.

They need vLLM 0.33.0 with this patch set applied and skip otherwise. The
FP8 MoE oracle runs for real with the platform made to look like an sm90
CUDA machine. The fused kernel is never launched: ``apply`` is checked with
a recording stand-in for ``vllm._hpc_ops.fused_moe_fp8`` and, when the
library is loaded, against the real op layer on meta tensors (argument
validation plus the op's fake implementation).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import regex as re
import torch

from vllm import _hpc_ops
from vllm._hpc_ops_validation import validate_fused_moe_fp8
from vllm.model_executor.layers.fused_moe import hpc_moe
from vllm.model_executor.layers.fused_moe import (
    modular_kernel as mk,
)
from vllm.model_executor.layers.fused_moe.activation import (
    MoEActivation,
)
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEParallelConfig,
    RoutingMethodType,
    fp8_w8a8_moe_quant_config,
)
from vllm.model_executor.layers.fused_moe.oracle.fp8 import (
    Fp8MoeBackend,
    backend_to_kernel_cls,
    make_fp8_moe_kernel,
    make_fp8_moe_quant_config,
    map_fp8_backend,
    resolve_fp8_moe_weight_block_shape,
    select_fp8_moe_backend,
)
from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import (
    MoEPrepareAndFinalizeNoDPEPModular,
)
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
    TopKWeightAndReduceNoOP,
)
from vllm.model_executor.layers.quantization.utils.quant_utils import (
    GroupShape,
    create_fp8_quant_key,
    kFp8Dynamic128Sym,
    kFp8DynamicTensorSym,
    kFp8DynamicTokenSym,
    kFp8Static128BlockSym,
    kFp8StaticChannelSym,
    kFp8StaticTensorSym,
)
from vllm.platforms import current_platform
from vllm.platforms.interface import DeviceCapability
from vllm.utils import hpc as hpc_utils
from vllm.v1.worker.workspace import WorkspaceManager

HPCExperts = hpc_moe.HPCExperts
FP8 = torch.float8_e4m3fn
PER_TENSOR = (kFp8StaticTensorSym, kFp8StaticTensorSym)
BLOCK = (kFp8Static128BlockSym, kFp8Dynamic128Sym)
UNSUPPORTED_PREFIX = re.escape(
    "FP8 MoE backend HPC does not support the deployment configuration since "
)
KERNEL = "the HPC fused MoE kernel "


# ---------------------------------------------------------------------------
# Fixtures and helpers
# ---------------------------------------------------------------------------


def _set_platform(
    monkeypatch: pytest.MonkeyPatch,
    capability: tuple[int, int] | None = (9, 0),
    *,
    cuda: bool = True,
    kernels: bool = True,
) -> None:
    """Make the platform look like a CUDA GPU of ``capability``."""

    def is_device_capability(cap: tuple[int, int] | int, device_id: int = 0) -> bool:
        if capability is None:
            return False
        want = cap if isinstance(cap, int) else cap[0] * 10 + cap[1]
        return capability[0] * 10 + capability[1] == want

    def get_device_capability(device_id: int = 0) -> DeviceCapability | None:
        return None if capability is None else DeviceCapability(*capability)

    monkeypatch.setattr(current_platform, "is_cuda", lambda: cuda)
    monkeypatch.setattr(current_platform, "is_device_capability", is_device_capability)
    monkeypatch.setattr(
        current_platform, "get_device_capability", get_device_capability
    )
    monkeypatch.setattr(hpc_moe, "has_hpc_kernels", lambda: kernels)


@pytest.fixture
def sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    """An sm90 CUDA platform with the fused MoE op reported available."""
    _set_platform(monkeypatch)


@pytest.fixture(autouse=True)
def _no_workspace_leaks(monkeypatch: pytest.MonkeyPatch):
    """Each test starts without cached workspaces and the workspace manager."""
    monkeypatch.setattr(hpc_moe, "_workspaces", {})
    monkeypatch.setattr(hpc_moe, "is_workspace_manager_initialized", lambda: False)
    yield


def _parallel(**overrides: Any) -> FusedMoEParallelConfig:
    return dataclasses.replace(FusedMoEParallelConfig.make_no_parallel(), **overrides)


def _moe_config(
    *,
    hidden: int = 256,
    inter: int = 256,
    num_experts: int = 8,
    num_local_experts: int | None = None,
    topk: int = 2,
    activation: MoEActivation = MoEActivation.SILU,
    in_dtype: torch.dtype = torch.bfloat16,
    parallel: FusedMoEParallelConfig | None = None,
    **kwargs: Any,
) -> FusedMoEConfig:
    return FusedMoEConfig(
        num_experts=num_experts,
        experts_per_token=topk,
        hidden_dim=hidden,
        intermediate_size=inter,
        num_local_experts=num_local_experts or num_experts,
        num_logical_experts=num_experts,
        activation=activation,
        device="cpu",
        routing_method=RoutingMethodType.Renormalize,
        moe_parallel_config=parallel or _parallel(),
        in_dtype=in_dtype,
        moe_backend="hpc",
        **kwargs,
    )


def _per_tensor_quant(num_local: int = 8, device: str = "cpu"):
    return make_fp8_moe_quant_config(
        Fp8MoeBackend.HPC,
        w1_scale=torch.full((num_local,), 0.5, device=device),
        w2_scale=torch.full((num_local,), 0.25, device=device),
        a1_scale=torch.tensor(0.125, device=device),
        a2_scale=torch.tensor(2.0, device=device),
    )


def _block_quant(num_local: int, hidden: int, inter: int, device: str = "cpu"):
    return make_fp8_moe_quant_config(
        Fp8MoeBackend.HPC,
        w1_scale=torch.ones(num_local, 2 * inter // 128, hidden // 128, device=device),
        w2_scale=torch.ones(num_local, hidden // 128, inter // 128, device=device),
        a1_scale=None,
        a2_scale=None,
        block_shape=[128, 128],
    )


class _RecordingOps:
    """Stands in for ``fused_moe_fp8`` and ``MoeWorkspace.create``.

    With ``forward`` every argument is validated and the call passed on to
    the real op (meta tensors only, so nothing runs).
    """

    def __init__(self, forward: bool = False) -> None:
        self.calls: list[tuple[tuple, dict]] = []
        self.created: list[dict] = []
        self.forward = forward
        self._real_fused_moe = _hpc_ops.fused_moe_fp8

    def fused_moe_fp8(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append((args, kwargs))
        if self.forward:
            validate_fused_moe_fp8(*args, **kwargs)
            self._real_fused_moe(*args, **kwargs)

    def create(self, **kwargs: Any) -> Any:
        self.created.append(kwargs)
        sizes = {k: v for k, v in kwargs.items() if k != "device"}
        buffer = torch.empty(16, dtype=torch.uint8, device=kwargs["device"])
        return hpc_moe.MoeWorkspace(buffer=buffer, **sizes)


@pytest.fixture
def ops(monkeypatch: pytest.MonkeyPatch) -> _RecordingOps:
    rec = _RecordingOps()
    _install(monkeypatch, rec)
    return rec


def _install(monkeypatch: pytest.MonkeyPatch, rec: _RecordingOps) -> None:
    monkeypatch.setattr(_hpc_ops, "fused_moe_fp8", rec.fused_moe_fp8)
    monkeypatch.setattr(hpc_moe.MoeWorkspace, "create", staticmethod(rec.create))


def _moe_inputs(
    num_tokens: int,
    num_local: int,
    hidden: int,
    inter: int,
    topk: int,
    *,
    device: str = "meta",
    block: bool = False,
) -> dict[str, torch.Tensor | None]:
    return {
        "output": torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=device),
        "hidden_states": torch.empty(num_tokens, hidden, dtype=FP8, device=device),
        "w1": torch.empty(num_local, 2 * inter, hidden, dtype=FP8, device=device),
        "w2": torch.empty(num_local, hidden, inter, dtype=FP8, device=device),
        "topk_weights": torch.empty(num_tokens, topk, device=device),
        "topk_ids": torch.zeros(num_tokens, topk, dtype=torch.int32, device=device),
        "a1q_scale": (
            torch.empty(num_tokens, hidden // 128, device=device)
            if block
            else torch.empty((), device=device)
        ),
    }


def _apply(
    experts: HPCExperts,
    inputs: dict[str, torch.Tensor | None],
    *,
    expert_map: torch.Tensor | None = None,
    apply_router_weight_on_input: bool = False,
    global_num_experts: int = 8,
) -> None:
    experts.apply(
        activation=MoEActivation.SILU,
        global_num_experts=global_num_experts,
        expert_map=expert_map,
        a2_scale=experts.a2_scale,
        workspace13=None,
        workspace2=None,
        expert_tokens_meta=None,
        apply_router_weight_on_input=apply_router_weight_on_input,
        **inputs,
    )


# ---------------------------------------------------------------------------
# Oracle: backend mapping and selection
# ---------------------------------------------------------------------------


def test_map_fp8_backend_hpc():
    assert map_fp8_backend("hpc") is Fp8MoeBackend.HPC
    assert backend_to_kernel_cls(Fp8MoeBackend.HPC) == [HPCExperts]
    assert HPCExperts.__module__ == "vllm.model_executor.layers.fused_moe.hpc_moe"


@pytest.mark.parametrize("keys", [PER_TENSOR, BLOCK], ids=["per_tensor", "block"])
def test_select_returns_hpc_experts(sm90, keys):
    backend, cls = select_fp8_moe_backend(_moe_config(), *keys)
    assert backend is Fp8MoeBackend.HPC
    assert cls is HPCExperts


def test_select_with_expert_parallelism(sm90):
    # TP+EP with one DP rank: standard format, the expert map places experts.
    config = _moe_config(
        num_local_experts=4, parallel=_parallel(ep_size=2, ep_rank=1, use_ep=True)
    )
    assert select_fp8_moe_backend(config, *PER_TENSOR) == (
        Fp8MoeBackend.HPC,
        HPCExperts,
    )


def test_select_accepts_per_tensor_intermediate_of_64(sm90):
    # 192 is a multiple of 64 (per-tensor) but not of 128 (block-wise).
    config = _moe_config(inter=192)
    assert select_fp8_moe_backend(config, *PER_TENSOR)[1] is HPCExperts
    with pytest.raises(
        ValueError, match="multiple of 128 with block-wise FP8, got 192"
    ):
        select_fp8_moe_backend(config, *BLOCK)


def test_select_accepts_float16(sm90):
    config = _moe_config(in_dtype=torch.float16)
    assert select_fp8_moe_backend(config, *BLOCK)[1] is HPCExperts


_DECLINES = {
    "dynamic_per_tensor_activation": (
        {},
        (kFp8StaticTensorSym, kFp8DynamicTensorSym),
        (
            "accepts only FP8 per-tensor static weights with static per-tensor "
            "activations .* got weights .* and activations .*dynamic,per_tensor"
        ),
    ),
    "dynamic_per_token_activation": (
        {},
        (kFp8StaticTensorSym, kFp8DynamicTokenSym),
        "accepts only FP8 per-tensor static weights",
    ),
    "channel_weights": (
        {},
        (kFp8StaticChannelSym, kFp8DynamicTokenSym),
        (
            r"accepts only .*128x128-block weights with dynamic 1x128 activations "
            r"\(kFp8Static128BlockSym x kFp8Dynamic128Sym\); got weights "
            r".*per_channel"
        ),
    ),
    "channel_weights_static_activation": (
        {},
        (kFp8StaticChannelSym, kFp8StaticTensorSym),
        "accepts only FP8 per-tensor static weights",
    ),
    "block_weights_static_activation": (
        {},
        (kFp8Static128BlockSym, kFp8StaticTensorSym),
        "accepts only FP8 per-tensor static weights",
    ),
    "gelu": (
        {"activation": MoEActivation.GELU},
        PER_TENSOR,
        "implements only the SiLU-gated MLP \\(SwiGLU\\), not GELU",
    ),
    "hidden_not_128": (
        {"hidden": 200},
        PER_TENSOR,
        "needs the hidden size to be a multiple of 128, got 200",
    ),
    "intermediate_not_64": (
        {"inter": 96},
        PER_TENSOR,
        (
            "needs the per-rank intermediate size to be a multiple of 64 with "
            "per-tensor FP8, got 96"
        ),
    ),
    "float32_input": (
        {"in_dtype": torch.float32},
        PER_TENSOR,
        "takes bfloat16 or float16 model activations, not float32",
    ),
    "batched_format": (
        {
            "parallel": _parallel(
                dp_size=2,
                ep_size=2,
                use_ep=True,
                all2all_backend="deepep_low_latency",
            ),
            "num_local_experts": 4,
        },
        BLOCK,
        "takes the standard token-major activation format, not BatchedExperts",
    ),
    "swiglu_limit": (
        {"swiglu_limit": 7.0},
        PER_TENSOR,
        "does not implement the clamped SwiGLU",
    ),
    "bias": ({"has_bias": True}, BLOCK, "does not add expert biases"),
    "topk_above_limit": (
        {"topk": 17, "num_experts": 32},
        PER_TENSOR,
        "routes each token to 1..16 experts, not 17",
    ),
}


@pytest.mark.parametrize("case", sorted(_DECLINES))
def test_select_declines_with_reason(sm90, case):
    overrides, keys, reason = _DECLINES[case]
    config = _moe_config(**overrides)
    with pytest.raises(ValueError, match=UNSUPPORTED_PREFIX + KERNEL + reason):
        select_fp8_moe_backend(config, *keys)
    supported, why = HPCExperts.is_supported_config(
        HPCExperts, config, *keys, mk.FusedMoEActivationFormat.Standard
    )
    if case == "batched_format":
        # The format comes from the parallel config, not from the keys.
        assert supported is True and why is None
    else:
        assert supported is False and re.fullmatch(KERNEL + reason + ".*", why)


@pytest.mark.parametrize(
    "capability, cuda, needle",
    [
        ((10, 0), True, r".* \(sm100\)\.$"),
        ((8, 9), True, r".* \(sm89\)\.$"),
        (None, True, ".* of unknown compute capability"),
        ((9, 0), False, r"a non-CUDA platform \(\w+\)"),
    ],
)
def test_select_declines_other_devices(monkeypatch, capability, cuda, needle):
    _set_platform(monkeypatch, capability, cuda=cuda)
    runs_only = re.escape("runs only on NVIDIA Hopper (sm90) GPUs, not on ")
    with pytest.raises(
        ValueError, match=UNSUPPORTED_PREFIX + KERNEL + runs_only + needle
    ):
        select_fp8_moe_backend(_moe_config(), *PER_TENSOR)
    assert HPCExperts._supports_current_device() is False


def test_select_declines_without_library(monkeypatch):
    _set_platform(monkeypatch, kernels=False)
    with pytest.raises(
        ValueError,
        match=UNSUPPORTED_PREFIX
        + r"the vllm\._hpc_C kernel library is not built or failed to load",
    ):
        select_fp8_moe_backend(_moe_config(), *BLOCK)
    assert HPCExperts._supports_current_device() is False


def test_generic_checks_still_apply(sm90):
    # LoRA is declined by vLLM's own check, which runs after ours.
    config = _moe_config(is_lora_enabled=True)
    with pytest.raises(ValueError, match=UNSUPPORTED_PREFIX + "kernel does not"):
        select_fp8_moe_backend(config, *PER_TENSOR)


def test_static_support_helpers(sm90):
    assert HPCExperts._supports_current_device() is True
    assert HPCExperts._supports_quant_scheme(*PER_TENSOR)
    assert HPCExperts._supports_quant_scheme(*BLOCK)
    assert not HPCExperts._supports_quant_scheme(
        kFp8StaticTensorSym, kFp8DynamicTensorSym
    )
    refined = create_fp8_quant_key(static=True, group_shape=GroupShape(64, 64))
    assert not HPCExperts._supports_quant_scheme(refined, kFp8Dynamic128Sym)
    assert HPCExperts._supports_activation(MoEActivation.SILU)
    assert not HPCExperts._supports_activation(MoEActivation.GELU)
    assert HPCExperts._supports_shape(384) and not HPCExperts._supports_shape(320)
    assert HPCExperts._supports_no_act_and_mul() is False
    assert HPCExperts.activation_format() is mk.FusedMoEActivationFormat.Standard


def test_block_tp_shard_is_padded_to_whole_blocks(sm90):
    # Per-rank intermediate 192 could be refined to 64x64 blocks, which HPC
    # does not take: the oracle pads the shard to 256 instead.
    config = _moe_config(inter=384, parallel=_parallel(tp_size=2, tp_rank=1))
    assert config.intermediate_size_per_partition == 192
    block, refine = resolve_fp8_moe_weight_block_shape(
        config, [128, 128], kFp8Dynamic128Sym, True
    )
    assert (block, refine) == ([128, 128], None)
    assert config.intermediate_size_per_partition == 256
    assert select_fp8_moe_backend(config, *BLOCK)[1] is HPCExperts


# ---------------------------------------------------------------------------
# Construction
# ---------------------------------------------------------------------------


def test_make_fp8_moe_kernel_per_tensor(sm90):
    config = _moe_config()
    quant = _per_tensor_quant()
    kernel = make_fp8_moe_kernel(quant, config, HPCExperts, Fp8MoeBackend.HPC)
    experts = kernel.fused_experts
    assert isinstance(experts, HPCExperts)
    assert isinstance(kernel.prepare_finalize, MoEPrepareAndFinalizeNoDPEPModular)
    assert experts.quant_config is quant and experts.moe_config is config
    assert experts.block_wise is False
    assert experts.expects_unquantized_inputs is False
    assert experts.max_workspace_tokens == config.max_num_tokens
    assert torch.equal(quant.g1_alphas, torch.full((8,), 0.0625))


def test_make_fp8_moe_kernel_block(sm90):
    config = _moe_config(
        num_local_experts=4, parallel=_parallel(ep_size=2, use_ep=True)
    )
    quant = _block_quant(4, 256, 256)
    kernel = make_fp8_moe_kernel(quant, config, HPCExperts, Fp8MoeBackend.HPC)
    experts = kernel.fused_experts
    assert isinstance(experts, HPCExperts)
    assert experts.block_wise is True
    assert (experts.ep_size, experts.num_experts) == (2, 4)


def test_direct_construction_with_real_quant_config():
    quant = fp8_w8a8_moe_quant_config(
        w1_scale=torch.ones(8),
        w2_scale=torch.ones(8),
        a1_scale=torch.tensor(1.0),
        a2_scale=torch.tensor(1.0),
    )
    experts = HPCExperts(moe_config=_moe_config(), quant_config=quant)
    assert experts.out_dtype == torch.bfloat16 and experts.num_experts == 8
    assert experts.supports_expert_map() and experts.supports_chunking()


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"a1_scale": None, "a2_scale": None}, "static per-tensor activation"),
        ({"a2_scale": None}, "static per-tensor activation"),
        ({"per_act_token_quant": True, "a1_scale": None}, "per-token activation"),
        ({"per_out_ch_quant": True}, "per-channel weight"),
        ({"w1_bias": torch.zeros(8, 512)}, "expert biases"),
        ({"gemm1_clamp_limit": 7.0}, "clamped SwiGLU"),
        ({"block_shape": [64, 64], "a1_scale": None, "a2_scale": None}, "128x128"),
        ({"block_shape": [128, 128], "a1_scale": None}, "static a2_scale"),
        (
            {
                "block_shape": [128, 128],
                "a1_scale": None,
                "a2_scale": None,
                "is_scale_transposed": True,
            },
            "is_scale_transposed=False",
        ),
    ],
)
def test_constructor_rejects_unsupported_quant(kwargs, needle):
    args: dict[str, Any] = {
        "w1_scale": torch.ones(8),
        "w2_scale": torch.ones(8),
        "a1_scale": torch.tensor(1.0),
        "a2_scale": torch.tensor(1.0),
    }
    args.update(kwargs)
    quant = fp8_w8a8_moe_quant_config(**args)
    with pytest.raises(ValueError, match=needle):
        HPCExperts(moe_config=_moe_config(), quant_config=quant)


def test_workspace_shapes_and_finalize(sm90):
    experts = HPCExperts(moe_config=_moe_config(), quant_config=_per_tensor_quant())
    for m, k in ((1, 256), (37, 4096)):
        shapes = experts.workspace_shapes(m, 512, k, 2, 8, 8, None, MoEActivation.SILU)
        # Nothing in workspace13 (the output may alias it) or workspace2.
        assert shapes == ((0,), (0,), (m, k))
    assert isinstance(
        experts.finalize_weight_and_reduce_impl(), TopKWeightAndReduceNoOP
    )


@pytest.mark.parametrize(
    "parallel, factor",
    [
        ({}, 1),
        ({"tp_size": 2, "ep_size": 2, "use_ep": True}, 1),  # TP+EP, one DP rank
        ({"dp_size": 2}, 2),  # naive all-gather across DP
        ({"dp_size": 2, "pcp_size": 2}, 4),
        (
            {
                "dp_size": 2,
                "ep_size": 4,
                "use_ep": True,
                "all2all_backend": "deepep_high_throughput",
            },
            4,
        ),
    ],
)
def test_workspace_max_tokens(parallel, factor):
    config = _moe_config(parallel=_parallel(**parallel), max_num_tokens=1024)
    assert hpc_moe.workspace_max_tokens(config) == 1024 * factor


# ---------------------------------------------------------------------------
# apply(): what reaches the op layer
# ---------------------------------------------------------------------------


def test_apply_per_tensor(sm90, ops):
    experts = HPCExperts(
        moe_config=_moe_config(), quant_config=_per_tensor_quant(device="meta")
    )
    inputs = _moe_inputs(5, 8, 256, 256, 2)
    topk_weights = inputs["topk_weights"]
    assert topk_weights is not None
    inputs["topk_weights"] = topk_weights.to(torch.bfloat16)
    _apply(experts, inputs)

    ((args, kw),) = ops.calls
    assert args[0] is inputs["hidden_states"]
    assert args[1] is inputs["w1"] and args[2] is inputs["w2"]
    assert args[3].dtype == torch.float32 and args[3].shape == (5, 2)
    assert args[4] is inputs["topk_ids"]
    assert args[5] is inputs["output"]
    quant = experts.quant_config
    assert kw["w13_scale"] is quant.w1_scale and kw["w2_scale"] is quant.w2_scale
    assert kw["a1_scale"] is inputs["a1q_scale"]
    assert kw["a2_scale"] is quant.a2_scale
    assert kw["block_shape"] is None
    assert kw["expert_map"] is None and kw["expert_offset"] == 0
    assert kw["apply_router_weight_on_input"] is False
    assert "shared_output" not in kw

    (created,) = ops.created
    assert created == {
        "max_tokens": experts.max_workspace_tokens,
        "topk": 2,
        "num_local_experts": 8,
        "hidden_size": 256,
        "intermediate_size": 256,
        "device": torch.device("meta"),
    }
    assert args[6].max_tokens == experts.max_workspace_tokens


def test_apply_per_tensor_falls_back_to_config_a1_scale(sm90, ops):
    experts = HPCExperts(
        moe_config=_moe_config(), quant_config=_per_tensor_quant(device="meta")
    )
    inputs = _moe_inputs(3, 8, 256, 256, 2)
    inputs["a1q_scale"] = None
    _apply(experts, inputs)
    assert ops.calls[0][1]["a1_scale"] is experts.quant_config.a1_scale


def test_apply_block_wise_with_expert_map(sm90, ops):
    config = _moe_config(
        num_local_experts=4, parallel=_parallel(ep_size=2, ep_rank=1, use_ep=True)
    )
    experts = HPCExperts(
        moe_config=config, quant_config=_block_quant(4, 256, 256, device="meta")
    )
    inputs = _moe_inputs(6, 4, 256, 256, 2, block=True)
    # Round-robin placement: rank 1 holds the odd experts.
    expert_map = torch.tensor([-1, 0, -1, 1, -1, 2, -1, 3], dtype=torch.int32)
    expert_map = expert_map.to("meta")
    _apply(experts, inputs, expert_map=expert_map)

    ((args, kw),) = ops.calls
    assert kw["expert_map"] is expert_map and kw["expert_offset"] == 0
    assert kw["a1_scale"] is inputs["a1q_scale"]
    assert kw["a2_scale"] is None
    assert tuple(kw["block_shape"]) == (128, 128)
    assert kw["w13_scale"] is experts.quant_config.w1_scale
    assert ops.created[0]["num_local_experts"] == 4


def test_apply_converts_expert_map_dtype(sm90, ops):
    experts = HPCExperts(
        moe_config=_moe_config(), quant_config=_per_tensor_quant(device="meta")
    )
    expert_map = torch.arange(8, dtype=torch.int64, device="meta")
    _apply(experts, _moe_inputs(2, 8, 256, 256, 2), expert_map=expert_map)
    assert ops.calls[0][1]["expert_map"].dtype == torch.int32


def test_apply_router_weight_on_input(sm90, ops):
    experts = HPCExperts(
        moe_config=_moe_config(topk=1), quant_config=_per_tensor_quant(device="meta")
    )
    _apply(experts, _moe_inputs(4, 8, 256, 256, 1), apply_router_weight_on_input=True)
    assert ops.calls[0][1]["apply_router_weight_on_input"] is True


def test_apply_reuses_one_workspace(sm90, ops):
    quant = _per_tensor_quant(device="meta")
    first = HPCExperts(moe_config=_moe_config(), quant_config=quant)
    second = HPCExperts(moe_config=_moe_config(), quant_config=quant)
    _apply(first, _moe_inputs(5, 8, 256, 256, 2))
    _apply(first, _moe_inputs(9, 8, 256, 256, 2))
    _apply(second, _moe_inputs(1, 8, 256, 256, 2))
    assert len(ops.created) == 1
    workspaces = {id(args[6]) for args, _ in ops.calls}
    assert len(workspaces) == 1

    # Other sizes get their own.
    _apply(first, _moe_inputs(5, 8, 256, 128, 2))
    assert len(ops.created) == 2
    assert ops.created[1]["intermediate_size"] == 128


@pytest.mark.parametrize("block", [False, True], ids=["per_tensor", "block"])
def test_apply_slices_batches_beyond_the_workspace(sm90, ops, block):
    config = _moe_config(max_num_tokens=4)
    quant = (
        _block_quant(8, 256, 256, device="meta")
        if block
        else _per_tensor_quant(device="meta")
    )
    experts = HPCExperts(moe_config=config, quant_config=quant)
    inputs = _moe_inputs(10, 8, 256, 256, 2, block=block)
    _apply(experts, inputs)

    assert [args[0].shape[0] for args, _ in ops.calls] == [4, 4, 2]
    for (args, kw), start in zip(ops.calls, (0, 4, 8), strict=True):
        out = args[5]
        assert out.shape == (min(4, 10 - start), 256)
        assert out.storage_offset() == start * 256
        assert args[0].storage_offset() == start * 256
        assert args[3].storage_offset() == start * 2
        assert args[4].storage_offset() == start * 2
        if block:
            assert kw["a1_scale"].storage_offset() == start * 2
            assert kw["a1_scale"].shape[0] == out.shape[0]
        else:
            assert kw["a1_scale"] is inputs["a1q_scale"]
    assert len(ops.created) == 1 and ops.created[0]["max_tokens"] == 4


def test_apply_uses_workspace_manager(sm90, ops, monkeypatch):
    manager = WorkspaceManager(torch.device("cpu"))
    monkeypatch.setattr(hpc_moe, "is_workspace_manager_initialized", lambda: True)
    monkeypatch.setattr(hpc_moe, "current_workspace_manager", lambda: manager)
    quant = _per_tensor_quant(device="meta")
    experts = HPCExperts(moe_config=_moe_config(), quant_config=quant)
    _apply(experts, _moe_inputs(3, 8, 256, 256, 2))
    manager.lock()
    _apply(experts, _moe_inputs(7, 8, 256, 256, 2))
    assert len(ops.created) == 1
    assert ops.calls[0][0][6] is ops.calls[1][0][6]
    # A shape first seen after warm-up cannot allocate any more.
    other = HPCExperts(moe_config=_moe_config(topk=4), quant_config=quant)
    with pytest.raises(AssertionError, match="not allocated during warmup"):
        _apply(other, _moe_inputs(3, 8, 256, 256, 4))


def test_apply_rejects_other_activation(sm90, ops):
    experts = HPCExperts(
        moe_config=_moe_config(), quant_config=_per_tensor_quant(device="meta")
    )
    with pytest.raises(ValueError, match="SiLU only"):
        experts.apply(
            activation=MoEActivation.GELU,
            global_num_experts=8,
            expert_map=None,
            a2_scale=None,
            workspace13=None,
            workspace2=None,
            expert_tokens_meta=None,
            apply_router_weight_on_input=False,
            **_moe_inputs(2, 8, 256, 256, 2),
        )
    assert not ops.calls


@pytest.mark.skipif(
    not hpc_utils.has_hpc_kernels(), reason="the _hpc_C library is not built"
)
@pytest.mark.parametrize("block", [False, True], ids=["per_tensor", "block"])
def test_apply_arguments_pass_op_validation(sm90, monkeypatch, block):
    """The real op layer accepts what apply() hands it (meta tensors)."""
    rec = _RecordingOps(forward=True)
    _install(monkeypatch, rec)
    config = _moe_config(
        num_local_experts=4,
        max_num_tokens=4,
        parallel=_parallel(ep_size=2, use_ep=True),
    )
    quant = (
        _block_quant(4, 256, 256, device="meta")
        if block
        else _per_tensor_quant(4, device="meta")
    )
    experts = HPCExperts(moe_config=config, quant_config=quant)
    expert_map = torch.tensor([0, 1, 2, 3, -1, -1, -1, -1], dtype=torch.int32)
    inputs = _moe_inputs(6, 4, 256, 256, 2, block=block)
    _apply(experts, inputs, expert_map=expert_map.to("meta"))
    assert len(rec.calls) == 2


# ---------------------------------------------------------------------------
# MoeWorkspace
# ---------------------------------------------------------------------------

_WORKSPACE_SIZES = {
    "max_tokens": 256,
    "topk": 8,
    "num_local_experts": 16,
    "hidden_size": 2048,
    "intermediate_size": 768,
}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"device": "cpu"}, "CUDA device"),
        ({"device": "meta"}, "CUDA device"),
        ({"topk": 17}, "topk is 17"),
        ({"hidden_size": 200}, "hidden_size is 200"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_moe_workspace_validation(kwargs, match):
    args = {**_WORKSPACE_SIZES, "device": "cuda", **kwargs}
    with pytest.raises(ValueError, match=match):
        hpc_moe.MoeWorkspace.create(**args)


@pytest.mark.skipif(
    not hpc_utils.has_hpc_kernels(), reason="the _hpc_C library is not built"
)
def test_moe_workspace_sized_by_the_library():
    """Under FakeTensorMode (no GPU needed) the buffer is the library's size
    and the workspace carries what fused_moe_fp8 reads."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        ws = hpc_moe.MoeWorkspace.create(**_WORKSPACE_SIZES, device="cuda")
        assert ws.buffer.dtype == torch.uint8 and ws.buffer.device.type == "cuda"
        assert ws.buffer.numel() == _hpc_ops.moe_workspace_bytes(**_WORKSPACE_SIZES)
    assert {f.name for f in dataclasses.fields(ws)} == {"buffer", *_WORKSPACE_SIZES}
