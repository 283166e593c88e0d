# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU checks of the decode-attention op layer: argument validation
(``validate_decode_attention`` and the workspace's: every bad input names
itself) and the fake implementations used by torch.compile.
Inputs live on the meta device, so no GPU is needed."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tests.kernels.hpc.utils import (
    cache_argument_cases,
    import_attn_workspace,
    import_hpc_ops,
    import_hpc_validation,
)

if TYPE_CHECKING:
    from vllm.v1.attention.ops.hpc_attn_workspace import DecodeWorkspace

hpc_ops = import_hpc_ops()
validation = import_hpc_validation()
workspaces = import_attn_workspace()

pytestmark = pytest.mark.skipif(
    not hpc_ops.hpc_ops_available(), reason="the _hpc_C library is not built"
)

META = torch.device("meta")
BATCH, HQ, HKV, D, BS, BLOCKS = 4, 16, 2, 128, 16, 64


def workspace(**overrides) -> DecodeWorkspace:
    ws = workspaces.DecodeWorkspace(
        plan_buffer=torch.empty(
            hpc_ops.decode_plan_size(BATCH * HKV, 8), dtype=torch.int32, device=META
        ),
        partial_out=torch.empty(16 * 8 * D, device=META),
        partial_lse=torch.empty(16 * 8, device=META),
        piece_counters=torch.zeros(BATCH * HKV, dtype=torch.int32, device=META),
        max_batch=BATCH,
        num_q_heads=HQ,
        num_kv_heads=HKV,
        head_size=D,
        kv_element_bytes=2,
        max_query_tokens=1,
        num_ctas=8,
        max_ctas=8,
        mode=hpc_ops.SplitMode.BALANCED,
        min_split_tiles=4,
        split_tiles=0,
        window=0,
    )
    return dataclasses.replace(ws, **overrides)


def inputs(kv_dtype: torch.dtype = torch.bfloat16) -> dict:
    q_dtype = torch.bfloat16 if kv_dtype == torch.float8_e4m3fn else kv_dtype
    args = {
        "q": torch.empty(BATCH, HQ, D, dtype=q_dtype, device=META),
        "key_cache": torch.empty(BLOCKS, BS, HKV, D, dtype=kv_dtype, device=META),
        "value_cache": torch.empty(BLOCKS, BS, HKV, D, dtype=kv_dtype, device=META),
        "block_table": torch.empty(BATCH, 16, dtype=torch.int32, device=META),
        "kv_lens": torch.empty(BATCH, dtype=torch.int32, device=META),
        "out": torch.empty(BATCH, HQ, D, dtype=torch.bfloat16, device=META),
        "workspace": workspace(),
        "scale": D**-0.5,
    }
    if kv_dtype == torch.float8_e4m3fn:
        args["k_scale"] = torch.empty(1, device=META)
        args["v_scale"] = torch.empty(1, device=META)
    return args


def call(args: dict) -> None:
    """Validates the arguments, then calls the op."""
    args = dict(args)
    positional = [
        args.pop(k)
        for k in (
            "q",
            "key_cache",
            "value_cache",
            "block_table",
            "kv_lens",
            "out",
            "workspace",
        )
    ]
    validation.validate_decode_attention(*positional, **args)
    hpc_ops.decode_attention(*positional, **args)


def test_valid_inputs_reach_the_op() -> None:
    """The baseline arguments pass validation; on the meta device the op
    dispatches to its fake implementation."""
    for kv_dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        call(inputs(kv_dtype))


def _with(kv_dtype=torch.bfloat16, **changes) -> dict:
    args = inputs(kv_dtype)
    args.update(changes)
    return args


def _cache(shape=(BLOCKS, BS, HKV, D), dtype=torch.bfloat16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device=META)


BAD_CASES = {
    "q-dtype": (_with(q=torch.empty(BATCH, HQ, D, device=META)), "q has dtype"),
    "q-fp8-on-bf16-cache": (
        _with(q=torch.empty(BATCH, HQ, D, dtype=torch.float8_e4m3fn, device=META)),
        "q has dtype",
    ),
    "q-ndim": (
        _with(q=torch.empty(BATCH, HQ * D, dtype=torch.bfloat16, device=META)),
        "q must be 3-D",
    ),
    "q-tokens": (
        _with(q=torch.empty(BATCH + 1, HQ, D, dtype=torch.bfloat16, device=META)),
        "q has 5 tokens",
    ),
    "gqa-ratio": (
        _with(
            q=torch.empty(BATCH, 17 * HKV, D, dtype=torch.bfloat16, device=META),
            out=torch.empty(BATCH, 17 * HKV, D, dtype=torch.bfloat16, device=META),
        ),
        "GQA ratio",
    ),
    "heads-not-multiple": (
        _with(q=torch.empty(BATCH, 3, D, dtype=torch.bfloat16, device=META)),
        "num_q_heads",
    ),
    "head-size": (
        _with(
            key_cache=_cache((BLOCKS, BS, HKV, 96)),
            value_cache=_cache((BLOCKS, BS, HKV, 96)),
        ),
        "head_size",
    ),
    **cache_argument_cases(_with, _cache, BLOCKS, BS, HKV, D),
    "block-table-dtype": (
        _with(block_table=torch.empty(BATCH, 16, dtype=torch.int64, device=META)),
        "block_table has dtype",
    ),
    "block-table-rows": (
        _with(block_table=torch.empty(BATCH - 1, 16, dtype=torch.int32, device=META)),
        "block_table must have",
    ),
    "kv-lens-dtype": (
        _with(kv_lens=torch.empty(BATCH, dtype=torch.int64, device=META)),
        "kv_lens has dtype",
    ),
    "out-dtype": (_with(out=torch.empty(BATCH, HQ, D, device=META)), "out has dtype"),
    "out-shape": (
        _with(out=torch.empty(BATCH, HQ, D // 2, dtype=torch.bfloat16, device=META)),
        "out shape",
    ),
    "query-tokens": (_with(query_tokens=9), "query_tokens"),
    "workspace-heads": (
        _with(workspace=workspace(num_kv_heads=4)),
        "workspace was sized",
    ),
    "workspace-batch": (_with(workspace=workspace(max_batch=2)), "workspace was sized"),
    "workspace-type": (
        _with(workspace=object()),
        "workspace must be a DecodeWorkspace",
    ),
    "workspace-missing-field": (
        _with(workspace=workspace(partial_lse=None)),
        "workspace.partial_lse is missing",
    ),
    "workspace-partial-dtype": (
        _with(workspace=workspace(partial_out=torch.empty(64, device=META).half())),
        "workspace.partial_out has dtype",
    ),
    "workspace-counters-device": (
        _with(workspace=workspace(piece_counters=torch.zeros(8, dtype=torch.int32))),
        "workspace.piece_counters is on cpu",
    ),
    "workspace-on-cpu": (
        _with(
            workspace=workspace(
                plan_buffer=torch.zeros(64, dtype=torch.int32),
                partial_out=torch.empty(64),
                partial_lse=torch.empty(64),
                piece_counters=torch.zeros(8, dtype=torch.int32),
            )
        ),
        "workspace.plan_buffer is on cpu",
    ),
    "workspace-query-tokens": (
        _with(
            q=torch.empty(2 * BATCH, HQ, D, dtype=torch.bfloat16, device=META),
            out=torch.empty(2 * BATCH, HQ, D, dtype=torch.bfloat16, device=META),
            query_tokens=2,
        ),
        "workspace was sized",
    ),
    "scale": (_with(scale=0.0), "scale"),
    "softcap": (_with(softcap=-1.0), "softcap"),
    "fp8-missing-k-scale": (_with(torch.float8_e4m3fn, k_scale=None), "k_scale"),
    "fp8-q-missing-scale": (
        _with(
            torch.float8_e4m3fn,
            q=torch.empty(BATCH, HQ, D, dtype=torch.float8_e4m3fn, device=META),
        ),
        "q_scale",
    ),
    "q-scale-on-16-bit-q": (
        _with(q_scale=torch.empty(BATCH, HQ, device=META)),
        "q_scale",
    ),
    "k-scale-shape": (
        _with(torch.float8_e4m3fn, k_scale=torch.empty(2, device=META)),
        "k_scale",
    ),
    "device-mismatch": (
        _with(kv_lens=torch.empty(BATCH, dtype=torch.int32)),
        "kv_lens is on",
    ),
}


@pytest.mark.parametrize(("args", "match"), BAD_CASES.values(), ids=BAD_CASES.keys())
def test_decode_validation(args: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call(args)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"head_size": 96}, "head_size"),
        ({"num_q_heads": 34}, "GQA ratio"),
        ({"min_split_len": 100}, "min_split_len"),
        ({"mode": hpc_ops.SplitMode.BATCH_INVARIANT}, "fixed_split_len"),
        ({"window": -5}, "window"),
        ({"max_batch": 0}, "max_batch"),
        ({"device": "cpu"}, "CUDA device"),
        ({"max_query_tokens": 9}, "query_tokens"),
        # 16 query heads over 2 KV heads: 8 rows per query token.
        ({"max_query_tokens": 8, "num_kv_heads": 1}, r"query_tokens x GQA ratio"),
    ],
)
def test_workspace_validation(kwargs: dict, match: str) -> None:
    args = {
        "max_batch": 8,
        "num_q_heads": 16,
        "num_kv_heads": 2,
        "head_size": 128,
        "max_kv_tokens": 4096,
        "device": "cuda",
        "num_ctas": 8,
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        workspaces.DecodeWorkspace.create(**args)


def test_decode_fake_implementation() -> None:
    """Under FakeTensorMode the op runs its registered fake: no kernel, no
    error, outputs keep their metadata."""
    with FakeTensorMode() as mode:
        q = torch.empty(BATCH, HQ, D, dtype=torch.bfloat16)
        k = torch.empty(BLOCKS, BS, HKV, D, dtype=torch.bfloat16)
        out = torch.empty_like(q)
        ws = workspace(
            plan_buffer=mode.from_tensor(
                torch.empty(hpc_ops.decode_plan_size(BATCH * HKV, 8), dtype=torch.int32)
            ),
            partial_out=torch.empty(16 * 8 * D),
            partial_lse=torch.empty(16 * 8),
        )
        torch.ops._hpc_C.decode_attention(
            q,
            k,
            k,
            torch.empty(BATCH, 16, dtype=torch.int32),
            torch.empty(BATCH, dtype=torch.int32),
            ws.plan_buffer,
            out,
            ws.partial_out,
            ws.partial_lse,
            torch.zeros(BATCH * HKV, dtype=torch.int32),
            None,
            None,
            None,
            D**-0.5,
            0.0,
            1,
            BATCH * HKV,
            8,
        )
        torch.ops._hpc_C.plan_decode(
            torch.empty(BATCH, dtype=torch.int32),
            ws.plan_buffer,
            HKV,
            1,
            0,
            8,
            BATCH * HKV,
            4,
            0,
            0,
            HQ // HKV,
            2,
        )
        assert out.shape == q.shape and out.dtype == torch.bfloat16
