# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Checks of the paged prefill op layer that need no GPU, plus the GPU
planner against the host planner (marked ``gpu``).

* Argument validation (``validate_prefill_attention`` and the
  workspace's): every bad input raises a ValueError naming itself (inputs
  on the meta device, so nothing reaches a kernel).
* The fake implementations: the ops trace under FakeTensor mode.
* The host planner (``torch.ops._hpc_C.plan_prefill`` on CPU tensors), for
  random and hand-picked varlen batches. Each plan is checked against an
  expectation rebuilt here from the definitions: a tile is ``128 // group``
  consecutive query tokens of one request and one KV head; its cost is the
  number of keys its last query token sees under the bottom-right causal
  mask; tiles come in descending cost buckets (cost >> shift, fewer than
  16 buckets), KV-head-major inside a bucket.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from typing import TYPE_CHECKING

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from tests.kernels.hpc.prefill_reference import PrefillPlan, read_prefill_plan
from tests.kernels.hpc.utils import (
    cache_argument_cases,
    import_attn_workspace,
    import_hpc_ops,
    import_hpc_validation,
)

if TYPE_CHECKING:
    from vllm.v1.attention.ops.hpc_attn_workspace import PrefillWorkspace

hpc_ops = import_hpc_ops()
validation = import_hpc_validation()
workspaces = import_attn_workspace()

pytestmark = pytest.mark.skipif(
    not hpc_ops.hpc_ops_available(), reason="the _hpc_C library is not built"
)

META = torch.device("meta")
BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn
TOKENS, BATCH, HQ, HKV, D, BS, BLOCKS = 40, 3, 16, 2, 128, 16, 64

# The plan's definitions (prefill_plan.h): 128 query rows per tile and 16
# cost buckets.
TILE_ROWS = 128
COST_BUCKETS = 16


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------


def workspace(**overrides) -> PrefillWorkspace:
    ws = workspaces.PrefillWorkspace(
        plan_buffer=torch.empty(4096, dtype=torch.int32, device=META),
        max_tokens=64,
        max_batch=4,
        num_q_heads=HQ,
        num_kv_heads=HKV,
        max_tiles=64,
    )
    return dataclasses.replace(ws, **overrides)


def _t(*shape, dtype=BF16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device=META)


def inputs(kv_dtype: torch.dtype = BF16, q_dtype: torch.dtype | None = None) -> dict:
    if q_dtype is None:
        q_dtype = BF16 if kv_dtype == FP8 else kv_dtype
    args = {
        "q": _t(TOKENS, HQ, D, dtype=q_dtype),
        "key_cache": _t(BLOCKS, BS, HKV, D, dtype=kv_dtype),
        "value_cache": _t(BLOCKS, BS, HKV, D, dtype=kv_dtype),
        "block_table": _t(BATCH, 16, dtype=torch.int32),
        "query_start_loc": _t(BATCH + 1, dtype=torch.int32),
        "seq_lens": _t(BATCH, dtype=torch.int32),
        "out": _t(TOKENS, HQ, D),
        "workspace": workspace(),
        "scale": D**-0.5,
    }
    if kv_dtype == FP8:
        args["k_scale"] = _t(1, dtype=torch.float32)
        args["v_scale"] = _t(1, dtype=torch.float32)
    if q_dtype == FP8:
        args["q_scale"] = _t(TOKENS, HQ, dtype=torch.float32)
    return args


POSITIONAL = (
    "q",
    "key_cache",
    "value_cache",
    "block_table",
    "query_start_loc",
    "seq_lens",
    "out",
    "workspace",
)


def call(args: dict, validate: bool = True) -> None:
    """Calls the op, after validating the arguments unless told not to."""
    args = dict(args)
    positional = [args.pop(k) for k in POSITIONAL]
    if validate:
        validation.validate_prefill_attention(*positional, **args)
    hpc_ops.prefill_attention(*positional, **args)


@pytest.mark.parametrize(
    ("kv_dtype", "q_dtype"),
    [
        (BF16, BF16),
        (torch.float16, torch.float16),
        (FP8, BF16),
        (FP8, torch.float16),
        (FP8, FP8),
    ],
)
def test_valid_inputs_reach_the_op(kv_dtype, q_dtype) -> None:
    """The baseline arguments pass validation; on the meta device the op
    dispatches to its fake implementation."""
    call(inputs(kv_dtype, q_dtype))
    call(_with(window=128, softcap=30.0))


def _with(kv_dtype=BF16, q_dtype=None, **changes) -> dict:
    args = inputs(kv_dtype, q_dtype)
    args.update(changes)
    return args


def _cache(shape=(BLOCKS, BS, HKV, D), dtype=BF16) -> torch.Tensor:
    return _t(*shape, dtype=dtype)


BAD_CASES = {
    "q-dtype": (_with(q=_t(TOKENS, HQ, D, dtype=torch.float32)), "q has dtype"),
    "q-dtype-differs-from-16-bit-cache": (
        _with(q=_t(TOKENS, HQ, D, dtype=torch.float16)),
        "q has dtype",
    ),
    "q-fp8-on-bf16-cache": (_with(q=_t(TOKENS, HQ, D, dtype=FP8)), "q has dtype"),
    # FP8 queries are E4M3, as the cache (utils: cache-fp8-e5m2).
    "q-fp8-e5m2-on-fp8-cache": (
        _with(FP8, q=_t(TOKENS, HQ, D, dtype=torch.float8_e5m2)),
        "q has dtype",
    ),
    "q-ndim": (_with(q=_t(TOKENS, HQ * D)), "q must be 3-D"),
    "q-head-size": (_with(q=_t(TOKENS, HQ, 64)), "q head size"),
    "q-not-contiguous-in-d": (
        _with(q=_t(TOKENS, D, HQ).transpose(1, 2)),
        "q must be contiguous in head_size",
    ),
    # 132 bf16 elements = 264 bytes: not a 16-byte multiple (TMA).
    "q-head-stride": (_with(q=_t(TOKENS, HQ, D + 4)[..., :D]), r"q.stride\(1\)"),
    "q-token-stride": (
        _with(q=_t(TOKENS, HQ * D + 4)[:, : HQ * D].view(TOKENS, HQ, D)),
        r"q.stride\(0\)",
    ),
    "gqa-ratio": (
        _with(q=_t(TOKENS, 17 * HKV, D), out=_t(TOKENS, 17 * HKV, D)),
        "GQA ratio",
    ),
    "heads-not-multiple": (
        _with(q=_t(TOKENS, 3, D), out=_t(TOKENS, 3, D)),
        "num_q_heads",
    ),
    "head-size": (
        _with(
            q=_t(TOKENS, HQ, 96),
            out=_t(TOKENS, HQ, 96),
            key_cache=_cache((BLOCKS, BS, HKV, 96)),
            value_cache=_cache((BLOCKS, BS, HKV, 96)),
        ),
        "head_size",
    ),
    **cache_argument_cases(_with, _cache, BLOCKS, BS, HKV, D),
    "cache-head-stride": (
        _with(value_cache=_cache((BLOCKS, BS, HKV, D + 4))[..., :D]),
        r"value_cache.stride\(2\)",
    ),
    "block-table-dtype": (
        _with(block_table=_t(BATCH, 16, dtype=torch.int64)),
        "block_table has dtype",
    ),
    "block-table-ndim": (
        _with(block_table=_t(BATCH * 16, dtype=torch.int32)),
        "block_table must be 2-D",
    ),
    "block-table-rows": (
        _with(block_table=_t(BATCH - 1, 16, dtype=torch.int32)),
        "block_table must have",
    ),
    "block-table-stride": (
        _with(block_table=_t(16, BATCH, dtype=torch.int32).t()),
        "block_table must have",
    ),
    "query-start-loc-dtype": (
        _with(query_start_loc=_t(BATCH + 1, dtype=torch.int64)),
        "query_start_loc has dtype",
    ),
    "query-start-loc-length": (
        _with(query_start_loc=_t(BATCH, dtype=torch.int32)),
        "query_start_loc has 3 entries",
    ),
    "query-start-loc-ndim": (
        _with(query_start_loc=_t(1, BATCH + 1, dtype=torch.int32)),
        "query_start_loc must be 1-D",
    ),
    "query-start-loc-strided": (
        _with(query_start_loc=_t(2 * BATCH + 2, dtype=torch.int32)[::2]),
        "query_start_loc must be contiguous",
    ),
    "seq-lens-dtype": (
        _with(seq_lens=_t(BATCH, dtype=torch.int64)),
        "seq_lens has dtype",
    ),
    "seq-lens-ndim": (
        _with(seq_lens=_t(BATCH, 1, dtype=torch.int32)),
        "seq_lens must be 1-D",
    ),
    "seq-lens-strided": (
        _with(seq_lens=_t(2 * BATCH, dtype=torch.int32)[::2]),
        "seq_lens must be contiguous",
    ),
    "out-dtype": (_with(out=_t(TOKENS, HQ, D, dtype=torch.float32)), "out has dtype"),
    "out-fp8": (_with(out=_t(TOKENS, HQ, D, dtype=FP8)), "out has dtype"),
    "out-shape": (_with(out=_t(TOKENS, HQ, D // 2)), "out shape"),
    "out-not-contiguous-in-d": (
        _with(out=_t(TOKENS, D, HQ).transpose(1, 2)),
        "out must be contiguous",
    ),
    "workspace-type": (_with(workspace=object()), "workspace must be"),
    "workspace-plan-dtype": (
        _with(workspace=workspace(plan_buffer=_t(64, dtype=torch.int64))),
        "workspace.plan_buffer has dtype",
    ),
    "workspace-tokens": (
        _with(workspace=workspace(max_tokens=TOKENS - 1)),
        "workspace was sized",
    ),
    "workspace-batch": (
        _with(workspace=workspace(max_batch=BATCH - 1)),
        "workspace was sized",
    ),
    "workspace-q-heads": (
        _with(workspace=workspace(num_q_heads=2 * HQ)),
        "workspace was sized",
    ),
    "workspace-kv-heads": (
        _with(workspace=workspace(num_kv_heads=2 * HKV)),
        "workspace was sized",
    ),
    "workspace-on-cpu": (
        _with(workspace=workspace(plan_buffer=torch.empty(16, dtype=torch.int32))),
        "workspace.plan_buffer is on cpu",
    ),
    "scale-zero": (_with(scale=0.0), "scale"),
    "scale-negative": (_with(scale=-1.0), "scale"),
    "scale-inf": (_with(scale=math.inf), "scale"),
    "scale-nan": (_with(scale=math.nan), "scale"),
    "softcap-negative": (_with(softcap=-1.0), "softcap"),
    "softcap-nan": (_with(softcap=math.nan), "softcap"),
    "window-negative": (_with(window=-1), "window"),
    "window-float": (_with(window=1.5), "window"),
    "fp8-missing-k-scale": (_with(FP8, k_scale=None), "k_scale is required"),
    "fp8-missing-v-scale": (_with(FP8, v_scale=None), "v_scale is required"),
    "k-scale-shape": (
        _with(FP8, k_scale=_t(2, dtype=torch.float32)),
        "k_scale must be",
    ),
    "v-scale-dtype": (_with(FP8, v_scale=_t(1)), "v_scale has dtype"),
    "fp8-q-missing-scale": (_with(FP8, FP8, q_scale=None), "q_scale is required"),
    "q-scale-shape": (
        _with(FP8, FP8, q_scale=_t(TOKENS, HQ + 1, dtype=torch.float32)),
        "q_scale must be",
    ),
    "q-scale-stride": (
        _with(FP8, FP8, q_scale=_t(HQ, TOKENS, dtype=torch.float32).t()),
        "q_scale must be",
    ),
    "q-scale-dtype": (
        _with(FP8, FP8, q_scale=_t(TOKENS, HQ)),
        "q_scale has dtype",
    ),
    "q-scale-on-16-bit-q": (
        _with(q_scale=_t(TOKENS, HQ, dtype=torch.float32)),
        "q_scale is only accepted",
    ),
    "device-mismatch-seq-lens": (
        _with(seq_lens=torch.empty(BATCH, dtype=torch.int32)),
        "seq_lens is on",
    ),
    "device-mismatch-q": (
        _with(q=torch.empty(TOKENS, HQ, D, dtype=BF16)),
        "q is on",
    ),
    "q-not-a-tensor": (_with(q=[1, 2, 3]), "q must be a torch.Tensor"),
}


@pytest.mark.parametrize(("args", "match"), BAD_CASES.values(), ids=BAD_CASES.keys())
def test_prefill_validation(args: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call(args)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2**31}, "max_tokens"),
        ({"max_batch": 0}, "max_batch"),
        ({"num_kv_heads": 0}, "num_kv_heads"),
        ({"num_q_heads": 34}, "GQA ratio"),
        ({"num_q_heads": 3}, "num_q_heads"),
        ({"num_q_heads": 512, "num_kv_heads": 512}, "num_kv_heads"),
        ({"device": "meta"}, "device"),
    ],
)
def test_workspace_validation(kwargs: dict, match: str) -> None:
    args = {
        "max_tokens": 4096,
        "max_batch": 8,
        "num_q_heads": 16,
        "num_kv_heads": 2,
        "device": "cpu",
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        workspaces.PrefillWorkspace.create(**args)


def _i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize(
    ("qsl", "seq_lens", "match"),
    [
        (_i32([0, 4, 8]), _i32([4, 8, 2]), "query_start_loc has 3 entries"),
        (_i32([0, 4]).long(), _i32([4]), "query_start_loc has dtype"),
        (_i32([0, 4]), _i32([4]).long(), "seq_lens has dtype"),
        (_i32([[0, 4]]), _i32([4]), "query_start_loc must be 1-D"),
        (_i32([0, 1, 2, 3, 4, 5]), _i32([1] * 5), "exceeds the workspace's max_batch"),
        (_i32([0, 4]).to(META), _i32([4]), "query_start_loc is on meta"),
        (_i32([0, 4, 9]), _i32([4, 0, 5, 0])[::2], "seq_lens must be contiguous"),
    ],
)
def test_plan_validation(qsl, seq_lens, match: str) -> None:
    ws = workspaces.PrefillWorkspace.create(
        max_tokens=64, max_batch=4, num_q_heads=8, num_kv_heads=2, device="cpu"
    )
    with pytest.raises(ValueError, match=match):
        ws.plan(qsl, seq_lens)


# ---------------------------------------------------------------------------
# Fake implementations
# ---------------------------------------------------------------------------


def _cpu_inputs(q_dtype=BF16, kv_dtype=BF16) -> dict:
    args = inputs(kv_dtype, q_dtype)
    # Meta tensors hold no data; the CPU copies are fresh zeros.
    return {
        k: (torch.zeros(v.shape, dtype=v.dtype) if isinstance(v, torch.Tensor) else v)
        for k, v in args.items()
    }


def _cpu_workspace() -> PrefillWorkspace:
    """A workspace of the baseline sizes on the CPU."""
    return workspaces.PrefillWorkspace.create(
        max_tokens=TOKENS,
        max_batch=BATCH,
        num_q_heads=HQ,
        num_kv_heads=HKV,
        device="cpu",
    )


def test_prefill_fake_implementation() -> None:
    """Under FakeTensorMode the planner and the attention op run their
    registered fakes: no kernel, no error, out keeps its metadata."""
    for q_dtype, kv_dtype in ((BF16, BF16), (FP8, FP8)):
        real = _cpu_inputs(q_dtype, kv_dtype)
        ws = _cpu_workspace()
        with FakeTensorMode() as mode:
            fake = {
                k: (mode.from_tensor(v) if isinstance(v, torch.Tensor) else v)
                for k, v in real.items()
            }
            fake_ws = dataclasses.replace(
                ws, plan_buffer=mode.from_tensor(ws.plan_buffer)
            )
            fake_ws.plan(fake["query_start_loc"], fake["seq_lens"])
            fake["workspace"] = fake_ws
            call(fake, validate=False)
            out = fake["out"]
            assert out.shape == (TOKENS, HQ, D)
            assert out.dtype == BF16


def test_prefill_traces() -> None:
    """make_fx in fake mode records the planner and the attention op, with
    out as the mutated argument."""
    real = _cpu_inputs()
    ws = _cpu_workspace()

    def step(q, k, v, block_table, qsl, seq_lens, out, plan_buffer):
        step_ws = dataclasses.replace(ws, plan_buffer=plan_buffer)
        step_ws.plan(qsl, seq_lens)
        hpc_ops.prefill_attention(
            q,
            k,
            v,
            block_table,
            qsl,
            seq_lens,
            out,
            step_ws,
            scale=0.1,
            softcap=5.0,
            window=64,
        )
        return out

    args = [real[k] for k in POSITIONAL[:-1]] + [ws.plan_buffer]
    graph = make_fx(step, tracing_mode="fake")(*args)
    targets = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert any("_hpc_C.plan_prefill" in t for t in targets), targets
    assert any("_hpc_C.prefill_attention" in t for t in targets), targets


# ---------------------------------------------------------------------------
# Host planner: expectations from the definitions
# ---------------------------------------------------------------------------


def tokens_per_tile(group: int) -> int:
    """The most whole tokens of `group` query heads in 128 rows."""
    return TILE_ROWS // group


def keys_seen(q_len: int, kv_len: int, token: int) -> int:
    """Keys query token `token` of a request sees under the bottom-right
    causal mask, counted key by key for short requests."""
    pos = kv_len - q_len + token
    if kv_len <= 4096:
        return sum(1 for key in range(kv_len) if key <= pos)
    return max(0, min(pos + 1, kv_len))


def expected_items(q_lens, kv_lens, t: int) -> list[tuple[int, int, int]]:
    """(request, m_block, cost) for every query-token block, request-major."""
    items = []
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True)):
        for m in range(math.ceil(q_len / t) if q_len > 0 else 0):
            last = min((m + 1) * t, q_len) - 1
            items.append((b, m, keys_seen(q_len, kv_len, last)))
    return items


def expected_shift(kv_lens) -> int:
    """The fewest right shifts that put every request's longest possible
    cost (all its keys) below COST_BUCKETS."""
    longest = max([0, *kv_lens])
    shift = 0
    while longest >> shift >= COST_BUCKETS:
        shift += 1
    return shift


def plan_host(
    q_lens, kv_lens, num_q_heads, num_kv_heads, max_tokens=None, max_batch=None
):
    ws = workspaces.PrefillWorkspace.create(
        max_tokens=max_tokens or max(1, sum(q_lens)),
        max_batch=max_batch or max(1, len(q_lens)),
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        device="cpu",
    )
    qsl = _i32([0, *itertools.accumulate(q_lens)])
    ws.plan(qsl, _i32(kv_lens))
    return ws, read_prefill_plan(ws)


def bucket_runs(buckets: list[int]) -> list[tuple[int, int, int]]:
    """(bucket, start, end) of each maximal run of equal buckets."""
    runs, start = [], 0
    for i in range(1, len(buckets) + 1):
        if i == len(buckets) or buckets[i] != buckets[start]:
            runs.append((buckets[start], start, i))
            start = i
    return runs


def check_plan(plan, q_lens, kv_lens, num_q_heads, num_kv_heads, *, stable=True):
    """Asserts every property of a plan for these lengths. `stable`: items
    inside a bucket keep request-major order (the host planner)."""
    group = num_q_heads // num_kv_heads
    t = tokens_per_tile(group)
    batch = len(q_lens)
    items = expected_items(q_lens, kv_lens, t)
    shift = expected_shift(kv_lens)
    cost = {(b, m): c for b, m, c in items}

    assert plan.tile_tokens == t
    assert plan.num_kv_heads == num_kv_heads
    assert plan.batch == batch
    assert plan.cost_shift == shift
    assert plan.num_tiles == len(items) * num_kv_heads
    blocks = [math.ceil(q / t) if q > 0 else 0 for q in q_lens]
    assert plan.request_first_item.tolist() == [0, *itertools.accumulate(blocks)]

    tiles = [tuple(row) for row in plan.tiles.tolist()]
    assert len(tiles) == plan.num_tiles
    # Every (request, m-block, KV head) exactly once, and nothing else.
    want = sorted((b, m, h) for b, m, _ in items for h in range(num_kv_heads))
    assert sorted(tiles) == want
    assert all(q_lens[b] > 0 for b, _, _ in tiles)

    buckets = [cost[(b, m)] >> shift for b, m, _ in tiles]
    assert all(0 <= k < COST_BUCKETS for k in buckets)
    assert all(x >= y for x, y in itertools.pairwise(buckets)), "not longest first"
    for bucket, start, end in bucket_runs(buckets):
        run = tiles[start:end]
        assert len(run) % num_kv_heads == 0, bucket
        n = len(run) // num_kv_heads
        # KV-head-major: head h holds positions [h * n, (h + 1) * n), every
        # head the same items in the same order.
        order = [(b, m) for b, m, _ in run[:n]]
        for h in range(num_kv_heads):
            segment = run[h * n : (h + 1) * n]
            assert [kv for _, _, kv in segment] == [h] * n, bucket
            assert [(b, m) for b, m, _ in segment] == order, bucket
        if stable:
            assert order == sorted(order), bucket
    return tiles


GQA = {1: (8, 8), 4: (32, 8), 5: (10, 2), 8: (64, 8), 16: (16, 1)}


def _random_batch(rng: random.Random, batch: int) -> tuple[list[int], list[int]]:
    q_lens, kv_lens = [], []
    for _ in range(batch):
        kind = rng.random()
        if kind < 0.15:
            q = 0
        elif kind < 0.3:
            q = 1
        else:
            q = rng.randint(2, 700)
        context = rng.choice((0, 0, rng.randint(1, 300), rng.randint(1000, 40000)))
        q_lens.append(q)
        kv_lens.append(q + context)
    return q_lens, kv_lens


@pytest.mark.parametrize("group", sorted(GQA))
@pytest.mark.parametrize("seed", range(4))
def test_host_plan_random(group: int, seed: int) -> None:
    rng = random.Random(1000 * group + seed)
    hq, hkv = GQA[group]
    q_lens, kv_lens = _random_batch(rng, rng.randint(1, 40))
    _, plan = plan_host(q_lens, kv_lens, hq, hkv)
    check_plan(plan, q_lens, kv_lens, hq, hkv)


CASES = {
    # A decode-like request and short prompts.
    "one-token": ([1], [1]),
    "one-token-with-context": ([1, 1, 1], [1, 700, 5000]),
    # Chunked prefill: a chunk far into a long context, and a prompt.
    "chunk-long-context": ([2048, 300], [32768, 300]),
    "chunk-131k": ([1000], [131072]),
    # Many m-blocks per bucket (a wide bucket at a large shift).
    "shared-buckets": ([4096, 4096], [200000, 4096]),
    "empty-requests": ([0, 5, 0, 0, 130, 0], [10, 5, 0, 77, 200, 3]),
    "all-empty": ([0, 0, 0], [4, 0, 9]),
    # Tile boundaries of the 128 / group token blocks.
    "tile-edges": (
        [7, 8, 9, 24, 25, 26, 127, 128, 129],
        [7, 8, 9, 24, 25, 26, 127, 128, 129],
    ),
    "equal-lengths": ([64] * 12, [64] * 12),
}


@pytest.mark.parametrize("group", sorted(GQA))
@pytest.mark.parametrize("case", list(CASES))
def test_host_plan_cases(case: str, group: int) -> None:
    q_lens, kv_lens = CASES[case]
    hq, hkv = GQA[group]
    _, plan = plan_host(q_lens, kv_lens, hq, hkv)
    check_plan(plan, q_lens, kv_lens, hq, hkv)


def test_longest_tiles_first_example() -> None:
    """A worked example, cost counted by hand: GQA 8 (16 tokens per tile),
    one KV head pair. Request 0: 20 new tokens after 100 cached keys;
    request 1: a 16-token prompt. Costs: (0, 1) sees all 120 keys, (0, 0)
    sees 116, (1, 0) sees 16."""
    _, plan = plan_host([20, 16], [120, 16], 16, 2)
    assert plan.tiles.tolist() == [
        [0, 1, 0],
        [0, 1, 1],
        [0, 0, 0],
        [0, 0, 1],
        [1, 0, 0],
        [1, 0, 1],
    ]


def test_plan_layout_and_capacity() -> None:
    """The plan size is the header, request_first_item [max_batch + 1] and
    two words per tile; the tile capacity holds the worst batches a
    workspace admits (each request one token past a tile, or one long
    request and single tokens)."""
    for group, (hq, hkv) in GQA.items():
        t = tokens_per_tile(group)
        max_tokens, max_batch = 1000, 9
        layout = hpc_ops.prefill_plan_layout(max_tokens, max_batch, hq, hkv)
        max_tiles, first, tiles, size = (
            layout[name]
            for name in ("max_tiles", "request_first_item", "tiles", "size")
        )
        assert (first, tiles) == (8, 8 + max_batch + 1)
        assert size == tiles + 2 * max_tiles
        worst = [
            [t + 1] * min(max_batch, max_tokens // (t + 1)),
            [1] * (max_batch - 1) + [max_tokens - max_batch + 1],
            [max_tokens],
        ]
        for q_lens in worst:
            assert sum(q_lens) <= max_tokens and len(q_lens) <= max_batch
            _, plan = plan_host(q_lens, q_lens, hq, hkv, max_tokens, max_batch)
            assert plan.max_tiles == max_tiles >= plan.num_tiles
            assert plan.max_batch == max_batch
            check_plan(plan, q_lens, q_lens, hq, hkv)


def test_plan_header_fields_match_the_reader() -> None:
    """The library names the header's fields, in order; the plan reader
    takes each by name, so C++ and the reader list the same fields."""
    names = list(torch.ops._hpc_C.prefill_plan_header_fields())
    arrays = ("request_first_item", "tiles")
    assert names == [
        f.name for f in dataclasses.fields(PrefillPlan) if f.name not in arrays
    ]
    first = hpc_ops.prefill_plan_layout(64, 4, 16, 2)["request_first_item"]
    assert len(names) <= first


def test_plan_overflow_raises() -> None:
    """More tokens than the workspace was sized for: the host planner raises
    and leaves an empty plan; more requests than max_batch are refused."""
    ws, plan = plan_host([10], [10], 16, 2, max_tokens=16, max_batch=2)
    assert plan.num_tiles == 2
    qsl, kv = _i32([0, 4000, 8000]), _i32([4000, 4000])
    with pytest.raises(ValueError, match="more tiles"):
        torch.ops._hpc_C.plan_prefill(
            qsl, kv, ws.plan_buffer, 16, 2, ws.max_batch, ws.max_tiles
        )
    assert read_prefill_plan(ws).num_tiles == 0
    with pytest.raises(RuntimeError, match="max_batch"):
        torch.ops._hpc_C.plan_prefill(
            _i32([0, 1, 2, 3]), _i32([1, 1, 1]), ws.plan_buffer, 16, 2, 2, ws.max_tiles
        )
    with pytest.raises(RuntimeError, match="layout needs"):
        torch.ops._hpc_C.plan_prefill(
            _i32([0, 1]), _i32([1]), ws.plan_buffer[:10], 16, 2, 2, ws.max_tiles
        )


def test_replan_smaller_batch() -> None:
    """A plan written over a larger one describes only the new batch."""
    ws, _ = plan_host([300, 200, 5], [900, 200, 5], 32, 8, max_batch=4)
    qsl, kv = _i32([0, 17]), _i32([40])
    ws.plan(qsl, kv)
    check_plan(read_prefill_plan(ws), [17], [40], 32, 8)


# ---------------------------------------------------------------------------
# GPU planner against the host planner
# ---------------------------------------------------------------------------


def _gpu_vs_host(q_lens, kv_lens, hq, hkv, max_tokens=None, max_batch=None):
    host_ws, host = plan_host(q_lens, kv_lens, hq, hkv, max_tokens, max_batch)
    ws = workspaces.PrefillWorkspace.create(
        max_tokens=host_ws.max_tokens,
        max_batch=host_ws.max_batch,
        num_q_heads=hq,
        num_kv_heads=hkv,
        device="cuda",
    )
    qsl = _i32([0, *itertools.accumulate(q_lens)])
    ws.plan(qsl.cuda(), _i32(kv_lens).cuda())
    return ws, host, read_prefill_plan(ws)


def _same_plan(host, gpu, q_lens, kv_lens, hq, hkv) -> None:
    check_plan(gpu, q_lens, kv_lens, hq, hkv, stable=False)
    for field in (f.name for f in dataclasses.fields(host)):
        if field not in ("request_first_item", "tiles"):
            assert getattr(host, field) == getattr(gpu, field), field
    assert torch.equal(host.request_first_item, gpu.request_first_item)
    # The same bucket order: every position holds a tile of the same bucket
    # and KV head (inside a bucket, the GPU's item order may differ).
    shift = host.cost_shift
    cost = {(b, m): c for b, m, c in expected_items(q_lens, kv_lens, host.tile_tokens)}

    def keys(plan):
        return [(cost[(b, m)] >> shift, h) for b, m, h in plan.tiles.tolist()]

    assert keys(host) == keys(gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("group", sorted(GQA))
def test_gpu_plan_matches_host(group: int) -> None:
    hq, hkv = GQA[group]
    rng = random.Random(group)
    batches = [_random_batch(rng, n) for n in (1, 7, 40, 300)]
    batches += list(CASES.values())
    # More requests than the planner has threads: the prefix runs in chunks.
    batches.append(([rng.choice((0, 1, 3, 40)) for _ in range(2500)],) * 2)
    for q_lens, kv_lens in batches:
        _, host, gpu = _gpu_vs_host(q_lens, kv_lens, hq, hkv)
        _same_plan(host, gpu, q_lens, kv_lens, hq, hkv)


@pytest.mark.gpu
def test_gpu_plan_cuda_graph() -> None:
    """The GPU planner captured once replays for new lengths in the same
    buffers (graph capture allows no host synchronisation or allocation)."""
    hq, hkv, max_batch, max_tokens = 32, 8, 16, 8192
    ws = workspaces.PrefillWorkspace.create(
        max_tokens=max_tokens,
        max_batch=max_batch,
        num_q_heads=hq,
        num_kv_heads=hkv,
        device="cuda",
    )
    qsl = torch.zeros(max_batch + 1, dtype=torch.int32, device="cuda")
    kv = torch.zeros(max_batch, dtype=torch.int32, device="cuda")
    ws.plan(qsl, kv)
    torch.accelerator.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ws.plan(qsl, kv)
    rng = random.Random(3)
    for _ in range(5):
        q_lens, kv_lens = _random_batch(rng, max_batch)
        q_lens = [min(q, max_tokens // max_batch) for q in q_lens]
        kv_lens = [max(k, q) for k, q in zip(kv_lens, q_lens, strict=True)]
        qsl.copy_(_i32([0, *itertools.accumulate(q_lens)]))
        kv.copy_(_i32(kv_lens))
        graph.replay()
        _, host = plan_host(q_lens, kv_lens, hq, hkv, max_tokens, max_batch)
        _same_plan(host, read_prefill_plan(ws), q_lens, kv_lens, hq, hkv)
