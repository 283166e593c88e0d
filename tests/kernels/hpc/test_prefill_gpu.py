# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GPU tests of paged prefill attention against the float64 reference.

Each case draws fresh random inputs from a generator seeded by the case
(``Case.seed``), shuffles the cache blocks through the block table, fills
spare blocks and the slots past each request's KV length with NaN,
NaN-poisons ``out``, runs the GPU planner and ``prefill_attention`` and
checks (``prefill_reference.check_prefill``): relative error <= 1e-2
(16-bit caches) or 5e-2 (FP8 caches, whose probabilities are rounded to
E4M3) over the whole output and over each request, a bound on the largest
absolute error, and no NaN or Inf. Requests are
``(q_len, kv_len)`` pairs; the first ``kv_len - q_len`` keys are cached
context.

The axes are combined in small grids rather than a full product: query
lengths around the tiles x context offsets 0, 1 and 2048; 2048-token chunks
of a 32K context; head sizes x GQA ratios x block sizes x cache layouts;
FP8 caches with bf16, fp16 and FP8 queries (16-bit ones also off the FP8
grid, quantized by the kernel); sliding windows, soft-cap and
scales; mixed batches of short and long requests; outputs of the other
16-bit dtype; workspaces larger than the batch. Plus: runs with and without
the argument validation write the same bits, and CUDA-graph capture of plan
and attention replayed with new lengths in the same buffers.

Imports only torch, the references, ``utils``, ``vllm._hpc_ops``, its
validation and the attention workspaces
(``vllm.v1.attention.ops.hpc_attn_workspace``).
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import zlib

import pytest
import torch

from tests.kernels.hpc.prefill_reference import PrefillInputs, make_prefill_inputs
from tests.kernels.hpc.utils import (
    BF16,
    BLOCK_SIZES,
    DTYPE_NAMES,
    FP8_DTYPE,
    FP16,
    HEAD_SIZES,
    HEADS,
    LAYOUTS,
    RATIOS,
    CacheLayout,
    bitwise_equal,
    build_kwargs,
    capture_graph,
    head_grid_cases,
    option_id_parts,
    params,
    print_check,
    run_and_check,
)
from vllm._hpc_ops import prefill_attention
from vllm._hpc_ops_validation import validate_prefill_attention
from vllm.v1.attention.ops.hpc_attn_workspace import PrefillWorkspace

pytestmark = pytest.mark.gpu

Q_LENS = (1, 63, 64, 65, 127, 128, 129, 1000, 4097)
CONTEXTS = (0, 1, 2048)

Lens = tuple[tuple[int, int], ...]


def _with_context(q_lens: tuple[int, ...], contexts: tuple[int, ...]) -> Lens:
    return tuple((q, q + c) for q, c in zip(q_lens, contexts, strict=True))


def _random_batch(rng: random.Random, batch: int) -> Lens:
    """Short, medium and long requests, half of them after a context."""
    lens = []
    for _ in range(batch):
        q = rng.choice((1, rng.randint(1, 300), rng.randint(300, 3000)))
        c = rng.choice((0, rng.randint(1, 8000)))
        lens.append((q, q + c))
    return tuple(lens)


_rng = random.Random(20250412)
RANDOM_24 = _random_batch(_rng, 24)
RANDOM_9 = _random_batch(_rng, 9)
# Short and long requests, q_len 1 rows, kv_len >> q_len.
MIXED = (
    (1, 5000),
    (1, 1),
    (4097, 4097),
    (17, 9000),
    (512, 512),
    (1, 300),
    (129, 2177),
    (64, 64),
)
SMALL = _with_context((1, 63, 129, 300), (0, 100, 0, 2048))


def _lens_id(lens: Lens) -> str:
    if len(lens) <= 4:
        return "L" + "-".join(f"{q}c{kv - q}" for q, kv in lens)
    tokens = sum(q for q, _ in lens)
    keys = sum(kv for _, kv in lens)
    return f"B{len(lens)}t{tokens}k{keys}"


@dataclasses.dataclass(frozen=True)
class Case:
    lens: Lens = SMALL
    heads: tuple[int, int] = (16, 2)
    head_size: int = 128
    block_size: int = 16
    kv_dtype: torch.dtype = BF16
    q_dtype: torch.dtype | None = None
    out_dtype: torch.dtype | None = None
    layout: CacheLayout = CacheLayout.SEPARATE
    window: int = 0
    softcap: float = 0.0
    scale: float | None = None
    # Workspace sized for more tokens / requests than the call uses.
    spare_tokens: int = 0
    spare_batch: int = 0
    # 16-bit queries over an FP8 cache on the FP8 grid (prefill_reference).
    q_on_fp8_grid: bool = True

    @property
    def id(self) -> str:
        parts = [
            _lens_id(self.lens),
            f"h{self.heads[0]}x{self.heads[1]}",
            f"d{self.head_size}",
            f"b{self.block_size}",
            f"kv-{DTYPE_NAMES[self.kv_dtype]}",
            self.layout.value,
            *option_id_parts(self),
        ]
        if self.spare_tokens or self.spare_batch:
            parts.append(f"spare{self.spare_tokens}x{self.spare_batch}")
        if not self.q_on_fp8_grid:
            parts.append("q-offgrid")
        return "-".join(parts)

    @property
    def seed(self) -> int:
        """A fixed seed of the case's own."""
        return zlib.crc32(self.id.encode())

    def build(self, seed: int | None = None, **overrides: object) -> PrefillInputs:
        kwargs = build_kwargs(self, self.seed if seed is None else seed)
        kwargs["q_on_fp8_grid"] = self.q_on_fp8_grid
        kwargs.update(overrides)
        lens = kwargs.pop("lens", self.lens)
        return make_prefill_inputs(lens, **kwargs)  # type: ignore[arg-type]

    def workspace(self, inputs: PrefillInputs) -> PrefillWorkspace:
        kwargs = inputs.workspace_kwargs(self.spare_tokens, self.spare_batch)
        return PrefillWorkspace.create(**kwargs)  # type: ignore[arg-type]


def _run(inputs: PrefillInputs, ws: PrefillWorkspace, validate: bool = True) -> None:
    ws.plan(inputs.query_start_loc, inputs.seq_lens)
    if validate:
        validate_prefill_attention(*inputs.op_args(), ws, **inputs.op_kwargs())
    prefill_attention(*inputs.op_args(), ws, **inputs.op_kwargs())


def _run_and_check(case: Case) -> PrefillInputs:
    inputs = case.build()
    ws = case.workspace(inputs)
    return run_and_check(inputs, case.id, lambda: _run(inputs, ws))


# ---------------------------------------------------------------------------
# Case grids
# ---------------------------------------------------------------------------

# Head counts of the length grid: GQA 1, 2, 4 and 8 (128 / group tokens per
# 128-row tile: 128, 64, 32 and 16).
_LENGTH_HEADS = ((8, 8), (8, 4), (16, 4), (16, 2))


def _length_cases() -> list[Case]:
    """One request per case: every query length x every context offset,
    bf16 and fp16 alternating, block sizes, layouts and GQA ratios cycling
    across both axes."""
    cases = []
    for i, (k, c) in enumerate(
        itertools.product(range(len(Q_LENS)), range(len(CONTEXTS)))
    ):
        q_len, context = Q_LENS[k], CONTEXTS[c]
        cases.append(
            Case(
                lens=((q_len, q_len + context),),
                heads=_LENGTH_HEADS[(k + 2 * c) % 4],
                block_size=BLOCK_SIZES[(k + c) % 3],
                layout=LAYOUTS[(2 * k + c) % 3],
                kv_dtype=(BF16, FP16)[i % 2],
            )
        )
    return cases


# 2048-token chunks of a 32K prompt: the second, a middle and the last one;
# Hy3 tp1 (64/8) and tp8 (8/1) heads, bf16 and FP8.
_CHUNK_CASES = [
    Case(lens=((2048, 32768),), heads=(64, 8), block_size=64, layout=CacheLayout.HPC),
    Case(lens=((2048, 16384),), heads=(8, 1), block_size=16),
    Case(
        lens=((2048, 4096),),
        heads=(8, 1),
        block_size=32,
        kv_dtype=FP8_DTYPE,
        q_dtype=FP8_DTYPE,
        layout=CacheLayout.STACKED,
    ),
    Case(
        lens=((2048, 32768),),
        heads=(8, 1),
        block_size=64,
        kv_dtype=FP8_DTYPE,
        layout=CacheLayout.HPC,
    ),
]


def _shape_cases() -> list[Case]:
    """Every head size x GQA ratio, cycling block sizes, layouts and dtypes."""
    return head_grid_cases(Case)


def _fp8_cases() -> list[Case]:
    """FP8 cache with bf16, fp16 and FP8 queries (FP8 queries into bf16 and
    fp16 outputs), every head size."""
    q_out = (
        (BF16, None),
        (FP16, None),
        (FP8_DTYPE, BF16),
        (FP8_DTYPE, FP16),
    )
    cases = []
    for i, ((q_dtype, out_dtype), head_size) in enumerate(
        itertools.product(q_out, HEAD_SIZES)
    ):
        cases.append(
            Case(
                lens=SMALL if i % 2 else RANDOM_9,
                heads=HEADS[RATIOS[i % 5]],
                head_size=head_size,
                block_size=BLOCK_SIZES[i % 3],
                layout=LAYOUTS[(i // 3) % 3],
                kv_dtype=FP8_DTYPE,
                q_dtype=q_dtype,
                out_dtype=out_dtype,
            )
        )
    return cases


def _quantized_query_cases() -> list[Case]:
    """16-bit queries over an FP8 cache off the FP8 grid: the kernel's own
    per-(token, head) rounding of Q to E4M3 is part of the error, against
    the reference on the 16-bit queries; every head size."""
    return [
        Case(
            lens=lens,
            heads=heads,
            head_size=head_size,
            block_size=block_size,
            kv_dtype=FP8_DTYPE,
            q_dtype=q_dtype,
            softcap=softcap,
            q_on_fp8_grid=False,
        )
        for lens, heads, head_size, block_size, q_dtype, softcap in (
            (SMALL, (16, 2), 64, 16, BF16, 0.0),
            (RANDOM_9, (64, 8), 128, 64, BF16, 0.0),
            (MIXED, (8, 1), 128, 32, FP16, 30.0),
            (SMALL, (20, 4), 256, 64, FP16, 0.0),
        )
    ]


_FEATURE_LENS = _with_context((1, 64, 200, 1000, 65), (1499, 0, 2048, 0, 2935))


def _feature_cases() -> list[Case]:
    """Sliding windows x soft-cap x cache dtype, with scales other than
    1/sqrt(D); FP8 caches alternate bf16 and FP8 queries."""
    combos = [
        (w, c) for w, c in itertools.product((0, 100, 1000), (0.0, 30.0)) if w or c
    ]
    cases = []
    for i, ((window, softcap), kv_dtype) in enumerate(
        itertools.product(combos, (BF16, FP16, FP8_DTYPE))
    ):
        # With a soft-cap, a large scale makes the cap bite.
        scale = (1.0, 0.5)[i % 2] if softcap else (None, 0.05, 0.3)[i % 3]
        cases.append(
            Case(
                lens=_FEATURE_LENS,
                heads=HEADS[(8, 4, 16, 5, 1)[i % 5]],
                head_size=HEAD_SIZES[i % 3],
                block_size=BLOCK_SIZES[(i + 2) % 3],
                layout=LAYOUTS[i % 3],
                kv_dtype=kv_dtype,
                q_dtype=FP8_DTYPE if kv_dtype == FP8_DTYPE and i % 2 else None,
                window=window,
                softcap=softcap,
                scale=scale,
            )
        )
    return cases


_MIXED_CASES = [
    Case(lens=MIXED, heads=(64, 8), block_size=64, layout=CacheLayout.HPC),
    Case(
        lens=MIXED,
        heads=(8, 1),
        kv_dtype=FP8_DTYPE,
        q_dtype=FP8_DTYPE,
        layout=CacheLayout.STACKED,
    ),
    Case(lens=RANDOM_24, heads=(40, 8), head_size=64, block_size=32, kv_dtype=FP16),
    Case(
        lens=RANDOM_24,
        heads=(32, 2),
        head_size=256,
        block_size=64,
        kv_dtype=FP8_DTYPE,
        layout=CacheLayout.HPC,
        spare_tokens=1000,
        spare_batch=5,
    ),
    # Decode-like rows: one query token each, after contexts of any length.
    Case(lens=tuple((1, n) for n in (1, 2, 1000, 7000, 64, 65)), heads=(16, 4)),
    Case(lens=RANDOM_9, heads=(8, 2), block_size=32, spare_batch=3),
]

# Outputs in the other 16-bit dtype than the queries.
_OUT_DTYPE_CASES = [
    Case(out_dtype=FP16),
    Case(kv_dtype=FP16, out_dtype=BF16, head_size=64, block_size=64),
    Case(
        lens=MIXED,
        kv_dtype=FP8_DTYPE,
        out_dtype=FP16,
        heads=(20, 4),
        layout=CacheLayout.HPC,
    ),
    Case(
        kv_dtype=FP8_DTYPE,
        q_dtype=FP16,
        out_dtype=BF16,
        head_size=256,
        block_size=32,
        layout=CacheLayout.STACKED,
    ),
]


@pytest.mark.parametrize("case", params(_length_cases()))
def test_query_lengths(case: Case) -> None:
    _run_and_check(case)


@pytest.mark.parametrize("case", params(_CHUNK_CASES))
def test_long_context_chunks(case: Case) -> None:
    _run_and_check(case)


@pytest.mark.parametrize("case", params(_shape_cases()))
def test_shapes(case: Case) -> None:
    _run_and_check(case)


@pytest.mark.parametrize("case", params(_fp8_cases()))
def test_fp8(case: Case) -> None:
    _run_and_check(case)


@pytest.mark.parametrize("case", params(_quantized_query_cases()))
def test_fp8_quantized_queries(case: Case) -> None:
    _run_and_check(case)


@pytest.mark.parametrize("case", params(_feature_cases()))
def test_window_softcap_scale(case: Case) -> None:
    _run_and_check(case)


@pytest.mark.parametrize("case", params(_MIXED_CASES))
def test_mixed_batches(case: Case) -> None:
    _run_and_check(case)


@pytest.mark.parametrize("case", params(_OUT_DTYPE_CASES))
def test_output_dtype(case: Case) -> None:
    _run_and_check(case)


_RERUN_CASES = [
    Case(lens=MIXED, heads=(16, 2)),
    Case(
        lens=RANDOM_9,
        heads=(10, 2),
        head_size=64,
        block_size=32,
        kv_dtype=FP8_DTYPE,
        q_dtype=FP8_DTYPE,
        layout=CacheLayout.HPC,
        window=100,
        softcap=30.0,
    ),
]


@pytest.mark.parametrize("case", params(_RERUN_CASES))
def test_reruns_write_the_same_bits(case: Case) -> None:
    """A run without the validation writes the first (validated) run's
    bits, and a second validated run writes them again (every tile is
    computed on its own, so the planner's order inside a cost bucket does
    not change the output)."""
    inputs = _run_and_check(case)
    first = inputs.out.clone()
    ws = case.workspace(inputs)
    for validate in (False, True):
        inputs.poison_out()
        _run(inputs, ws, validate=validate)
        torch.accelerator.synchronize()
        form = "validated" if validate else "unvalidated"
        assert bitwise_equal(inputs.out, first), (
            f"{case.id}: the {form} run differs from the first run"
        )


def test_case_ids_are_unique() -> None:
    cases = (
        _length_cases()
        + _CHUNK_CASES
        + _shape_cases()
        + _fp8_cases()
        + _quantized_query_cases()
        + _feature_cases()
        + _MIXED_CASES
        + _OUT_DTYPE_CASES
        + _RERUN_CASES
        + _GRAPH_CASES
    )
    ids = [case.id for case in cases]
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})


# ---------------------------------------------------------------------------
# CUDA graphs
# ---------------------------------------------------------------------------

# Four requests, 2048 query tokens in all, KV lengths up to 6144: every
# replay splits the same 2048 tokens differently.
_GRAPH_BATCH = 4
_GRAPH_TOKENS = 2048
_GRAPH_MAX_KV = 6144
_GRAPH_REPLAYS: list[Lens] = [
    ((2045, 2045), (1, 6000), (1, 1), (1, 300)),
    ((1000, 3048), (1000, 1000), (47, 6144), (1, 64)),
    ((64, 64), (65, 4161), (1790, 1790), (129, 129)),
    ((1, 6144), (1, 6144), (1, 6144), (2045, 6144)),
]


def _random_split(rng: random.Random) -> Lens:
    cuts = sorted(rng.sample(range(1, _GRAPH_TOKENS), _GRAPH_BATCH - 1))
    bounds = [0, *cuts, _GRAPH_TOKENS]
    q_lens = [bounds[i + 1] - bounds[i] for i in range(_GRAPH_BATCH)]
    return tuple((q, rng.randint(q, _GRAPH_MAX_KV)) for q in q_lens)


_GRAPH_CASES = [
    Case(lens=((512, 512),) * _GRAPH_BATCH),
    Case(
        lens=((512, 1024),) * _GRAPH_BATCH,
        heads=(16, 4),
        head_size=64,
        block_size=32,
        kv_dtype=FP8_DTYPE,
        q_dtype=FP8_DTYPE,
        layout=CacheLayout.HPC,
    ),
    Case(
        lens=((512, 3000),) * _GRAPH_BATCH,
        heads=(10, 2),
        head_size=256,
        block_size=64,
        kv_dtype=FP16,
        layout=CacheLayout.STACKED,
        window=100,
        softcap=30.0,
        scale=0.5,
    ),
]


@pytest.mark.parametrize("validate", [True, False], ids=["validated", "unvalidated"])
@pytest.mark.parametrize("case", params(_GRAPH_CASES))
def test_cuda_graph_replay(case: Case, validate: bool) -> None:
    """Capture ws.plan + prefill_attention once, then replay with new
    lengths (the same batch and token count, split differently), queries,
    block tables and cache contents written into the captured buffers."""
    blocks_per_request = -(-_GRAPH_MAX_KV // case.block_size)
    shape = dict(
        num_blocks=_GRAPH_BATCH * blocks_per_request + 4,
        max_blocks=blocks_per_request + 1,
    )
    static = case.build(**shape)
    assert static.batch == _GRAPH_BATCH and static.num_tokens == _GRAPH_TOKENS
    ws = case.workspace(static)

    graph = capture_graph(lambda: _run(static, ws, validate))

    replays = [*_GRAPH_REPLAYS, _random_split(random.Random(case.seed))]
    for i, lens in enumerate(replays, start=1):
        fresh = case.build(seed=case.seed + i, lens=lens, **shape)
        fresh.copy_into(static)
        static.poison_out()
        graph.replay()
        torch.accelerator.synchronize()
        print_check(static, f"{case.id} replay {i} lens={list(lens)}")
