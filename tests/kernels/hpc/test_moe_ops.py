# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU checks of the fused FP8 MoE op layer and of its reference.

* Argument validation of ``fused_moe_fp8``, ``moe_workspace_bytes`` and
  ``moe_tiling`` (``vllm._hpc_ops_validation``): every rejected input raises
  ``ValueError`` naming the argument. Inputs live on the meta device;
  validation needs no library. The
  workspace is a stand-in with the fields the op reads (``MoeWorkspace``
  belongs to the vLLM layer; its tests are in tests/kernels/moe/).
* Valid calls on meta tensors reach the op's fake implementation, which
  also runs under ``FakeTensorMode`` and ``make_fx`` (these need the library
  built with the MoE op, not a GPU, and skip otherwise).
* The float64 reference against a case worked out by hand and against an
  independent element-by-element loop (with its own E4M3 rounding), and the
  input builders' properties.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import struct
from types import SimpleNamespace
from typing import TYPE_CHECKING

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tests.kernels.hpc.moe_reference import (
    A2_SCALE,
    BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    MoeInputs,
    MoeWeights,
    check_moe,
    local_slots,
    make_expert_map,
    make_moe_inputs,
    make_moe_weights,
    make_routing,
    moe_workspace,
)
from tests.kernels.hpc.utils import import_hpc_ops, import_hpc_validation

if TYPE_CHECKING:
    from vllm._hpc_ops import MoeTiling

hpc_ops = import_hpc_ops()
validation = import_hpc_validation()


needs_op = pytest.mark.skipif(
    not hpc_ops.hpc_ops_available(), reason="the _hpc_C library is not built"
)

META = torch.device("meta")
BF16 = torch.bfloat16
M, E, K, H, N = 5, 4, 2, 256, 128  # N: intermediate size


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------


def workspace(device: torch.device = META, **overrides) -> SimpleNamespace:
    """The fields ``fused_moe_fp8`` reads of a workspace, with room for the
    baseline call."""
    fields = {
        "buffer": torch.empty(1 << 16, dtype=torch.uint8, device=device),
        "max_tokens": 8,
        "topk": K,
        "num_local_experts": E,
        "hidden_size": H,
        "intermediate_size": N,
    }
    return SimpleNamespace(**{**fields, **overrides})


def _t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=META)


def inputs(
    block: bool = False,
    hidden_dtype: torch.dtype = BF16,
    static_a1: bool = True,
    **changes,
) -> dict:
    """Keyword arguments of a valid call on meta tensors."""
    fp8_in = hidden_dtype == FP8_DTYPE
    if block:
        w13_scale = _t(E, 2 * N // BLOCK, H // BLOCK)
        w2_scale = _t(E, H // BLOCK, N // BLOCK)
        a1_scale = _t(M, H // BLOCK) if fp8_in else None
        a2_scale = None
    else:
        w13_scale, w2_scale = _t(E), _t(E)
        a1_scale = _t() if fp8_in or static_a1 else None
        a2_scale = _t()
    args = {
        "hidden_states": _t(M, H, dtype=hidden_dtype),
        "w13": _t(E, 2 * N, H, dtype=FP8_DTYPE),
        "w2": _t(E, H, N, dtype=FP8_DTYPE),
        "topk_weights": _t(M, K),
        "topk_ids": _t(M, K, dtype=torch.int32),
        "out": _t(M, H, dtype=BF16),
        "workspace": workspace(),
        "w13_scale": w13_scale,
        "w2_scale": w2_scale,
        "a1_scale": a1_scale,
        "a2_scale": a2_scale,
        "block_shape": (BLOCK, BLOCK) if block else None,
    }
    args.update(changes)
    return args


_POSITIONAL = ("hidden_states", "w13", "w2", "topk_weights", "topk_ids", "out")


def call(args: dict) -> None:
    """Validates the arguments, then calls the op."""
    args = dict(args)
    positional = [args.pop(k) for k in (*_POSITIONAL, "workspace")]
    validation.validate_fused_moe_fp8(*positional, **args)
    hpc_ops.fused_moe_fp8(*positional, **args)


VALID_CASES = {
    "tensor-static-bf16": inputs(),
    "tensor-dynamic-bf16": inputs(static_a1=False),
    "tensor-dynamic-fp16": inputs(
        static_a1=False,
        hidden_states=_t(M, H, dtype=torch.float16),
        out=_t(M, H, dtype=torch.float16),
    ),
    "tensor-fp8": inputs(hidden_dtype=FP8_DTYPE),
    "tensor-scales-1": inputs(a1_scale=_t(1), a2_scale=_t(1)),
    "block-bf16": inputs(block=True),
    "block-fp8": inputs(block=True, hidden_dtype=FP8_DTYPE, block_shape=[128, 128]),
    "ep-map-shared-int64": inputs(
        topk_ids=_t(M, K, dtype=torch.int64),
        expert_map=_t(16, dtype=torch.int32),
        shared_output=_t(M, H, dtype=BF16),
    ),
    "ep-offset": inputs(expert_offset=8),
    "weight-on-input": inputs(
        topk_weights=_t(M, 1),
        topk_ids=_t(M, 1, dtype=torch.int32),
        workspace=workspace(topk=1),
        apply_router_weight_on_input=True,
    ),
    "padded-rows": inputs(
        hidden_states=_t(M, H + 8, dtype=BF16)[:, :H],
        out=_t(M, H + 64, dtype=BF16)[:, :H],
        shared_output=_t(M, H + 16, dtype=BF16)[:, :H],
    ),
    "fp8-padded-rows": inputs(
        hidden_dtype=FP8_DTYPE, hidden_states=_t(M, H + 16, dtype=FP8_DTYPE)[:, :H]
    ),
    "no-tokens": inputs(
        hidden_states=_t(0, H, dtype=BF16),
        topk_weights=_t(0, K),
        topk_ids=_t(0, K, dtype=torch.int32),
        out=_t(0, H, dtype=BF16),
    ),
    "max-topk": inputs(
        topk_weights=_t(M, 16),
        topk_ids=_t(M, 16, dtype=torch.int32),
        workspace=workspace(topk=16),
    ),
}


@needs_op
@pytest.mark.parametrize("args", VALID_CASES.values(), ids=VALID_CASES.keys())
def test_valid_inputs_reach_the_op(args: dict) -> None:
    """The arguments pass validation; on the meta device the op dispatches
    to its fake implementation."""
    call(args)


def test_valid_inputs_need_the_library(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the library, a valid call gets past validation and stops with
    a RuntimeError that says so."""
    monkeypatch.setattr(hpc_ops, "_C", hpc_ops._MissingLibrary())
    with pytest.raises(RuntimeError, match=r"vllm\._hpc_C is not built or failed"):
        call(inputs())


BAD_CASES = {
    # Tensors and dtypes.
    "hidden-not-tensor": (inputs(hidden_states=[[0.0] * H] * M), "hidden_states must"),
    "hidden-dtype": (inputs(hidden_states=_t(M, H)), "hidden_states has dtype"),
    "hidden-ndim": (
        inputs(hidden_states=_t(1, M, H, dtype=BF16)),
        "hidden_states must be 2-D",
    ),
    "hidden-width": (
        inputs(hidden_states=_t(M, H - 128, dtype=BF16)),
        "hidden_states shape",
    ),
    "w13-dtype": (inputs(w13=_t(E, 2 * N, H, dtype=BF16)), "w13 has dtype"),
    "w2-dtype": (inputs(w2=_t(E, H, N, dtype=torch.int8)), "w2 has dtype"),
    "w13-ndim": (inputs(w13=_t(2 * N, H, dtype=FP8_DTYPE)), "w13 must be 3-D"),
    "w2-ndim": (inputs(w2=_t(E, H * N, dtype=FP8_DTYPE)), "w2 must be 3-D"),
    "w13-odd-rows": (
        inputs(w13=_t(E, 2 * N + 1, H, dtype=FP8_DTYPE)),
        r"w13.shape\[1\]",
    ),
    "w2-experts": (inputs(w2=_t(E + 1, H, N, dtype=FP8_DTYPE)), "w2 shape"),
    "w2-inter": (inputs(w2=_t(E, H, N // 2, dtype=FP8_DTYPE)), "w2 shape"),
    "w2-hidden": (inputs(w2=_t(E, H // 2, N, dtype=FP8_DTYPE)), "w2 shape"),
    "no-experts": (
        inputs(
            w13=_t(0, 2 * N, H, dtype=FP8_DTYPE),
            w2=_t(0, H, N, dtype=FP8_DTYPE),
            w13_scale=_t(0),
            w2_scale=_t(0),
        ),
        "w13 has no experts",
    ),
    "w13-not-contiguous": (
        inputs(w13=_t(E, H, 2 * N, dtype=FP8_DTYPE).transpose(1, 2)),
        "w13 must be contiguous",
    ),
    "w2-not-contiguous": (
        inputs(w2=_t(E, N, H, dtype=FP8_DTYPE).transpose(1, 2)),
        "w2 must be contiguous",
    ),
    # Sizes.
    "hidden-size": (
        inputs(
            hidden_states=_t(M, 192, dtype=BF16),
            out=_t(M, 192, dtype=BF16),
            w13=_t(E, 2 * N, 192, dtype=FP8_DTYPE),
            w2=_t(E, 192, N, dtype=FP8_DTYPE),
        ),
        "hidden_size is 192",
    ),
    "inter-size": (
        inputs(w13=_t(E, 2 * 96, H, dtype=FP8_DTYPE), w2=_t(E, H, 96, dtype=FP8_DTYPE)),
        "intermediate_size is 96",
    ),
    "inter-size-block": (
        inputs(
            block=True,
            w13=_t(E, 2 * 192, H, dtype=FP8_DTYPE),
            w2=_t(E, H, 192, dtype=FP8_DTYPE),
        ),
        r"intermediate_size is 192; accepted \(block-wise\)",
    ),
    # Routing.
    "topk-too-large": (
        inputs(
            topk_weights=_t(M, 17),
            topk_ids=_t(M, 17, dtype=torch.int32),
            workspace=workspace(topk=17),
        ),
        r"topk \(topk_ids.shape\[1\]\) is 17",
    ),
    "topk-zero": (
        inputs(topk_weights=_t(M, 0), topk_ids=_t(M, 0, dtype=torch.int32)),
        r"topk \(topk_ids.shape\[1\]\) is 0",
    ),
    "topk-ids-dtype": (inputs(topk_ids=_t(M, K)), "topk_ids has dtype"),
    "topk-ids-ndim": (
        inputs(topk_ids=_t(M * K, dtype=torch.int32)),
        "topk_ids must be 2-D",
    ),
    "topk-ids-rows": (
        inputs(topk_ids=_t(M + 1, K, dtype=torch.int32)),
        "topk_ids shape",
    ),
    "topk-ids-not-contiguous": (
        inputs(topk_ids=_t(K, M, dtype=torch.int32).T),
        "topk_ids must be contiguous",
    ),
    "topk-weights-dtype": (
        inputs(topk_weights=_t(M, K, dtype=BF16)),
        "topk_weights has dtype",
    ),
    "topk-weights-shape": (inputs(topk_weights=_t(M, K + 1)), "topk_weights shape"),
    "topk-weights-not-contiguous": (
        inputs(topk_weights=_t(K, M).T),
        "topk_weights must be contiguous",
    ),
    "weight-on-input-topk": (
        inputs(apply_router_weight_on_input=True),
        "apply_router_weight_on_input",
    ),
    # Output and shared output.
    "out-dtype": (inputs(out=_t(M, H)), "out has dtype"),
    "out-fp8": (inputs(out=_t(M, H, dtype=FP8_DTYPE)), "out has dtype"),
    "out-shape": (inputs(out=_t(M + 1, H, dtype=BF16)), "out shape"),
    "out-ndim": (inputs(out=_t(M, 2, H // 2, dtype=BF16)), "out must be 2-D"),
    "out-row-stride": (
        inputs(out=_t(M, H + 4, dtype=BF16)[:, :H]),
        r"out.stride\(0\)",
    ),
    "out-overlapping-rows": (
        inputs(out=_t(M * H // 2 + H, dtype=BF16).as_strided((M, H), (H // 2, 1))),
        r"out.stride\(0\)",
    ),
    "out-column-stride": (
        inputs(out=_t(H, M, dtype=BF16).T),
        "out must have a unit stride",
    ),
    "hidden-row-stride": (
        inputs(hidden_states=_t(M, H + 4, dtype=BF16)[:, :H]),
        r"hidden_states.stride\(0\)",
    ),
    "fp8-hidden-row-stride": (
        inputs(
            hidden_dtype=FP8_DTYPE,
            hidden_states=_t(M, H + 8, dtype=FP8_DTYPE)[:, :H],
        ),
        r"hidden_states.stride\(0\)",
    ),
    "shared-dtype": (
        inputs(shared_output=_t(M, H, dtype=torch.float16)),
        "shared_output dtype",
    ),
    "shared-shape": (
        inputs(shared_output=_t(M, H // 2, dtype=BF16)),
        "shared_output shape",
    ),
    "shared-row-stride": (
        inputs(shared_output=_t(M, H + 2, dtype=BF16)[:, :H]),
        r"shared_output.stride\(0\)",
    ),
    "shared-not-tensor": (inputs(shared_output=1.0), "shared_output must be"),
    # Quantization mode and scales.
    "block-shape": (inputs(block=True, block_shape=(64, 64)), "block_shape"),
    "block-shape-junk": (inputs(block=True, block_shape="128"), "block_shape"),
    "w13-scale-shape": (inputs(w13_scale=_t(E, 2)), "w13_scale shape"),
    "w13-scale-dtype": (inputs(w13_scale=_t(E, dtype=BF16)), "w13_scale has dtype"),
    "w2-scale-shape": (inputs(w2_scale=_t(E + 1)), "w2_scale shape"),
    "w13-scale-block-shape": (
        inputs(block=True, w13_scale=_t(E, 2 * N // BLOCK, H // 64)),
        "w13_scale shape",
    ),
    "w2-scale-block-shape": (
        inputs(block=True, w2_scale=_t(E, H // BLOCK, 2 * N // BLOCK)),
        "w2_scale shape",
    ),
    "w2-scale-block-on-tensor": (
        inputs(w2_scale=_t(E, H // BLOCK, N // BLOCK)),
        "w2_scale shape",
    ),
    "w13-scale-not-contiguous": (
        inputs(block=True, w13_scale=_t(E, H // BLOCK, 2 * N // BLOCK).transpose(1, 2)),
        "w13_scale must be contiguous",
    ),
    "a1-missing-fp8": (
        inputs(hidden_dtype=FP8_DTYPE, a1_scale=None),
        "a1_scale is required",
    ),
    "a1-missing-fp8-block": (
        inputs(block=True, hidden_dtype=FP8_DTYPE, a1_scale=None),
        "a1_scale is required",
    ),
    "a1-block-shape": (
        inputs(block=True, hidden_dtype=FP8_DTYPE, a1_scale=_t(M, H // 64)),
        "a1_scale shape",
    ),
    "a1-block-dtype": (
        inputs(
            block=True, hidden_dtype=FP8_DTYPE, a1_scale=_t(M, H // BLOCK, dtype=BF16)
        ),
        "a1_scale has dtype",
    ),
    "a1-on-16-bit-block": (
        inputs(block=True, a1_scale=_t(M, H // BLOCK)),
        "a1_scale must be None",
    ),
    "a1-numel": (inputs(a1_scale=_t(2)), "a1_scale must be a float32 tensor"),
    "a1-dtype": (
        inputs(a1_scale=_t(dtype=torch.float16)),
        "a1_scale must be a float32 tensor",
    ),
    "a1-2d": (inputs(a1_scale=_t(1, 1)), "a1_scale must be a float32 tensor"),
    "a1-not-tensor": (inputs(a1_scale=0.5), "a1_scale must be a torch.Tensor"),
    "a2-missing": (inputs(a2_scale=None), "a2_scale is required"),
    "a2-on-block": (inputs(block=True, a2_scale=_t()), "a2_scale must be None"),
    "a2-numel": (inputs(a2_scale=_t(E)), "a2_scale must be a float32 tensor"),
    # Expert placement.
    "expert-map-dtype": (
        inputs(expert_map=_t(16, dtype=torch.int64)),
        "expert_map has dtype",
    ),
    "expert-map-ndim": (
        inputs(expert_map=_t(4, 4, dtype=torch.int32)),
        "expert_map must be 1-D",
    ),
    "expert-map-not-contiguous": (
        inputs(expert_map=_t(32, dtype=torch.int32)[::2]),
        "expert_map must be contiguous",
    ),
    "expert-map-with-offset": (
        inputs(expert_map=_t(16, dtype=torch.int32), expert_offset=4),
        "expert_offset",
    ),
    "negative-offset": (inputs(expert_offset=-1), "expert_offset"),
    # Workspace.
    "workspace-type": (inputs(workspace=torch.empty(8)), "workspace must be"),
    "workspace-buffer-not-a-tensor": (
        inputs(workspace=workspace(buffer=[0] * 64)),
        "workspace.buffer must be a torch.Tensor",
    ),
    "workspace-buffer-2d": (
        inputs(workspace=workspace(buffer=_t(8, 8, dtype=torch.uint8))),
        "workspace.buffer must be 1-D",
    ),
    "workspace-tokens": (
        inputs(workspace=workspace(max_tokens=M - 1)),
        "workspace was sized",
    ),
    "workspace-topk": (inputs(workspace=workspace(topk=K + 1)), "workspace was sized"),
    "workspace-experts": (
        inputs(workspace=workspace(num_local_experts=E * 2)),
        "workspace was sized",
    ),
    "workspace-hidden": (
        inputs(workspace=workspace(hidden_size=2 * H)),
        "workspace was sized",
    ),
    "workspace-inter": (
        inputs(workspace=workspace(intermediate_size=2 * N)),
        "workspace was sized",
    ),
    "workspace-buffer-dtype": (
        inputs(workspace=workspace(buffer=_t(64, dtype=torch.int32))),
        "workspace.buffer has dtype",
    ),
    # Devices.
    "workspace-on-cpu": (
        inputs(workspace=workspace(device=torch.device("cpu"))),
        "workspace.buffer is on cpu",
    ),
    "topk-ids-on-cpu": (
        inputs(topk_ids=torch.empty(M, K, dtype=torch.int32)),
        "topk_ids is on cpu",
    ),
    "w2-scale-on-cpu": (inputs(w2_scale=torch.empty(E)), "w2_scale is on cpu"),
    "a2-on-cpu": (inputs(a2_scale=torch.empty(())), "a2_scale is on cpu"),
    "expert-map-on-cpu": (
        inputs(expert_map=torch.empty(16, dtype=torch.int32)),
        "expert_map is on cpu",
    ),
    "shared-on-cpu": (
        inputs(shared_output=torch.empty(M, H, dtype=BF16)),
        "shared_output is on cpu",
    ),
    "fewer-global-than-local-experts": (
        inputs(global_num_experts=E - 1),
        "global_num_experts",
    ),
}


@pytest.mark.parametrize(("args", "match"), BAD_CASES.values(), ids=BAD_CASES.keys())
def test_moe_validation(args: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call(args)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"num_local_experts": 0}, "num_local_experts"),
        ({"topk": 0}, "topk is 0"),
        ({"topk": 17}, "topk is 17"),
        ({"hidden_size": 200}, "hidden_size is 200"),
        ({"hidden_size": 0}, "hidden_size is 0"),
        ({"intermediate_size": 100}, "intermediate_size is 100"),
        ({"intermediate_size": 0}, "intermediate_size is 0"),
    ],
)
def test_workspace_size_validation(kwargs: dict, match: str) -> None:
    args = {
        "max_tokens": 256,
        "topk": 8,
        "num_local_experts": 16,
        "hidden_size": 2048,
        "intermediate_size": 768,
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        validation.validate_moe_workspace(**args)


def test_public_names() -> None:
    for name in (
        "MoeTiling",
        "fused_moe_fp8",
        "moe_tiling",
        "moe_workspace_bytes",
        "MOE_BLOCK_SHAPE",
        "MOE_MAX_TOPK",
    ):
        assert name in hpc_ops.__all__
    assert hpc_ops.MOE_BLOCK_SHAPE == (BLOCK, BLOCK)
    assert hpc_ops.MOE_MAX_TOPK == 16


# ---------------------------------------------------------------------------
# Fake implementation and schema (library with the MoE op, no GPU)
# ---------------------------------------------------------------------------


def _op_args(args: dict, ws: SimpleNamespace, block_wise: bool) -> tuple:
    return (
        args["hidden_states"],
        args["a1_scale"],
        args["w13"],
        args["w13_scale"],
        args["w2"],
        args["w2_scale"],
        args["a2_scale"],
        args["topk_weights"],
        args["topk_ids"],
        args.get("expert_map"),
        args.get("shared_output"),
        args["out"],
        ws.buffer,
        0,
        args["w13"].shape[0],
        block_wise,
        False,
    )


def _fake_inputs(block: bool, hidden_dtype: torch.dtype) -> dict:
    """Valid arguments as fake CUDA tensors (call inside FakeTensorMode)."""
    meta = inputs(block=block, hidden_dtype=hidden_dtype)
    fake = {}
    for name, value in meta.items():
        if isinstance(value, torch.Tensor):
            value = torch.empty(value.shape, dtype=value.dtype, device="cuda")
        fake[name] = value
    fake["shared_output"] = torch.empty(M, H, dtype=BF16, device="cuda")
    fake["expert_map"] = torch.empty(3 * E, dtype=torch.int32, device="cuda")
    return fake


@needs_op
@pytest.mark.parametrize(
    ("block", "hidden_dtype"),
    [(False, BF16), (False, FP8_DTYPE), (True, BF16), (True, FP8_DTYPE)],
    ids=["tensor-bf16", "tensor-fp8", "block-bf16", "block-fp8"],
)
def test_fake_implementation(block: bool, hidden_dtype: torch.dtype) -> None:
    """Under FakeTensorMode (fake CUDA tensors, no GPU needed) the workspace
    is sized by the library and both the op and the public wrapper run the
    fake: no kernel, no error, outputs keep their metadata."""
    with FakeTensorMode():
        args = _fake_inputs(block, hidden_dtype)
        ws = moe_workspace(
            max_tokens=M,
            topk=K,
            num_local_experts=E,
            hidden_size=H,
            intermediate_size=N,
            device="cuda",
        )
        assert ws.buffer.dtype == torch.uint8 and ws.buffer.device.type == "cuda"
        assert ws.buffer.numel() == torch.ops._hpc_C.moe_workspace_bytes(M, K, E, H, N)
        args["workspace"] = ws
        assert torch.ops._hpc_C.fused_moe_fp8(*_op_args(args, ws, block)) is None
        call(args)
        out = args["out"]
        assert out.shape == (M, H) and out.dtype == BF16


@needs_op
def test_fake_under_make_fx() -> None:
    """The public wrapper traces to one fused_moe_fp8 node."""
    from torch.fx.experimental.proxy_tensor import make_fx

    args = inputs(
        block=True, hidden_dtype=FP8_DTYPE, shared_output=_t(M, H, dtype=BF16)
    )
    ws = args.pop("workspace")
    names = [k for k, v in args.items() if isinstance(v, torch.Tensor)]

    def fn(*tensors: torch.Tensor) -> None:
        *values, buffer = tensors
        named = dict(zip(names, values, strict=True))
        call({**args, **named, "workspace": workspace(buffer=buffer)})

    graph = make_fx(fn, tracing_mode="fake")(*(args[n] for n in names), ws.buffer)
    targets = [str(node.target) for node in graph.graph.nodes]
    assert sum("fused_moe_fp8" in t for t in targets) == 1, targets


@needs_op
def test_schema_marks_mutated_arguments() -> None:
    schema = torch.ops._hpc_C.fused_moe_fp8.default._schema
    mutated = {
        a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write
    }
    assert mutated == {"out", "workspace"}, schema
    names = [a.name for a in schema.arguments]
    assert names == [
        "hidden_states",
        "a1_scale",
        "w13",
        "w13_scale",
        "w2",
        "w2_scale",
        "a2_scale",
        "topk_weights",
        "topk_ids",
        "expert_map",
        "shared_output",
        "out",
        "workspace",
        "expert_offset",
        "global_num_experts",
        "block_wise",
        "apply_router_weight_on_input",
    ], schema


@needs_op
def test_workspace_bytes_grow_with_the_problem() -> None:
    size = torch.ops._hpc_C.moe_workspace_bytes
    base = size(64, 8, 16, 2048, 768)
    assert base > 0
    assert size(128, 8, 16, 2048, 768) > base
    assert size(64, 8, 16, 4096, 768) > base
    assert size(64, 8, 16, 2048, 1536) > base
    assert size(64, 1, 16, 2048, 768) < base
    # The largest token count of the GPU tests fits comfortably.
    assert size(4096, 8, 192, 4096, 1536) < 1 << 31


# ---------------------------------------------------------------------------
# Tiling (moe_tiling.h, evaluated on the host)
# ---------------------------------------------------------------------------

H200_SMS = 132
# W3 of DESIGN.md: (local experts, experts, top-k, hidden, intermediate).
W3_CONFIGS = {
    "tp8": (192, 192, 8, 4096, 192),
    "ep8": (24, 192, 8, 4096, 1536),
    "tp1": (192, 192, 8, 4096, 1536),
}
W3_TOKENS = (1, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)


def _tile_count(counts: torch.Tensor, tile: int) -> int:
    return int(((counts + tile - 1) // tile).sum())


def _routed_counts(
    tokens: int, topk: int, local: int, experts: int, routing: str, seed: int
) -> torch.Tensor:
    """Rows per local expert for one routing draw (distinct experts per token)."""
    gen = torch.Generator().manual_seed(seed)
    if routing == "uniform":
        ids = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :topk]
    elif routing == "skewed":
        # The same top-k experts for every token: the worst case per expert.
        ids = torch.arange(topk).expand(tokens, topk)
    else:  # each token's experts in a window that walks over all of them
        ids = (torch.arange(tokens)[:, None] * topk + torch.arange(topk)) % experts
    ids = ids.flatten()
    ids = ids[ids < local]
    return torch.bincount(ids, minlength=local)


@needs_op
@pytest.mark.parametrize("config", sorted(W3_CONFIGS))
@pytest.mark.parametrize("routing", ["uniform", "skewed", "strided"])
def test_tiling_covers_every_routing(config: str, routing: str) -> None:
    """The launch's tile bound holds every token tile the route can make."""
    local, experts, topk, hidden, inter = W3_CONFIGS[config]
    for tokens in W3_TOKENS:
        t = hpc_ops.moe_tiling(tokens, topk, local, experts, hidden, inter, H200_SMS)
        counts = _routed_counts(tokens, topk, local, experts, routing, seed=tokens)
        assert _tile_count(counts, t.token_tile) <= t.max_tiles, (tokens, t)


@needs_op
@pytest.mark.parametrize("config", sorted(W3_CONFIGS))
@pytest.mark.parametrize("sms", [1, 78, H200_SMS, 256])
@pytest.mark.parametrize("block_wise", [False, True])
def test_tiling_invariants(config: str, sms: int, block_wise: bool) -> None:
    local, experts, topk, hidden, inter = W3_CONFIGS[config]
    if block_wise:  # 128 x 128 weight blocks: tp8 block-wise runs I = 256
        inter = math.ceil(inter / 128) * 128
    last_tile = 0
    for tokens in (*W3_TOKENS, 3, 257, 16384, 32768, 131072):
        t = hpc_ops.moe_tiling(
            tokens, topk, local, experts, hidden, inter, sms, block_wise
        )
        # Block-wise scaling keeps a second accumulator: 64 tokens at most.
        widths = (8, 16, 32, 64) if block_wise else (8, 16, 32, 64, 96, 128)
        assert t.token_tile in widths
        if tokens in W3_TOKENS:  # ascending
            assert t.token_tile >= last_tile
            last_tile = t.token_tile
        # Gate-up warpgroups of 192 rows: 96-token tiles, per-tensor, an
        # intermediate of whole 192-column blocks, one block a CTA.
        assert t.gate_up_rows in (128, 192)
        if t.gate_up_rows == 192:
            assert t.token_tile == 96 and not block_wise and inter % 192 == 0
            assert t.gate_up_group == 1 and t.gate_up_split == 1
            assert t.max_tiles * t.gate_up_blocks >= 2 * sms
        assert t.gate_up_blocks == math.ceil(inter / t.gate_up_rows)
        assert t.down_blocks == math.ceil(hidden / 256)
        # Down CTAs take whole groups of row blocks, none of them empty.
        assert 1 <= t.down_group <= t.down_blocks
        groups = math.ceil(t.down_blocks / t.down_group)
        assert (groups - 1) * t.down_group < t.down_blocks
        # A group grows while its CTA streams under 8 k-blocks, and up to 24
        # while the CTAs run many waves.
        if t.down_group > 1:
            assert t.down_group * math.ceil(inter / 128) <= 24
        # Gate-up CTAs take two column blocks at most, never with split K.
        assert t.gate_up_group in (1, 2)
        assert t.gate_up_group == 1 or t.gate_up_split == 1
        # CTAs per SM: two for narrow tiles and per-tensor 32-token ones
        # (and the gate-up GEMM's per-tensor 64-token ones, one column block
        # a CTA), one for wide ones; three only for 8-token tiles, never with
        # split K.
        paired = t.token_tile == 32 and not block_wise
        usual = 2 if t.token_tile <= 16 or paired else 1
        paired_gate_up = t.token_tile == 64 and not block_wise
        assert t.gate_up_ctas_per_sm == (2 if paired_gate_up else usual) or (
            t.token_tile == 8 and t.gate_up_ctas_per_sm == 3
        )
        assert t.down_ctas_per_sm == usual or (
            t.token_tile == 8 and t.down_ctas_per_sm == 3
        )
        if paired_gate_up:
            assert t.gate_up_group == 1
        assert t.gate_up_ctas_per_sm == 2 or t.gate_up_split == 1
        assert t.max_tiles >= 1
        if t.decode:  # a few tokens (and one wave of gate-up CTAs)
            assert tokens <= 16
        # Slot tiles: the grouped path of at most 128 routed slots.
        assert t.slot_tiles == (not t.decode and tokens * topk <= 128)
        # Weights are streamed evict-first by 8-token tiles only.
        assert t.evict_first_weights == (t.token_tile == 8)
        # A split tile's CTAs are one cluster: 8 at most.
        assert 1 <= t.gate_up_split <= 8
        if t.gate_up_split > 1:
            # Only 8-token tiles split (the leader's stage buffers hold the
            # partial sums), and every split keeps two 128-deep k-blocks.
            assert t.token_tile == 8
            assert t.gate_up_split <= hidden // 128 // 2


@needs_op
def test_tiling_long_prompts() -> None:
    """A prefill chunk of 32K tokens and more at TP1: some 1365 rows an
    expert and up, where e^-1365 underflows (the expected-tiles sum starts
    near the mean instead); per-tensor calls take 128-token tiles there."""
    local, experts, topk, hidden, inter = W3_CONFIGS["tp1"]
    for tokens in (20000, 32768, 262144):
        t = hpc_ops.moe_tiling(
            tokens, topk, local, experts, hidden, inter, H200_SMS, False
        )
        assert t.token_tile == 128
        assert t.max_tiles >= math.ceil(tokens * topk / 128)


@needs_op
def test_tiling_w3_choices() -> None:
    """What the H200 gets for the W3 cases the targets name."""

    def tiling(config: str, tokens: int, block_wise: bool = False) -> MoeTiling:
        local, experts, topk, hidden, inter = W3_CONFIGS[config]
        return hpc_ops.moe_tiling(
            tokens, topk, local, experts, hidden, inter, H200_SMS, block_wise
        )

    # 8-token tiles run two CTAs per SM: 264 slots. One token: 8 experts x
    # 2 column blocks would fill 16 of them.
    assert tiling("tp8", 1).token_tile == 8
    assert tiling("tp8", 1).gate_up_split == 8  # the largest cluster
    # Eight tokens: ~64 experts x 2 blocks fill half the slots.
    assert tiling("tp8", 8).gate_up_split == 2
    # Sixty-four tokens touch nearly all 192 experts.
    assert tiling("tp8", 64).gate_up_split == 1
    # One token on 24 local experts of 192 lands on about one of them; with
    # the margin below, room for three: 36 CTAs of 12 column blocks, split 7.
    assert tiling("ep8", 1).gate_up_split == 7
    assert tiling("tp1", 1).gate_up_split == 2  # 8 experts x 12 blocks
    # An EP rank's hit experts vary from batch to batch; the split leaves
    # room for 1.5 standard deviations more than expected. Four tokens are
    # expected on 3.7 of the 24 local experts (12 column blocks each): room
    # for 7, split 3 (252 CTAs); eight tokens on 6.8: room for 11, split 2.
    assert tiling("ep8", 4).gate_up_split == 3
    assert tiling("ep8", 8).gate_up_split == 2
    # 8-token tiles run three CTAs per SM (396 slots) in a gate-up GEMM
    # whose CTAs then make fewer waves (tp8 with 64 tokens: ~179 experts x
    # 2 column blocks, one wave instead of two), and in a down GEMM with
    # more CTAs than the 264 slots before grouping (~179 tiles x 16 row
    # blocks; at 8 tokens ~55 x 16). Fewer keep two (tp1 with one token: 8
    # tiles x 16 row blocks; a split gate-up).
    assert tiling("tp8", 64).gate_up_ctas_per_sm == 3
    assert tiling("tp8", 64).down_ctas_per_sm == 3
    assert tiling("ep8", 64).gate_up_ctas_per_sm == 3
    assert tiling("tp8", 8).gate_up_ctas_per_sm == 2
    assert tiling("tp8", 8).down_ctas_per_sm == 3
    assert tiling("tp1", 1).gate_up_ctas_per_sm == 2
    assert tiling("tp1", 1).down_ctas_per_sm == 2
    assert tiling("tp8", 256).gate_up_ctas_per_sm == 2  # 16-token tiles
    # 128 tokens: 5.3 rows per expert, so ~7% of them take a second tile:
    # ~410 gate-up CTAs, two waves either way, so two per SM (a last wave
    # of 3-stage CTAs, not of 2-stage ones).
    assert tiling("tp8", 128).gate_up_ctas_per_sm == 2
    assert tiling("tp8", 128).down_ctas_per_sm == 3
    assert tiling("tp1", 4096).down_ctas_per_sm == 1  # 96-token tiles
    # 32-token tiles: two CTAs per SM for per-tensor scales, one block-wise.
    assert tiling("tp8", 512).gate_up_ctas_per_sm == 2
    assert tiling("ep8", 512).down_ctas_per_sm == 2
    assert tiling("tp8", 512, block_wise=True).gate_up_ctas_per_sm == 1
    # 64-token tiles: the gate-up GEMM two CTAs per SM for per-tensor
    # scales, the down GEMM one (tp8: two k-blocks a row block).
    assert tiling("tp8", 1024).gate_up_ctas_per_sm == 2
    assert tiling("tp8", 1024).down_ctas_per_sm == 1
    assert tiling("tp8", 1024, block_wise=True).gate_up_ctas_per_sm == 1
    # Up to 16 tokens (128 slots) the grouped path runs without the route.
    assert tiling("tp1", 1).slot_tiles and tiling("tp8", 16).slot_tiles
    assert not tiling("tp8", 32).slot_tiles
    assert not tiling("tp8", 1).slot_tiles  # the decode path
    # Down CTAs (I = 192: two k-blocks per row block): one 256-row block
    # each while the tiles are few; more, up to 8 k-blocks a CTA, while the
    # CTAs still fill the slots. I = 1536 is long enough alone.
    assert tiling("tp8", 1).down_group == 1  # 8 tiles x 16 blocks
    assert tiling("tp8", 8).down_group == 2  # ~64 tiles x 8 groups
    assert tiling("tp8", 64).down_group == 4  # ~192 tiles x 4 groups
    assert tiling("tp1", 256).down_group == 1
    # Many waves of down CTAs (23 at tp1 with 4096 tokens: 384 tiles x 8
    # groups over 132 slots): two 12-k-block row blocks a CTA. Not below 8
    # waves (tp8 with 1024 tokens: 192 tiles x 2 groups of 8 would be 2.9).
    assert tiling("tp1", 4096).down_group == 2
    assert tiling("tp1", 1024).down_group == 2
    assert tiling("tp8", 1024).down_group == 4
    assert tiling("ep8", 4096).down_group == 1
    # Gate-up CTAs take two column blocks at 8 waves or more: tp1 block-wise
    # with 512 and 1024 tokens (192 tiles x 6 pairs of 12 blocks over 132
    # slots); per-tensor ones have twice the slots (paired 32-token CTAs),
    # and paired 64-token CTAs take one block each.
    assert tiling("tp1", 1024, block_wise=True).gate_up_group == 2
    assert tiling("tp1", 512, block_wise=True).gate_up_group == 2
    assert tiling("tp1", 1024).gate_up_group == 1
    assert tiling("tp1", 512).gate_up_group == 1
    assert tiling("tp1", 256).gate_up_group == 1
    # 96-token tiles per-tensor take 192-row gate-up warpgroups where the
    # intermediate is whole 192-column blocks: tp8's one block (not one and
    # a half-empty one), tp1's eight; a block a CTA.
    for config, blocks in (("tp8", 1), ("tp1", 8), ("ep8", 8)):
        t = tiling(config, 4096)
        assert (t.gate_up_rows, t.gate_up_blocks, t.gate_up_group) == (192, blocks, 1)
    assert tiling("tp1", 1024).gate_up_rows == 128  # 64-token tiles
    # Not where the wide CTAs would make fewer than two waves: tp8 at 2048
    # tokens has 192 of them (one tile an expert) for 132 SMs.
    assert tiling("tp8", 2048).gate_up_rows == 128
    assert tiling("tp1", 2048).gate_up_rows == 192  # 192 x 8 CTAs
    assert tiling("tp1", 1).gate_up_group == 1  # split K
    # Tokens per expert grow with the batch: 256 x 8 / 192 = 11 -> 16.
    assert tiling("tp1", 256).token_tile == 16
    # 4096 x 8 / 192 = 171 rows per expert: two 96-token tiles per-tensor
    # (192 columns, where two 128-token tiles take 256), 64 block-wise.
    # 2048 tokens: 85 rows, one 96-token tile; from ~100 rows one 128-token
    # tile costs less than two of 96.
    assert tiling("tp1", 4096).token_tile == 96
    assert tiling("tp8", 4096).token_tile == 96
    assert tiling("tp1", 2048).token_tile == 96
    assert tiling("tp1", 2600).token_tile == 128
    assert tiling("tp1", 16384).token_tile == 128
    assert tiling("tp1", 4096, block_wise=True).token_tile == 64
    assert tiling("tp1", 1024).token_tile == 64
    # The decode path: one token at TP8 (8 experts x 24 chunks of 8 columns
    # fill 192 of 264 CTA slots) and on an EP rank; not at TP1 (8 x 192
    # chunks) nor from four tokens at TP8 (~29 experts).
    assert tiling("tp8", 1).decode and tiling("ep8", 1).decode
    assert not tiling("tp1", 1).decode and not tiling("tp8", 4).decode


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_tokens=0), "num_tokens"),
        (dict(num_sms=0), "num_sms"),
        (dict(num_experts=4), "num_experts"),
        (dict(topk=0), "topk"),
        (dict(hidden_size=200), "hidden_size"),
        (dict(intermediate_size=192, block_wise=True), "intermediate_size"),
    ],
)
def test_tiling_validation(kwargs: dict, match: str) -> None:
    args = dict(
        num_tokens=4,
        topk=2,
        num_local_experts=8,
        num_experts=8,
        hidden_size=256,
        intermediate_size=128,
        num_sms=132,
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        validation.validate_moe_tiling(**args)


# ---------------------------------------------------------------------------
# The reference itself
# ---------------------------------------------------------------------------


def _hand_weights() -> MoeWeights:
    """One local expert, H = 2, I = 1: gate reads x0, up reads x1, and the
    down projection is (2, -1) at scale 0.5."""
    w13 = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]]).to(FP8_DTYPE)
    w2 = torch.tensor([[[2.0], [-1.0]]]).to(FP8_DTYPE)
    return MoeWeights(
        w13=w13,
        w13_scale=torch.tensor([1.0]),
        w2=w2,
        w2_scale=torch.tensor([0.5]),
        block_wise=False,
    )


def _hand_inputs(**changes) -> MoeInputs:
    """Two tokens, x = (2, 3) and (1, 1), both FP8 at scale 1; global
    experts 0..2 with only expert 1 on this rank (slot 0)."""
    fields = dict(
        weights=_hand_weights(),
        hidden_states=torch.tensor([[2.0, 3.0], [1.0, 1.0]]).to(FP8_DTYPE),
        topk_weights=torch.tensor([[0.5, 0.25], [0.75, 0.25]]),
        topk_ids=torch.tensor([[1, 0], [2, 0]], dtype=torch.int32),
        out=torch.empty(2, 2, dtype=BF16),
        a1_scale=torch.tensor(1.0),
        a2_scale=torch.tensor(1.0),
        expert_map=torch.tensor([-1, 0, -1], dtype=torch.int32),
        expert_offset=0,
        shared_output=None,
        apply_router_weight_on_input=False,
        num_global_experts=3,
    )
    fields.update(changes)
    return MoeInputs(**fields)


# Token 0: g = 2, u = 3, h = silu(2) * 3 = 5.2848 -> E4M3 5.5 (steps of 0.5
# in [4, 8)); y = (2, -1) * 0.5 * 5.5 = (5.5, -2.75); weight 0.5.
HAND_Y = [5.5, -2.75]


def test_reference_hand_case() -> None:
    h = 2.0 / (1.0 + math.exp(-2.0)) * 3.0
    assert 5.25 < h < 5.5  # nearer 5.5 than 5.0
    ref = _hand_inputs().reference()
    assert ref.tolist() == [[0.5 * v for v in HAND_Y], [0.0, 0.0]]


def test_reference_hand_case_variants() -> None:
    # The same placement through expert_offset: id 1 -> slot 0; ids 0 and
    # 2 fall outside [0, 1).
    ref = _hand_inputs(expert_map=None, expert_offset=1).reference()
    assert ref.tolist() == [[2.75, -1.375], [0.0, 0.0]]
    # Shared output is added, also to the token with no local expert.
    shared = torch.tensor([[1.0, 1.0], [-2.0, 4.0]], dtype=BF16)
    ref = _hand_inputs(shared_output=shared).reference()
    assert ref.tolist() == [[3.75, -0.375], [-2.0, 4.0]]
    # The router weight was applied to the input: the reference uses 1.
    ref = _hand_inputs(
        topk_weights=torch.tensor([[0.5], [0.75]]),
        topk_ids=torch.tensor([[1], [0]], dtype=torch.int32),
        apply_router_weight_on_input=True,
    ).reference()
    assert ref.tolist() == [HAND_Y, [0.0, 0.0]]
    # 16-bit input with a static scale of 1: 2 and 3 are exact in E4M3.
    ref = _hand_inputs(
        hidden_states=torch.tensor([[2.0, 3.0], [1.0, 1.0]], dtype=BF16)
    ).reference()
    assert ref.tolist() == [[2.75, -1.375], [0.0, 0.0]]
    # Per-token dynamic: scale 3 / 448 for token 0 maps 3 to 448 and 2 to
    # 298.67 -> 288 (steps of 32 in [256, 448]), so g = 288 * 3 / 448.
    ref = _hand_inputs(
        hidden_states=torch.tensor([[2.0, 3.0], [1.0, 1.0]], dtype=BF16),
        a1_scale=None,
    ).reference()
    scale = torch.tensor(3.0 / 448.0, dtype=torch.float32).item()
    g = 288.0 * scale
    h = g / (1.0 + math.exp(-g)) * 3.0
    assert 5.0 < h < 5.25  # rounds to 5.0
    assert ref.tolist() == [[2.5, -1.25], [0.0, 0.0]]


def _f32(v: float) -> float:
    """``v`` rounded to the nearest float32."""
    return struct.unpack("f", struct.pack("f", v))[0]


def _e4m3(v: float) -> float:
    """``v`` saturated to +-448 and rounded to the nearest E4M3 value, ties
    to even (3 mantissa bits, exponents down to -6, subnormal steps of
    2^-9)."""
    v = max(-FP8_MAX, min(FP8_MAX, v))
    if v == 0.0:
        return 0.0
    _, e = math.frexp(abs(v))  # abs(v) = m * 2^e, 0.5 <= m < 1
    step = 2.0 ** (max(e - 1, -6) - 3)
    return math.copysign(min(round(abs(v) / step) * step, FP8_MAX), v)


def _quant(v: float, scale: float) -> float:
    """The dequantized E4M3 value of float32 ``v / scale``."""
    return _e4m3(_f32(v / scale)) * scale


def _dynamic_scale(values: list[float]) -> float:
    amax = max(abs(v) for v in values)
    return _f32(amax / FP8_MAX) if amax > 0 else 1.0


def _loop_moe(inputs: MoeInputs) -> list[list[float]]:
    """The contract, element by element in Python floats, sharing no code
    with the reference."""
    wts = inputs.weights
    block = wts.block_wise
    num_experts, hidden, inter = wts.num_experts, wts.hidden_size, wts.intermediate_size
    hs = inputs.hidden_states.float().tolist()
    fp8_in = inputs.hidden_states.dtype == FP8_DTYPE
    a1 = None if inputs.a1_scale is None else inputs.a1_scale.tolist()
    a2 = None if inputs.a2_scale is None else inputs.a2_scale.reshape(()).item()

    x = []
    for t, row in enumerate(hs):
        if fp8_in and block:
            assert a1 is not None
            x.append([row[c] * a1[t][c // BLOCK] for c in range(hidden)])
        elif fp8_in:
            assert inputs.a1_scale is not None
            s = inputs.a1_scale.reshape(()).item()
            x.append([v * s for v in row])
        elif block:
            xr = []
            for c0 in range(0, hidden, BLOCK):
                s = _dynamic_scale(row[c0 : c0 + BLOCK])
                xr += [_quant(v, s) for v in row[c0 : c0 + BLOCK]]
            x.append(xr)
        else:
            a1_scale = inputs.a1_scale
            s = a1_scale.reshape(()).item() if a1_scale is not None else None
            s = _dynamic_scale(row) if s is None else s
            x.append([_quant(v, s) for v in row])

    w13, w2 = wts.w13.float().tolist(), wts.w2.float().tolist()
    s13, s2 = wts.w13_scale.tolist(), wts.w2_scale.tolist()

    def weight(w, s, e: int, r: int, c: int) -> float:
        scale = s[e][r // BLOCK][c // BLOCK] if block else s[e]
        return w[e][r][c] * scale

    ids = inputs.topk_ids.tolist()
    tw = inputs.topk_weights.tolist()
    emap = None if inputs.expert_map is None else inputs.expert_map.tolist()
    out = []
    for t in range(len(hs)):
        acc = [0.0] * hidden
        for j, gid in enumerate(ids[t]):
            e = emap[gid] if emap is not None else gid - inputs.expert_offset
            if not 0 <= e < num_experts:
                continue
            gu = [
                sum(weight(w13, s13, e, r, c) * x[t][c] for c in range(hidden))
                for r in range(2 * inter)
            ]
            h = [
                _f32(g / (1.0 + math.exp(-g)) * u)
                for g, u in zip(gu[:inter], gu[inter:], strict=True)
            ]
            if block:
                hq = []
                for c0 in range(0, inter, BLOCK):
                    s = _dynamic_scale(h[c0 : c0 + BLOCK])
                    hq += [_quant(v, s) for v in h[c0 : c0 + BLOCK]]
            else:
                hq = [_quant(v, a2) for v in h]
            w = 1.0 if inputs.apply_router_weight_on_input else tw[t][j]
            for r in range(hidden):
                y = sum(weight(w2, s2, e, r, c) * hq[c] for c in range(inter))
                acc[r] += w * y
        if inputs.shared_output is not None:
            acc = [
                a + s
                for a, s in zip(
                    acc, inputs.shared_output[t].float().tolist(), strict=True
                )
            ]
        out.append(acc)
    return out


def test_e4m3_rounding_matches_torch() -> None:
    """The loop's own E4M3 rounding agrees with torch's conversion on every
    representable value, the midpoints between them (ties to even), and
    random values, saturation included."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    exact = codes.view(FP8_DTYPE).float()
    exact = exact[torch.isfinite(exact)].unique()
    mids = (exact[1:] + exact[:-1]) / 2
    rand = torch.randn(2000, generator=torch.Generator().manual_seed(3)) * 100
    values = torch.cat([exact, mids, rand, torch.tensor([500.0, -1e6, 1e-9])])
    ours = [_e4m3(v) for v in values.tolist()]
    theirs = values.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float().tolist()
    assert ours == theirs


LOOP_CASES = {
    "tensor-static-bf16-map-shared": dict(block=False, ep="map", shared_output=True),
    "tensor-dynamic-fp16-range": dict(
        block=False,
        hidden_dtype=torch.float16,
        static_a1=False,
        ep="range",
        ids_dtype=torch.int64,
    ),
    "tensor-fp8-skewed": dict(
        block=False, hidden_dtype=FP8_DTYPE, routing="skewed", scalar_shape=(1,)
    ),
    "tensor-weight-on-input": dict(
        block=False, topk=1, apply_router_weight_on_input=True
    ),
    "block-bf16-map": dict(block=True, ep="map"),
    "block-fp8-range-shared": dict(
        block=True, hidden_dtype=FP8_DTYPE, ep="range", shared_output=True
    ),
    "block-single-padded": dict(block=True, routing="single", row_pad=16),
}


@pytest.mark.parametrize("case", LOOP_CASES.values(), ids=LOOP_CASES.keys())
def test_reference_matches_loop(case: dict) -> None:
    """The reference against the element-by-element loop on small random
    inputs (3 local experts; 2 choices per token unless stated)."""
    case = dict(case)
    block = case.pop("block")
    topk = case.pop("topk", 2)
    hidden, inter = (BLOCK, BLOCK) if block else (BLOCK, 64)
    weights = make_moe_weights(3, hidden, inter, block_wise=block, device="cpu")
    inputs = make_moe_inputs(weights, 4, topk, ep_size=2, seed=1, **case)
    ref = inputs.reference()
    loop = torch.tensor(_loop_moe(inputs), dtype=torch.float64)
    assert ref.abs().max() > 0.1
    torch.testing.assert_close(ref, loop, rtol=1e-9, atol=1e-12)


def test_reference_float32() -> None:
    weights = make_moe_weights(3, BLOCK, BLOCK, block_wise=True, device="cpu")
    inputs = make_moe_inputs(weights, 6, 2, seed=2)
    ref64 = inputs.reference()
    ref32 = inputs.reference(dtype=torch.float32)
    assert ref32.dtype == torch.float32
    torch.testing.assert_close(ref32.double(), ref64, rtol=1e-3, atol=1e-4)


# ---------------------------------------------------------------------------
# The builders
# ---------------------------------------------------------------------------


def test_local_slots() -> None:
    ids = torch.tensor([[0, 3], [5, 7]])
    assert local_slots(ids, 4).tolist() == [[0, 3], [-1, -1]]
    assert local_slots(ids, 4, expert_offset=4).tolist() == [[-1, -1], [1, 3]]
    emap = torch.tensor([-1, -1, -1, 2, -1, 0, -1, 1], dtype=torch.int32)
    assert local_slots(ids, 3, expert_map=emap).tolist() == [[-1, 2], [0, 1]]


@pytest.mark.parametrize("routing", ["uniform", "skewed", "single"])
def test_routing(routing: str) -> None:
    gen = torch.Generator().manual_seed(0)
    num_tokens, experts, topk = 512, 32, 4
    weights, ids = make_routing(
        num_tokens,
        experts,
        topk,
        routing=routing,
        ids_dtype=torch.int64,
        gen=gen,
        device=torch.device("cpu"),
    )
    assert ids.dtype == torch.int64 and ids.is_contiguous()
    assert weights.dtype == torch.float32 and weights.shape == (num_tokens, topk)
    assert bool(((ids >= 0) & (ids < experts)).all())
    for row in ids.tolist():
        assert len(set(row)) == topk
    torch.testing.assert_close(weights.sum(-1), torch.ones(num_tokens))
    load = torch.bincount(ids.flatten(), minlength=experts).float()
    mean = num_tokens * topk / experts
    if routing == "uniform":
        assert load.max() < 2 * mean
    elif routing == "skewed":
        assert load.max() > 4 * mean and load.min() < mean / 4
    else:
        assert int((load > 0).sum()) == topk


def test_expert_map_is_scattered() -> None:
    gen = torch.Generator().manual_seed(0)
    emap = make_expert_map(64, 16, gen=gen, device=torch.device("cpu"))
    assert emap.dtype == torch.int32 and emap.shape == (64,)
    local = emap[emap >= 0]
    assert sorted(local.tolist()) == list(range(16))
    assert int((emap == -1).sum()) == 48
    owned = torch.nonzero(emap >= 0).flatten()
    # Not a contiguous range and not in slot order.
    assert int(owned.max() - owned.min()) > 16
    assert local.tolist() != list(range(16))


@pytest.mark.parametrize("block", [False, True], ids=["tensor", "block"])
def test_weight_scales_are_amax_over_448(block: bool) -> None:
    """Each scale maps its block's (or expert's) largest weight to 448, and
    the scales vary across experts (and blocks)."""
    weights = make_moe_weights(3, 2 * BLOCK, BLOCK, block_wise=block, device="cpu")
    for w, s in ((weights.w13, weights.w13_scale), (weights.w2, weights.w2_scale)):
        assert s.dtype == torch.float32 and s.is_contiguous()
        q = w.float().abs()
        if block:
            e, rows, cols = w.shape
            assert s.shape == (e, rows // BLOCK, cols // BLOCK)
            amax = q.reshape(e, rows // BLOCK, BLOCK, cols // BLOCK, BLOCK).amax(
                dim=(2, 4)
            )
        else:
            assert s.shape == (w.shape[0],)
            amax = q.amax(dim=(1, 2))
        assert bool((amax == FP8_MAX).all())
        assert s.max() > 1.2 * s.min()


def test_inputs_layout() -> None:
    weights = make_moe_weights(4, BLOCK, 64, block_wise=False, device="cpu")
    inputs = make_moe_inputs(
        weights, 6, 2, shared_output=True, row_pad=16, ep="map", seed=3
    )
    assert inputs.shared_output is not None
    for t in (inputs.hidden_states, inputs.out, inputs.shared_output):
        assert t.shape == (6, BLOCK) and t.stride() == (BLOCK + 16, 1)
    assert bool(torch.isnan(inputs.out).all())
    assert inputs.a1_scale is not None and inputs.a2_scale is not None
    assert inputs.a1_scale.shape == ()
    assert inputs.a2_scale.item() == pytest.approx(A2_SCALE)
    assert inputs.expert_map is not None
    assert inputs.num_global_experts == 16 and inputs.expert_map.shape == (16,)
    # Some tokens have no local expert with 4 of 16 experts on this rank.
    many = make_moe_inputs(weights, 64, 2, ep="range", seed=3)
    unrouted = many.unrouted()
    assert bool(unrouted.any()) and not bool(unrouted.all())
    assert many.expert_offset == 4
    block = make_moe_weights(2, BLOCK, BLOCK, block_wise=True, device="cpu")
    fp8 = make_moe_inputs(block, 5, 1, hidden_dtype=FP8_DTYPE)
    assert fp8.a1_scale is not None and fp8.a1_scale.shape == (5, 1)
    assert fp8.a2_scale is None
    assert fp8.out.dtype == BF16


def test_check_moe_catches_errors() -> None:
    weights = make_moe_weights(4, BLOCK, 64, block_wise=False, device="cpu")
    inputs = make_moe_inputs(weights, 32, 2, ep="range", shared_output=True, seed=4)
    ref = inputs.reference()
    unrouted = inputs.unrouted()
    assert bool(unrouted.any())
    good = ref.to(BF16)
    check_moe(good, ref, unrouted=unrouted, shared_output=inputs.shared_output)
    bad = good.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(AssertionError, match="NaN"):
        check_moe(bad, ref, unrouted=unrouted, shared_output=inputs.shared_output)
    # A routed row scaled by 1.1 passes the overall bar, not the row bar.
    row = int(torch.nonzero(~unrouted)[0])
    bad = good.clone()
    bad[row] *= 1.1
    with pytest.raises(AssertionError, match=f"token {row}"):
        check_moe(bad, ref, unrouted=unrouted, shared_output=inputs.shared_output)
    # The row bar widens to twice the row's rounding noise, and no further.
    noise = torch.zeros(ref.shape[0])
    for row_noise, passes in ((0.06, True), (0.04, False)):
        noise[row] = row_noise
        with (
            contextlib.nullcontext()
            if passes
            else pytest.raises(AssertionError, match=f"token {row}")
        ):
            check_moe(
                bad,
                ref,
                unrouted=unrouted,
                shared_output=inputs.shared_output,
                rounding_noise=noise,
            )
    # An unrouted row must be exactly the shared output.
    row = int(torch.nonzero(unrouted)[0])
    bad = good.clone()
    bad[row] = bad[row] + 2**-6
    with pytest.raises(AssertionError, match="no local expert"):
        check_moe(
            bad, ref, unrouted=unrouted, shared_output=inputs.shared_output, rtol=1.0
        )


@needs_op
def test_moe_tiling_fields_match_the_dataclass() -> None:
    # The tiling is passed by name: C++'s field list and the Python record
    # must name the same fields, or moe_tiling() fails.
    names = list(torch.ops._hpc_C.moe_tiling_fields())
    assert names == [f.name for f in dataclasses.fields(hpc_ops.MoeTiling)]
    tiling = hpc_ops.moe_tiling(8, 8, 192, 192, 4096, 192, 132)
    assert isinstance(tiling.decode, bool) and isinstance(tiling.token_tile, int)
