# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GPU tests of split-KV paged decode attention against the float64 reference.

Each case draws fresh random inputs from a seeded generator, shuffles the
cache blocks through the block table, fills unused blocks and the slots past
each sequence's length with NaN, NaN-poisons ``out``, runs the GPU planner
and ``decode_attention`` and checks (``decode_reference.check_decode``):
relative error <= 1e-2 (bf16/fp16) or 3e-2 (FP8) over the whole output and
over each sequence, a bound on the largest absolute error, no NaN or Inf, and
exact zeros for sequences with no KV.

The axes are combined in small grids rather than a full product: KV lengths
around the 64-token tile (up to 131072), head sizes x GQA ratios x block
sizes x cache layouts, query tokens x GQA ratios, FP8 caches with bf16, fp16
and FP8 queries, sliding windows, soft-cap and scales, and the split modes
with small CTA counts. Plus: the GPU planner is bitwise equal to the host
planner, CUDA-graph capture and replay with new lengths, batch invariance of
the batch-invariant mode, and empty sequences.

Imports only torch, the references, ``utils``, ``vllm._hpc_ops`` and the
attention workspaces (``vllm.v1.attention.ops.hpc_attn_workspace``).
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from typing import Any

import pytest
import torch

from tests.kernels.hpc.decode_reference import (
    DecodeInputs,
    decode_plan_of,
    make_decode_inputs,
    plan_decode_host,
    read_decode_plan,
)
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
from vllm._hpc_ops import SplitMode, decode_attention, decode_plan_size
from vllm._hpc_ops_validation import validate_decode_attention
from vllm.v1.attention.ops.hpc_attn_workspace import DecodeWorkspace

pytestmark = pytest.mark.gpu

_rng = random.Random(20240611)
MIXED = (1, 63, 64, 65, 700, 2049)
RANDOM_32 = tuple(_rng.randint(4, 5000) for _ in range(32))
RANDOM_12 = tuple(_rng.randint(4, 3000) for _ in range(12))
LONG = 131072


def _lens_id(lens: tuple[int, ...]) -> str:
    if len(lens) <= 6:
        return "L" + "-".join(str(n) for n in lens)
    return f"B{len(lens)}s{sum(lens)}"


@dataclasses.dataclass(frozen=True)
class Case:
    lens: tuple[int, ...] = MIXED
    heads: tuple[int, int] = (16, 2)
    head_size: int = 128
    block_size: int = 16
    query_tokens: int = 1
    kv_dtype: torch.dtype = BF16
    q_dtype: torch.dtype | None = None
    out_dtype: torch.dtype | None = None
    layout: CacheLayout = CacheLayout.SEPARATE
    window: int = 0
    softcap: float = 0.0
    scale: float | None = None
    mode: SplitMode = SplitMode.BALANCED
    fixed_split_len: int = 0
    min_split_len: int = 256
    num_ctas: int | None = None
    # Workspace sized for more sequences / query tokens than the call uses.
    spare_batch: int = 0
    spare_query_tokens: int = 0

    @property
    def id(self) -> str:
        parts = [
            _lens_id(self.lens),
            f"h{self.heads[0]}x{self.heads[1]}",
            f"d{self.head_size}",
            f"b{self.block_size}",
            f"q{self.query_tokens}",
            f"kv-{DTYPE_NAMES[self.kv_dtype]}",
            self.layout.value,
            *option_id_parts(self),
        ]
        if self.mode == SplitMode.BATCH_INVARIANT:
            parts.append(f"inv{self.fixed_split_len}")
        elif self.mode == SplitMode.STATIC:
            parts.append("static")
        else:
            parts.append("bal")
        if self.min_split_len != 256:
            parts.append(f"min{self.min_split_len}")
        if self.num_ctas is not None:
            parts.append(f"ctas{self.num_ctas}")
        if self.spare_batch or self.spare_query_tokens:
            parts.append(f"spare{self.spare_batch}x{self.spare_query_tokens}")
        return "-".join(parts)

    def build(self, seed: int = 0, **overrides: object) -> DecodeInputs:
        kwargs = build_kwargs(self, seed)
        kwargs["query_tokens"] = self.query_tokens
        kwargs.update(overrides)
        lens = kwargs.pop("lens", self.lens)
        return make_decode_inputs(lens, **kwargs)  # type: ignore[arg-type]

    def workspace(self, inputs: DecodeInputs) -> DecodeWorkspace:
        kwargs = inputs.workspace_kwargs()
        kwargs["max_batch"] = inputs.batch + self.spare_batch
        kwargs["max_query_tokens"] = self.query_tokens + self.spare_query_tokens
        return DecodeWorkspace.create(
            **kwargs,  # type: ignore[arg-type]
            mode=self.mode,
            min_split_len=self.min_split_len,
            fixed_split_len=self.fixed_split_len,
            num_ctas=self.num_ctas,
        )


def _run(inputs: DecodeInputs, ws: DecodeWorkspace) -> None:
    ws.plan(inputs.kv_lens, inputs.query_tokens)
    validate_decode_attention(*inputs.op_args(), ws, **inputs.op_kwargs())
    decode_attention(*inputs.op_args(), ws, **inputs.op_kwargs())


def _run_and_check(case: Case, seed: int = 0) -> DecodeInputs:
    inputs = case.build(seed=seed)
    ws = case.workspace(inputs)
    return run_and_check(inputs, case.id, lambda: _run(inputs, ws))


# ---------------------------------------------------------------------------
# Case grids
# ---------------------------------------------------------------------------


def _length_cases() -> list[Case]:
    """Lengths around the 64-token tile and mixed batches, bf16 and fp16;
    plus two 131072-token cases."""
    sets = ((1,), (63,), (64,), (65,), (4096,), (1, 63, 64, 65, 4096), RANDOM_32)
    cases = []
    for i, (lens, dtype) in enumerate(itertools.product(sets, (BF16, FP16))):
        cases.append(
            Case(
                lens=lens,
                kv_dtype=dtype,
                block_size=BLOCK_SIZES[i % 3],
                layout=LAYOUTS[(i // 2) % 3],
            )
        )
    cases.append(Case(lens=(LONG,), block_size=64, layout=CacheLayout.HPC))
    cases.append(
        Case(
            lens=(LONG, 2, 63, 65, 4096),
            kv_dtype=FP8_DTYPE,
            query_tokens=2,
            block_size=32,
            layout=CacheLayout.STACKED,
            mode=SplitMode.BATCH_INVARIANT,
            fixed_split_len=1024,
        )
    )
    return cases


def _shape_cases() -> list[Case]:
    """Every head size x GQA ratio, cycling block sizes, layouts and dtypes;
    plus other KV head counts."""
    cases = head_grid_cases(Case)
    for i, heads in enumerate(((8, 1), (64, 8), (40, 8), (4, 4))):
        cases.append(
            Case(
                heads=heads,
                head_size=HEAD_SIZES[i % 3],
                block_size=BLOCK_SIZES[(i + 1) % 3],
                layout=LAYOUTS[i % 3],
                kv_dtype=(FP16, BF16)[i % 2],
                spare_batch=3 if i % 2 else 0,
            )
        )
    return cases


def _query_token_cases() -> list[Case]:
    """Query tokens 1..8 x every GQA ratio with q x ratio <= 64 rows (the
    decode tile), cycling head sizes, block sizes, layouts and cache
    dtypes."""
    cases = []
    kv_dtypes = (BF16, FP16, FP8_DTYPE)
    pairs = [
        (q, ratio)
        for q, ratio in itertools.product(range(1, 9), RATIOS)
        if q * ratio <= 64
    ]
    for i, (q, ratio) in enumerate(pairs):
        kv_dtype = kv_dtypes[i % 3]
        q_dtype = FP8_DTYPE if kv_dtype == FP8_DTYPE and i % 2 else None
        spare_q = 1 if q < 8 and (q + 1) * ratio <= 64 and i % 4 == 1 else 0
        cases.append(
            Case(
                lens=(q, 63, 64, 65, 1000, 3000),
                heads=HEADS[ratio],
                query_tokens=q,
                head_size=HEAD_SIZES[i % 3],
                block_size=BLOCK_SIZES[(i // 3) % 3],
                layout=LAYOUTS[(i + 1) % 3],
                kv_dtype=kv_dtype,
                q_dtype=q_dtype,
                spare_query_tokens=spare_q,
            )
        )
    return cases


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
        ratio = RATIOS[i % 5]
        cases.append(
            Case(
                heads=HEADS[ratio],
                head_size=head_size,
                kv_dtype=FP8_DTYPE,
                q_dtype=q_dtype,
                out_dtype=out_dtype,
                query_tokens=1 + i % 2,
                block_size=BLOCK_SIZES[i % 3],
                layout=LAYOUTS[(i // 3) % 3],
                lens=(2, 63, 64, 65, 700, 2049) if i % 2 else RANDOM_12,
            )
        )
    return cases


def _feature_cases() -> list[Case]:
    """Sliding windows x soft-cap x cache dtype, with scales other than
    1/sqrt(D), query tokens and split modes cycling."""
    modes = (
        (SplitMode.BALANCED, 0),
        (SplitMode.BATCH_INVARIANT, 256),
        (SplitMode.STATIC, 0),
    )
    cases = []
    combos = [
        (w, c) for w, c in itertools.product((0, 100, 1000), (0.0, 30.0)) if w or c
    ]
    for i, ((window, softcap), kv_dtype) in enumerate(
        itertools.product(combos, (BF16, FP16, FP8_DTYPE))
    ):
        q = 1 + i % 4
        ratio = (8, 4, 16, 5, 1)[i % 5]
        mode, fixed = modes[i % 3]
        # With a soft-cap, a large scale makes the cap bite.
        scale = (1.0, 0.5)[i % 2] if softcap else (None, 0.05, 0.3)[i % 3]
        cases.append(
            Case(
                lens=(4, 99, 100, 101, 999, 1000, 1001, 5000, 20000),
                heads=HEADS[ratio],
                query_tokens=q,
                head_size=HEAD_SIZES[i % 3],
                block_size=BLOCK_SIZES[(i + 2) % 3],
                layout=LAYOUTS[i % 3],
                kv_dtype=kv_dtype,
                q_dtype=FP8_DTYPE if kv_dtype == FP8_DTYPE and i % 2 else None,
                window=window,
                softcap=softcap,
                scale=scale,
                mode=mode,
                fixed_split_len=fixed,
            )
        )
    return cases


def _mode_cases() -> list[Case]:
    """Every split mode, a few split lengths and small CTA counts (many
    pieces per CTA), with bf16 and FP8 (FP8 queries)."""
    modes: tuple[dict[str, Any], ...] = (
        dict(),
        dict(min_split_len=64),
        dict(min_split_len=1024),
        dict(num_ctas=3),
        dict(num_ctas=1),
        dict(mode=SplitMode.BATCH_INVARIANT, fixed_split_len=256),
        dict(mode=SplitMode.BATCH_INVARIANT, fixed_split_len=1024),
        dict(mode=SplitMode.BATCH_INVARIANT, fixed_split_len=256, num_ctas=3),
        dict(mode=SplitMode.BATCH_INVARIANT, fixed_split_len=64, num_ctas=7),
        dict(mode=SplitMode.STATIC),
    )
    lens_sets = (RANDOM_32, (5000, 70, 3, 12000))
    cases = []
    for i, (mode, fp8) in enumerate(itertools.product(modes, (False, True))):
        cases.append(
            Case(
                lens=lens_sets[i % 2],
                heads=HEADS[(8, 4, 1)[i % 3]],
                head_size=HEAD_SIZES[(i // 2) % 3],
                block_size=BLOCK_SIZES[i % 3],
                layout=LAYOUTS[(i // 3) % 3],
                kv_dtype=FP8_DTYPE if fp8 else BF16,
                q_dtype=FP8_DTYPE if fp8 else None,
                query_tokens=1 + (i // 4) % 2,
                spare_batch=2 if i % 5 == 0 else 0,
                **mode,  # type: ignore[arg-type]
            )
        )
    return cases


@pytest.mark.parametrize("case", params(_length_cases()))
def test_lengths(case: Case) -> None:
    _run_and_check(case)


@pytest.mark.parametrize("case", params(_shape_cases()))
def test_shapes(case: Case) -> None:
    _run_and_check(case)


@pytest.mark.parametrize("case", params(_query_token_cases()))
def test_query_tokens(case: Case) -> None:
    _run_and_check(case)


@pytest.mark.parametrize("case", params(_fp8_cases()))
def test_fp8(case: Case) -> None:
    _run_and_check(case)


@pytest.mark.parametrize("case", params(_feature_cases()))
def test_window_softcap_scale(case: Case) -> None:
    _run_and_check(case)


@pytest.mark.parametrize("case", params(_mode_cases()))
def test_split_modes(case: Case) -> None:
    _run_and_check(case)


_EMPTY_CASES = [
    Case(lens=(0, 65, 0, 1000, 0, 1)),
    Case(
        lens=(0, 300, 0, 4096),
        query_tokens=2,
        kv_dtype=FP8_DTYPE,
        q_dtype=FP8_DTYPE,
        layout=CacheLayout.HPC,
        mode=SplitMode.BATCH_INVARIANT,
        fixed_split_len=256,
    ),
    Case(
        lens=(2000, 0, 0),
        kv_dtype=FP16,
        head_size=64,
        block_size=64,
        mode=SplitMode.STATIC,
    ),
    Case(lens=(0, 5000, 0, 64, 0), num_ctas=3, heads=(8, 2), query_tokens=3),
    Case(lens=(0, 0, 0), layout=CacheLayout.STACKED),
]


@pytest.mark.parametrize("case", params(_EMPTY_CASES))
def test_empty_sequences(case: Case) -> None:
    """Sequences of KV length 0 get zeros; the others are still right
    (check_decode requires exact zeros for them)."""
    _run_and_check(case)


def test_case_ids_are_unique() -> None:
    cases = (
        _length_cases()
        + _shape_cases()
        + _query_token_cases()
        + _fp8_cases()
        + _feature_cases()
        + _mode_cases()
        + _EMPTY_CASES
    )
    ids = [case.id for case in cases]
    assert len(ids) == len(set(ids))


# ---------------------------------------------------------------------------
# GPU planner against the host planner
# ---------------------------------------------------------------------------


def _plan_words(plan: torch.Tensor, max_units: int, max_ctas: int) -> torch.Tensor:
    """The words a plan defines: the header, each array up to its live
    length (the tails past the live lengths are never written) and every
    CTA slot's first-item descriptor (all rewritten by each plan)."""
    view = decode_plan_of(plan, max_units, max_ctas)
    return torch.cat(
        [
            plan.cpu()[:8],
            view.unit_granule_offset,
            view.unit_num_pieces,
            view.unit_first_partial,
            view.cta_granule_begin,
            view.cta_first_unit,
            view.cta_first_item.flatten(),
        ]
    )


_prng = random.Random(7)
PLAN_LENGTH_SETS = {
    "random": [_prng.randint(0, 20000) for _ in range(37)],
    "zeros": [0, 5, 0, 0, 1000, 0, 64, 0],
    "all-zero": [0] * 9,
    "all-one": [1] * 64,
    "huge-and-small": [LONG] + [_prng.randint(1, 80) for _ in range(60)],
    "tile-edges": [63, 64, 65, 127, 128, 129, 255, 256, 257, 1023, 1024, 1025],
    # More units than the planner has threads: several units per thread.
    "many": [_prng.randint(0, 4096) for _ in range(700)],
}
PLAN_MODES = {
    "bal": dict(mode=SplitMode.BALANCED),
    # FP8 caches weigh the merge against half the bytes per tile.
    "bal-fp8": dict(mode=SplitMode.BALANCED, kv_cache_dtype=torch.float8_e4m3fn),
    "bal-min64-ctas3": dict(mode=SplitMode.BALANCED, min_split_len=64, num_ctas=3),
    "inv256": dict(mode=SplitMode.BATCH_INVARIANT, fixed_split_len=256),
    "inv1024-ctas5": dict(
        mode=SplitMode.BATCH_INVARIANT, fixed_split_len=1024, num_ctas=5
    ),
    "static": dict(mode=SplitMode.STATIC),
}


@pytest.mark.parametrize("mode_name", list(PLAN_MODES))
@pytest.mark.parametrize("set_name", list(PLAN_LENGTH_SETS))
def test_gpu_plan_matches_host(set_name: str, mode_name: str) -> None:
    """The GPU planner writes the host planner's plan, bit for bit, for
    windows and query-token counts (the whole buffer of a fresh workspace),
    also re-planning a smaller batch into a workspace that held a larger
    plan."""
    lens = PLAN_LENGTH_SETS[set_name]
    mode_kwargs = PLAN_MODES[mode_name]
    num_kv_heads = 2 if len(lens) > 100 else 4
    batch = len(lens)
    for window, query_tokens in ((0, 1), (100, 1), (1000, 4), (0, 3)):
        ws = DecodeWorkspace.create(
            max_batch=batch + 2,
            num_q_heads=num_kv_heads * 4,
            num_kv_heads=num_kv_heads,
            head_size=128,
            max_kv_tokens=sum(lens) + 64 * batch,
            device="cuda",
            max_query_tokens=4,
            window=window,
            **mode_kwargs,  # type: ignore[arg-type]
        )
        # The second plan is written over the first: only the words it
        # defines are compared.
        for fresh, sub in ((True, lens), (False, lens[: max(1, batch // 2)][::-1])):
            kv_lens = torch.tensor(sub, dtype=torch.int32)
            ws.plan(kv_lens.cuda(), query_tokens)
            gpu = ws.plan_buffer.cpu()
            host = plan_decode_host(
                kv_lens,
                num_kv_heads,
                query_tokens,
                ws.num_ctas,
                min_split_len=ws.min_split_tiles * 64,
                fixed_split_len=ws.split_tiles * 64,
                max_batch=ws.max_batch,
                window=window,
                mode=ws.mode,
                group=ws.num_q_heads // ws.num_kv_heads,
                kv_element_bytes=ws.kv_element_bytes,
            )
            what = (
                f"{set_name} {mode_name} window={window} q={query_tokens} "
                f"batch={len(sub)}"
            )
            assert (
                host.shape
                == gpu.shape
                == (decode_plan_size(ws.max_units, ws.max_ctas),)
            ), what
            host_words = _plan_words(host, ws.max_units, ws.max_ctas)
            gpu_words = _plan_words(gpu, ws.max_units, ws.max_ctas)
            assert torch.equal(host_words, gpu_words), what
            if fresh:
                # Both buffers start zeroed: equal word for word.
                assert torch.equal(host, gpu), what
            plan = read_decode_plan(ws)
            assert plan.num_units == len(sub) * num_kv_heads, what
            # A balanced request may be cut unit-aligned (batch-invariant
            # form, decode_plan.h).
            assert plan.mode in (
                (int(ws.mode), int(SplitMode.BATCH_INVARIANT))
                if ws.mode == SplitMode.BALANCED
                else (int(ws.mode),)
            ), what
            assert plan.window == window, what
            assert plan.query_tokens == query_tokens, what


# ---------------------------------------------------------------------------
# CUDA graphs
# ---------------------------------------------------------------------------

_GRAPH_CASES = [
    Case(lens=(3000,) * 6),
    Case(
        lens=(3000,) * 6,
        heads=(16, 4),
        head_size=64,
        block_size=32,
        query_tokens=2,
        kv_dtype=FP8_DTYPE,
        q_dtype=FP8_DTYPE,
        layout=CacheLayout.HPC,
        mode=SplitMode.BATCH_INVARIANT,
        fixed_split_len=256,
    ),
    Case(
        lens=(3000,) * 6,
        heads=(10, 2),
        head_size=256,
        block_size=64,
        kv_dtype=FP16,
        layout=CacheLayout.STACKED,
        window=100,
        softcap=30.0,
        scale=0.5,
        mode=SplitMode.STATIC,
    ),
]


@pytest.mark.parametrize("case", params(_GRAPH_CASES))
def test_cuda_graph_replay(case: Case) -> None:
    """Capture ws.plan + decode_attention once, then replay with new
    lengths (the plan changes shape), queries and cache contents."""
    max_len = max(case.lens)
    batch = len(case.lens)
    blocks_per_seq = -(-max_len // case.block_size)
    shape = dict(num_blocks=batch * blocks_per_seq + 4, max_blocks=blocks_per_seq + 1)
    static = case.build(seed=0, **shape)
    ws = case.workspace(static)

    graph = capture_graph(lambda: _run(static, ws))

    q = case.query_tokens
    replays = [
        [max_len] * batch,
        [q, max_len, 64, 65, 1, 1000][:batch],
        [0, 2999, 0, 257, 1500, 63][:batch],
        [q] * batch,
    ]
    rng = random.Random(5)
    replays.append([rng.randint(q, max_len) for _ in range(batch)])
    for seed, lens in enumerate(replays, start=1):
        lens = [max(n, q) if n else 0 for n in lens]
        fresh = case.build(seed=seed, lens=lens, **shape)
        fresh.copy_into(static)
        static.poison_out()
        graph.replay()
        torch.accelerator.synchronize()
        print_check(static, f"{case.id} replay {seed} lens={lens}")


# ---------------------------------------------------------------------------
# Batch invariance
# ---------------------------------------------------------------------------

_INVARIANCE_CASES = [
    Case(lens=(5000,), mode=SplitMode.BATCH_INVARIANT, fixed_split_len=256),
    Case(
        lens=(5000,),
        mode=SplitMode.BATCH_INVARIANT,
        fixed_split_len=1024,
        kv_dtype=FP8_DTYPE,
        q_dtype=FP8_DTYPE,
        head_size=64,
        heads=(8, 1),
        query_tokens=2,
        layout=CacheLayout.HPC,
    ),
    Case(
        lens=(5000,),
        mode=SplitMode.BATCH_INVARIANT,
        fixed_split_len=256,
        kv_dtype=FP16,
        heads=(8, 2),
        query_tokens=4,
        window=1000,
        block_size=32,
        layout=CacheLayout.STACKED,
    ),
    Case(
        lens=(5000,),
        mode=SplitMode.BATCH_INVARIANT,
        fixed_split_len=1024,
        head_size=256,
        heads=(32, 2),
        block_size=64,
        num_ctas=3,
    ),
]


def _subset(inputs: DecodeInputs, order: list[int]) -> DecodeInputs:
    """The sequences ``order`` of ``inputs`` as a batch of their own, over
    the same cache (contiguous copies of the per-sequence tensors)."""
    q = inputs.query_tokens
    idx = torch.tensor(order, dtype=torch.long, device=inputs.q.device)
    rows = (idx[:, None] * q + torch.arange(q, device=idx.device)).flatten()
    return dataclasses.replace(
        inputs,
        lens=[inputs.lens[i] for i in order],
        q=inputs.q[rows].contiguous(),
        q_scale=None if inputs.q_scale is None else inputs.q_scale[rows].contiguous(),
        block_table=inputs.block_table[idx].contiguous(),
        kv_lens=inputs.kv_lens[idx].contiguous(),
        out=torch.empty_like(inputs.out[rows]),
    )


@pytest.mark.parametrize("case", params(_INVARIANCE_CASES))
def test_batch_invariance(case: Case) -> None:
    """A sequence's output rows are bitwise the same alone and batched with
    other random sequences (two batches, the sequence at different
    positions), through one workspace."""
    q = case.query_tokens
    rng = random.Random(11)
    others = [rng.choice((q, 64, rng.randint(q, 9000))) for _ in range(17)]
    # Sequence 0 is the one under test.
    inputs = case.build(lens=[case.lens[0], *others])
    batches = (
        [0],
        [5, 1, 9, 0, 2, 11, 3, 17, 4, 6, 16, 8],
        [0, 13, 7, 15, 10, 12, 14],
    )
    kwargs = inputs.workspace_kwargs()
    kwargs["max_batch"] = max(len(order) for order in batches)
    ws = DecodeWorkspace.create(
        **kwargs,  # type: ignore[arg-type]
        mode=case.mode,
        fixed_split_len=case.fixed_split_len,
        num_ctas=case.num_ctas,
    )
    results = []
    for order in batches:
        sub = _subset(inputs, order)
        sub.poison_out()
        _run(sub, ws)
        torch.accelerator.synchronize()
        print_check(sub, f"{case.id} batch {order}")
        pos = order.index(0)
        results.append(sub.out[pos * q : (pos + 1) * q])
    for order, rows in zip(batches[1:], results[1:], strict=True):
        assert bitwise_equal(rows, results[0]), (
            f"{case.id}: the sequence's rows differ alone and in batch {order}"
        )


# Long sequences in a full batch, four query tokens of GQA 8 (32 rows), the
# benchmark's cache layout: every CTA holds pieces of two or three units.
_REPEATED_CASES = [
    Case(
        lens=(32768,) * 8,
        heads=(64, 8),
        query_tokens=4,
        block_size=64,
        layout=CacheLayout.HPC,
    ),
    Case(
        lens=(32768,) * 8,
        heads=(64, 8),
        query_tokens=2,
        block_size=64,
        layout=CacheLayout.HPC,
    ),
]


@pytest.mark.parametrize("case", params(_REPEATED_CASES))
def test_repeated_calls(case: Case) -> None:
    """One plan, many calls, as a step's layers make them: the first call
    against the reference, every later one bitwise equal to it (the merge
    sums pieces in a fixed order), and the piece counters back at zero after
    each."""
    inputs = case.build()
    ws = case.workspace(inputs)
    ws.plan(inputs.kv_lens, inputs.query_tokens)
    validate_decode_attention(*inputs.op_args(), ws, **inputs.op_kwargs())

    def call() -> None:
        decode_attention(*inputs.op_args(), ws, **inputs.op_kwargs())

    run_and_check(inputs, case.id, call)
    first = inputs.out.clone()
    for n in range(1, 24):
        inputs.poison_out()
        call()
        torch.accelerator.synchronize()
        assert bitwise_equal(inputs.out, first), f"{case.id}: call {n} differs"
        assert int(ws.piece_counters.count_nonzero()) == 0, (
            f"{case.id}: call {n} left piece counters set"
        )
