# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The kernels' limits are stated once, in ``csrc/hpc/kernel_limits.h``: the op
layer reads them from the library (``kernel_limits``), and its literal
fallbacks, used only where the library is absent, say the same."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.hpc.utils import import_hpc_ops

hpc_ops = import_hpc_ops()

pytestmark = pytest.mark.skipif(
    not hpc_ops.hpc_ops_available(), reason="the _hpc_C library is not built"
)


def library_limits() -> dict[str, tuple[int, ...]]:
    limits = {}
    for entry in torch.ops._hpc_C.kernel_limits():
        name, sep, values = entry.partition("=")
        assert sep and values, entry
        limits[name] = tuple(int(v) for v in values.split(","))
    return limits


def test_fallbacks_say_what_the_library_says() -> None:
    assert library_limits() == hpc_ops._FALLBACK_LIMITS


@pytest.mark.parametrize(
    ("constant", "name"),
    [
        ("SUPPORTED_HEAD_SIZES", "head_sizes"),
        ("SUPPORTED_BLOCK_SIZES", "block_sizes"),
        ("MOE_BLOCK_SHAPE", "moe_block_shape"),
    ],
)
def test_list_limits_come_from_the_library(constant: str, name: str) -> None:
    assert getattr(hpc_ops, constant) == library_limits()[name]


@pytest.mark.parametrize(
    ("constant", "name"),
    [
        ("MAX_GQA_RATIO", "max_gqa_ratio"),
        ("DECODE_TILE_TOKENS", "decode_tile_tokens"),
        ("MAX_DECODE_QUERY_TOKENS", "max_decode_query_tokens"),
        ("MAX_DECODE_ROWS", "max_decode_rows"),
        ("PREFILL_MAX_KV_HEADS", "prefill_max_kv_heads"),
        ("MOE_MAX_TOPK", "moe_max_topk"),
        ("MOE_HIDDEN_ALIGN", "moe_hidden_align"),
        ("MOE_INTERMEDIATE_ALIGN", "moe_intermediate_align"),
    ],
)
def test_scalar_limits_come_from_the_library(constant: str, name: str) -> None:
    assert (getattr(hpc_ops, constant),) == library_limits()[name]


def test_limits_op_schema() -> None:
    torch.library.opcheck(
        torch.ops._hpc_C.kernel_limits.default, (), test_utils=("test_schema",)
    )
