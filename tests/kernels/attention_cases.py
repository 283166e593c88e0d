# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the decode and prefill GPU tests share: the axes their case grids
cycle through, the option parts of a case id, the inputs' builder
arguments, the head size x GQA ratio grid, the run-and-check of one case
and the capture of a CUDA graph after a warm-up; and the cache arguments the
validation of every attention op rejects.

Imports only pytest, torch and the references.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch
from decode_reference import FP8_DTYPE, CacheLayout, PagedInputs, bitwise_equal

BF16 = torch.bfloat16
FP16 = torch.float16
E5M2 = torch.float8_e5m2
HEAD_SIZES = (64, 128, 256)
BLOCK_SIZES = (16, 32, 64)
LAYOUTS = (CacheLayout.SEPARATE, CacheLayout.STACKED, CacheLayout.HPC)
# GQA ratio -> (Hq, Hkv): two KV heads, so the work of both heads interleaves.
RATIOS = (1, 4, 5, 8, 16)
HEADS = {r: (2 * r, 2) for r in RATIOS}

DTYPE_NAMES = {BF16: "bf16", FP16: "fp16", FP8_DTYPE: "fp8"}

CaseT = TypeVar("CaseT")
InputsT = TypeVar("InputsT", bound=PagedInputs)


def option_id_parts(case: Any) -> list[str]:
    """The id parts of a case's query and output dtypes, window, soft-cap
    and scale, where they are set."""
    parts = []
    if case.q_dtype is not None:
        parts.append(f"q-{DTYPE_NAMES[case.q_dtype]}")
    if case.out_dtype is not None:
        parts.append(f"out-{DTYPE_NAMES[case.out_dtype]}")
    if case.window:
        parts.append(f"win{case.window}")
    if case.softcap:
        parts.append(f"cap{case.softcap:g}")
    if case.scale is not None:
        parts.append(f"scale{case.scale:g}")
    return parts


def build_kwargs(case: Any, seed: int) -> dict[str, object]:
    """The builder arguments every case sets (``make_decode_inputs`` and
    ``make_prefill_inputs`` alike), with ``seed``."""
    return dict(
        num_q_heads=case.heads[0],
        num_kv_heads=case.heads[1],
        head_size=case.head_size,
        block_size=case.block_size,
        kv_dtype=case.kv_dtype,
        q_dtype=case.q_dtype,
        out_dtype=case.out_dtype,
        layout=case.layout,
        scale=case.scale,
        softcap=case.softcap,
        window=case.window,
        seed=seed,
        device="cuda",
    )


def head_grid_cases(make: Callable[..., CaseT]) -> list[CaseT]:
    """Every head size x GQA ratio, cycling block sizes, layouts and 16-bit
    cache dtypes."""
    cases = []
    for i, (head_size, ratio) in enumerate(itertools.product(HEAD_SIZES, RATIOS)):
        cases.append(
            make(
                heads=HEADS[ratio],
                head_size=head_size,
                block_size=BLOCK_SIZES[i % 3],
                layout=LAYOUTS[(i // 3) % 3],
                kv_dtype=(BF16, FP16)[i % 2],
            )
        )
    return cases


def params(cases: list[Any]) -> list[object]:
    return [pytest.param(case, id=case.id) for case in cases]


def print_check(inputs: Any, what: str) -> None:
    """Checks ``inputs.out`` against the reference and prints the error."""
    stats = inputs.check(what)
    print(what, stats)


def run_and_check(inputs: InputsT, case_id: str, run: Callable[[], None]) -> InputsT:
    """Runs ``run`` on NaN-poisoned outputs, then fails if the queries
    changed and checks the output (``print_check``)."""
    q_before = inputs.q.clone()
    inputs.poison_out()
    run()
    torch.accelerator.synchronize()
    assert bitwise_equal(inputs.q, q_before), f"{case_id}: q changed"
    print_check(inputs, case_id)
    return inputs


def capture_graph(run: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``run``, after a warm-up run on a side stream
    (outside the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    torch.accelerator.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


def cache_argument_cases(
    with_args: Callable[..., dict],
    cache: Callable[..., torch.Tensor],
    blocks: int,
    block_size: int,
    kv_heads: int,
    head_size: int,
) -> dict[str, tuple[dict, str]]:
    """Validation cases ``name -> (arguments, error pattern)`` of the K/V
    cache arguments: ``with_args(**changes)`` gives an op's arguments with
    ``changes``, ``cache(shape, dtype)`` a cache tensor of the baseline
    ``[blocks, block_size, kv_heads, head_size]``."""
    cases = {
        "block-size": (
            with_args(
                key_cache=cache((blocks, 8, kv_heads, head_size)),
                value_cache=cache((blocks, 8, kv_heads, head_size)),
            ),
            "block_size",
        ),
        "cache-dtype-mismatch": (
            with_args(value_cache=cache(dtype=torch.float16)),
            "value_cache dtype",
        ),
        "cache-shape-mismatch": (
            with_args(value_cache=cache((blocks, block_size, kv_heads * 2, head_size))),
            "must match",
        ),
        "cache-not-contiguous-in-d": (
            with_args(
                key_cache=cache((blocks, block_size, head_size, kv_heads)).transpose(
                    2, 3
                )
            ),
            "key_cache must be contiguous",
        ),
    }
    # FP8 caches are E4M3 (the kernels' FP8 tensor-core path): E5M2 is
    # refused like any other unsupported dtype.
    for name, dtype in (("cache-dtype", torch.float32), ("cache-fp8-e5m2", E5M2)):
        cases[name] = (
            with_args(key_cache=cache(dtype=dtype), value_cache=cache(dtype=dtype)),
            "key_cache has dtype",
        )
    return cases
