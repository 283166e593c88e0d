# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Properties of the split-KV decode planner (host implementation).

Each plan is checked against an independent reconstruction: every CTA walks
its granule range from its first unit the way the decode kernel will, and the
pieces it finds must cover every tile of every (KV head, sequence) unit
exactly once, with the split table the combine reads; and every CTA's
first-item descriptor must be the first piece that walk finds.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import TYPE_CHECKING

import pytest
import torch

from tests.kernels.hpc.decode_reference import (
    DecodePlan,
    decode_item_fields,
    decode_plan_of,
    plan_decode_host,
)
from tests.kernels.hpc.utils import import_hpc_ops

hpc_ops = import_hpc_ops()

pytestmark = pytest.mark.skipif(
    not hpc_ops.hpc_ops_available(), reason="the _hpc_C library is not built"
)

TILE = hpc_ops.DECODE_TILE_TOKENS

if TYPE_CHECKING:
    from vllm._hpc_ops import SplitMode
else:
    SplitMode = hpc_ops.SplitMode


def plan_of(
    lens: list[int],
    num_kv_heads: int = 1,
    num_ctas: int = 132,
    min_split_len: int = 1024,
    fixed_split_len: int = 0,
    mode: SplitMode | None = None,
    window: int = 0,
    query_tokens: int = 1,
    group: int = 1,
    kv_element_bytes: int = 2,
) -> DecodePlan:
    kv_lens = torch.tensor(lens, dtype=torch.int32)
    plan = plan_decode_host(
        kv_lens,
        num_kv_heads,
        query_tokens,
        num_ctas,
        min_split_len=min_split_len,
        fixed_split_len=fixed_split_len,
        window=window,
        mode=mode,
        group=group,
        kv_element_bytes=kv_element_bytes,
    )
    units = len(lens) * num_kv_heads
    max_ctas, _ = workspace_sizes(lens, num_kv_heads, num_ctas, fixed_split_len, mode)
    return decode_plan_of(plan, units, max_ctas)


def workspace_sizes(
    lens: list[int],
    num_kv_heads: int,
    num_ctas: int,
    fixed_split_len: int,
    mode: SplitMode | None,
) -> tuple[int, int]:
    """The planner's (CTA slots, partial rows) for a cache holding exactly
    these sequences."""
    from vllm._hpc_ops_validation import validate_split_mode

    mode = validate_split_mode(mode, min_split_len=0, fixed_split_len=fixed_split_len)
    return hpc_ops.decode_workspace_sizes(
        mode,
        len(lens),
        num_kv_heads,
        max(1, sum(lens)),
        num_ctas,
        max(1, fixed_split_len // TILE),
    )


def first_visible(length: int, query_tokens: int, window: int) -> int:
    """First tile some query of a sequence can see (independent of the
    kernel): the first query, at length - query_tokens, sees back to
    window - 1 keys before it."""
    if window <= 0:
        return 0
    return max(0, length - query_tokens - window + 1) // TILE


def visible_tiles(length: int, query_tokens: int, window: int) -> int:
    """Tiles of a sequence some query can see (independent of the kernel)."""
    if length <= 0:
        return 0
    return math.ceil(length / TILE) - first_visible(length, query_tokens, window)


def tiles_per_granule(tiles: int, mode: SplitMode, fixed_split_len: int) -> int:
    if mode == SplitMode.BALANCED:
        return 1
    if mode == SplitMode.BATCH_INVARIANT:
        return fixed_split_len // TILE
    splits = min(16, max(1, math.ceil(tiles * TILE / 512)))
    return math.ceil(tiles / splits)


def walk(plan: DecodePlan) -> list[list[tuple[int, int, int]]]:
    """Per CTA, its pieces as (unit, first granule, end granule), in the
    unit's own granule numbering, found as the decode kernel will."""
    offsets = plan.unit_granule_offset.tolist()
    begins = plan.cta_granule_begin.tolist()
    first_units = plan.cta_first_unit.tolist()
    per_cta = []
    for c in range(plan.num_ctas):
        unit, x, end = first_units[c], begins[c], begins[c + 1]
        assert offsets[unit] <= x < offsets[unit + 1]
        pieces = []
        while x < end:
            while offsets[unit + 1] <= x:
                unit += 1
            stop = min(end, offsets[unit + 1])
            if plan.mode != SplitMode.BALANCED:
                # Every granule is its own piece.
                for g in range(x, stop):
                    pieces.append((unit, g - offsets[unit], g - offsets[unit] + 1))
            else:
                pieces.append((unit, x - offsets[unit], stop - offsets[unit]))
            x = stop
        per_cta.append(pieces)
    return per_cta


def merge_bound_tiles(max_unit_tiles: int, rows: int, kv_element_bytes: int) -> int:
    """The least S with S^2 x 32 x kv_element_bytes >= max_unit_tiles x rows:
    a unit's merge reads (T / S) x rows x 4 bytes per channel, a piece
    streams S x 128 x kv_element_bytes (decode_plan.h)."""
    need = max_unit_tiles * rows
    if need <= 0:
        return 0
    least_square = -(-need // (32 * kv_element_bytes))
    return math.isqrt(least_square - 1) + 1


def aligned_cut(
    unit_tiles: list[int], num_ctas: int, min_tiles: int
) -> tuple[int, int]:
    """The balanced plan's CTAs C for these units, and the unit-aligned
    piece length L that replaces it (0: none): the least L from the longest
    balanced range l0 up to l0 + ceil(l0 / 8) whose whole pieces fit every
    unit into C CTAs (decode_plan.h)."""
    total = sum(unit_tiles)
    if total == 0:
        return 0, 0
    ctas = min(num_ctas, max(1, total // max(1, min_tiles)))
    l0 = -(-total // ctas)
    for length in range(l0, l0 + -(-l0 // 8) + 1):
        if sum(-(-t // length) for t in unit_tiles) <= ctas:
            return ctas, length
    return ctas, 0


def check_plan(
    plan: DecodePlan,
    lens: list[int],
    num_kv_heads: int,
    num_ctas: int,
    min_split_len: int,
    fixed_split_len: int,
    mode: SplitMode | None = None,
    window: int = 0,
    query_tokens: int = 1,
    group: int = 1,
    kv_element_bytes: int = 2,
) -> None:
    if mode is None:
        mode = SplitMode.BATCH_INVARIANT if fixed_split_len else SplitMode.BALANCED
    batch = len(lens)
    tiles = [visible_tiles(n, query_tokens, window) for n in lens]
    if mode == SplitMode.BALANCED:
        min_tiles = max(
            min_split_len // TILE,
            merge_bound_tiles(
                max(tiles, default=0), query_tokens * group, kv_element_bytes
            ),
        )
        ctas, length = aligned_cut(tiles * num_kv_heads, num_ctas, min_tiles)
        if length:
            # Whole pieces fit: the batch-invariant plan with S = length.
            assert plan.mode == SplitMode.BATCH_INVARIANT
            check_plan(
                plan,
                lens,
                num_kv_heads,
                ctas,
                0,
                length * TILE,
                SplitMode.BATCH_INVARIANT,
                window,
                query_tokens,
            )
            return
    granules = [
        math.ceil(t / tiles_per_granule(t, mode, fixed_split_len)) if t else 0
        for t in tiles
    ]
    total = sum(granules) * num_kv_heads

    assert plan.num_units == batch * num_kv_heads
    assert plan.total_granules == total
    assert plan.mode == mode
    assert plan.window == window
    assert plan.query_tokens == query_tokens
    assert plan.split_tiles == (
        fixed_split_len // TILE if mode == SplitMode.BATCH_INVARIANT else 0
    )
    if mode == SplitMode.STATIC:
        expected_ctas = total
    elif mode == SplitMode.BATCH_INVARIANT:
        expected_ctas = min(num_ctas, total)
    else:
        split_tiles = max(
            1,
            min_split_len // TILE,
            merge_bound_tiles(
                max(tiles, default=0), query_tokens * group, kv_element_bytes
            ),
        )
        expected_ctas = min(num_ctas, max(1, total // split_tiles)) if total else 0
    assert plan.num_ctas == expected_ctas

    # Unit u = kv_head * batch + sequence, granules in that order.
    expected_offsets = [0]
    for u in range(batch * num_kv_heads):
        expected_offsets.append(expected_offsets[-1] + granules[u % batch])
    assert plan.unit_granule_offset.tolist() == expected_offsets

    # Balance: granule counts differ by at most one between CTAs.
    begins = plan.cta_granule_begin.tolist()
    counts = [begins[c + 1] - begins[c] for c in range(plan.num_ctas)]
    if counts:
        assert max(counts) - min(counts) <= 1
        assert min(counts) >= 1

    # Every granule of every unit exactly once; pieces per unit as planned.
    seen: dict[int, list[tuple[int, int]]] = {}
    for pieces in walk(plan):
        for unit, lo, hi in pieces:
            seen.setdefault(unit, []).append((lo, hi))
    num_pieces = plan.unit_num_pieces.tolist()
    first_partial = plan.unit_first_partial.tolist()
    next_partial = 0
    for u in range(batch * num_kv_heads):
        ranges = sorted(seen.get(u, []))
        covered = [g for lo, hi in ranges for g in range(lo, hi)]
        assert covered == list(range(granules[u % batch])), f"unit {u}"
        assert num_pieces[u] == len(ranges)
        if len(ranges) > 1:
            assert first_partial[u] == next_partial
            next_partial += len(ranges)
        else:
            assert first_partial[u] == -1
    assert plan.num_partials == next_partial

    check_first_items(plan, lens, fixed_split_len, mode, window, query_tokens)


def planned_and_checked(
    lens: list[int],
    num_kv_heads: int,
    num_ctas: int,
    min_split_len: int,
    fixed_split_len: int = 0,
    **shape: int,
) -> DecodePlan:
    """The host plan of ``lens``, after check_plan has checked it (``shape``:
    window, query_tokens, group, kv_element_bytes)."""
    plan = plan_of(
        lens, num_kv_heads, num_ctas, min_split_len, fixed_split_len, **shape
    )
    check_plan(
        plan, lens, num_kv_heads, num_ctas, min_split_len, fixed_split_len, **shape
    )
    return plan


# The descriptor of a CTA slot without work.
IDLE_ITEM = {
    "unit": -1,
    "kv_len": 0,
    "tile_begin": 0,
    "tile_end": 0,
    "pieces": 0,
    "first_partial": -1,
    "partial_row": -1,
    "mergers": 0,
}


def check_first_items(
    plan: DecodePlan,
    lens: list[int],
    fixed_split_len: int,
    mode: SplitMode,
    window: int,
    query_tokens: int,
) -> None:
    """Every CTA's descriptor is the first piece the walk finds for it, in
    tiles, with the piece's row among its unit's pieces (in granule order)
    and the unit's first partial row as the split table numbers them;
    every slot past the CTAs with work is marked idle."""
    batch = len(lens)
    per_cta = walk(plan)
    ranges: dict[int, list[tuple[int, int]]] = {}
    for pieces in per_cta:
        for unit, lo, hi in pieces:
            ranges.setdefault(unit, []).append((lo, hi))
    first_row: dict[int, int] = {}
    next_row = 0
    for unit in sorted(ranges):
        ranges[unit].sort()
        if len(ranges[unit]) > 1:
            first_row[unit] = next_row
            next_row += len(ranges[unit])

    # A unit's mergers: its first pieces, each its CTA's last, that share
    # the unit's merge. Balanced: every piece but the last continues into
    # the next CTA; the last counts when it ends its CTA's walk too. Other
    # modes: all pieces when each CTA holds one granule, else none.
    ends_walk = {piece for pieces in per_cta for piece in pieces[-1:]}
    one_granule_each = plan.num_ctas >= plan.total_granules
    mergers: dict[int, int] = {}
    for unit in first_row:
        ends = [(unit, lo, hi) in ends_walk for lo, hi in ranges[unit]]
        if plan.mode == SplitMode.BALANCED:
            mergers[unit] = len(ends) - 1 + ends[-1]
        else:
            mergers[unit] = len(ends) if one_granule_each else 0
        # Only a CTA with no work after the piece may wait for the others.
        assert all(ends[: mergers[unit]]), f"unit {unit}: {ends}"

    fields = decode_item_fields()
    items = [
        dict(zip(fields, row, strict=True)) for row in plan.cta_first_item.tolist()
    ]
    assert len(items) >= plan.num_ctas
    for c, pieces in enumerate(per_cta):
        assert pieces, f"CTA {c} has no work"
        unit, lo, hi = pieces[0]
        length = lens[unit % batch]
        tiles = visible_tiles(length, query_tokens, window)
        per = tiles_per_granule(tiles, mode, fixed_split_len)
        tile0 = first_visible(length, query_tokens, window)
        split = unit in first_row
        expected = {
            "unit": unit,
            "kv_len": length,
            "tile_begin": tile0 + lo * per,
            "tile_end": tile0 + min(hi * per, tiles),
            "pieces": len(ranges[unit]),
            "first_partial": first_row[unit] if split else -1,
            "partial_row": (
                first_row[unit] + ranges[unit].index((lo, hi)) if split else -1
            ),
            "mergers": mergers.get(unit, 0),
        }
        assert items[c] == expected, f"CTA {c}: {items[c]} != {expected}"
    for c in range(plan.num_ctas, len(items)):
        assert items[c] == IDLE_ITEM, f"idle CTA slot {c}: {items[c]}"


LENGTH_SETS = {
    "w1": [131072] + [4096] * 31,
    "edges": [1, 63, 64, 65, 127, 128, 129],
    "one-long": [131072],
    "one-token": [1],
    "empty-and-short": [0, 1, 0, 64],
    "all-empty": [0, 0, 0],
    "fewer-tiles-than-ctas": [64] * 5,
    "uniform-256": [4096] * 256,
    "ragged": [7, 100000, 3, 65536, 1, 2048, 70000],
}


WINDOWS_AND_QUERY_TOKENS = [(0, 1), (0, 3), (1000, 1), (100, 4)]


@pytest.mark.parametrize("lens", LENGTH_SETS.values(), ids=LENGTH_SETS.keys())
@pytest.mark.parametrize("num_kv_heads", [1, 8])
@pytest.mark.parametrize(
    ("min_split_len", "fixed_split_len"), [(1024, 0), (64, 0), (0, 0), (0, 1024)]
)
@pytest.mark.parametrize(("window", "query_tokens"), WINDOWS_AND_QUERY_TOKENS)
def test_plan_properties(
    lens: list[int],
    num_kv_heads: int,
    min_split_len: int,
    fixed_split_len: int,
    window: int,
    query_tokens: int,
) -> None:
    planned_and_checked(
        lens,
        num_kv_heads,
        132,
        min_split_len,
        fixed_split_len,
        window=window,
        query_tokens=query_tokens,
    )


@pytest.mark.parametrize("seed", range(20))
def test_plan_properties_random(seed: int) -> None:
    rng = random.Random(seed)
    batch = rng.randint(1, 300)
    lens = [rng.choice([0, 1, rng.randint(1, 200000)]) for _ in range(batch)]
    num_kv_heads = rng.choice([1, 2, 4, 8])
    num_ctas = rng.choice([1, 7, 132, 264, 396])
    min_split_len = TILE * rng.choice([0, 1, 4, 16, 64])
    fixed_split_len = rng.choice([0, 0, TILE * rng.choice([1, 8, 16])])
    query_tokens = rng.choice([1, 1, 2, 4])
    shape = dict(group=rng.choice([1, 4, 8, 16]), kv_element_bytes=rng.choice([1, 2]))
    planned_and_checked(
        lens,
        num_kv_heads,
        num_ctas,
        min_split_len,
        fixed_split_len,
        query_tokens=query_tokens,
        **shape,
    )


@pytest.mark.parametrize("seed", range(30))
def test_workspace_sizes_bound_every_plan(seed: int) -> None:
    """The partial rows and CTA slots a workspace is sized with hold every
    plan of a batch that fits its cache, in every mode."""
    rng = random.Random(seed)
    lens = [
        rng.choice([0, 1, 63, 64, 65, rng.randint(1, 70000)])
        for _ in range(rng.randint(1, 64))
    ]
    num_kv_heads = rng.choice([1, 2, 8])
    num_ctas = rng.choice([1, 7, 132, 264])
    mode = rng.choice(list(SplitMode))
    fixed = TILE * rng.choice([1, 2, 8]) if mode == SplitMode.BATCH_INVARIANT else 0
    min_split_len = TILE * rng.choice([0, 1, 16])
    plan_ctas, max_partials = workspace_sizes(lens, num_kv_heads, num_ctas, fixed, mode)
    plan = plan_of(lens, num_kv_heads, num_ctas, min_split_len, fixed, mode)
    check_plan(plan, lens, num_kv_heads, num_ctas, min_split_len, fixed, mode)
    assert plan.num_ctas <= plan_ctas
    assert plan.num_partials <= max_partials
    if mode == SplitMode.BALANCED:
        assert (plan_ctas, max_partials) == (num_ctas, 2 * num_ctas)


@pytest.mark.parametrize("lens", LENGTH_SETS.values(), ids=LENGTH_SETS.keys())
@pytest.mark.parametrize(("window", "query_tokens"), [(0, 1), (1000, 1), (100, 4)])
def test_static_mode(lens: list[int], window: int, query_tokens: int) -> None:
    """min(16, ceil(len / 512)) pieces per unit, one CTA each."""
    plan = plan_of(
        lens, 2, 132, mode=SplitMode.STATIC, window=window, query_tokens=query_tokens
    )
    check_plan(plan, lens, 2, 132, 1024, 0, SplitMode.STATIC, window, query_tokens)
    for u, length in enumerate(lens):
        tiles = visible_tiles(length, query_tokens, window)
        if tiles:
            per = tiles_per_granule(tiles, SplitMode.STATIC, 0)
            assert int(plan.unit_num_pieces[u]) == math.ceil(tiles / per) <= 16


@pytest.mark.parametrize("seed", range(10))
def test_window_skips_invisible_tiles(seed: int) -> None:
    rng = random.Random(seed)
    lens = [rng.randint(0, 50000) for _ in range(rng.randint(1, 40))]
    window = rng.choice([1, 63, 64, 65, 1000, 4096])
    query_tokens = rng.randint(1, 4)
    mode = rng.choice(list(SplitMode))
    fixed = TILE * 4 if mode == SplitMode.BATCH_INVARIANT else 0
    plan = plan_of(lens, 2, 50, 256, fixed, mode, window, query_tokens)
    check_plan(plan, lens, 2, 50, 256, fixed, mode, window, query_tokens)


def test_w1_balances_the_long_sequence() -> None:
    """One 128K sequence with 31 4K ones: the long one is cut over many CTAs
    and every CTA gets the same number of tiles within one."""
    lens = LENGTH_SETS["w1"]
    plan = plan_of(lens, num_kv_heads=1, num_ctas=264, min_split_len=1024)
    assert plan.num_ctas == (131072 + 31 * 4096) // 1024
    assert plan.unit_num_pieces[0] == 131072 // 1024


@pytest.mark.parametrize(
    ("lens", "query_tokens", "group", "kv_element_bytes", "ctas"),
    [
        # One 32K sequence: a 16-tile piece streams 2 MiB of bf16 K/V and
        # the merge of 32 such pieces reads 32 x 32 rows x 512 bytes.
        ([32768], 4, 8, 2, 32),
        ([32768], 1, 8, 2, 64),
        ([32768], 4, 8, 1, 22),
        # W1 at one query token: the merge asks for no more than the
        # CTAs' share (31 tiles); the plan is the unit-aligned one.
        (LENGTH_SETS["w1"], 1, 8, 2, 126),
        (LENGTH_SETS["w1"], 1, 8, 1, 126),
    ],
)
def test_merge_bounds_the_pieces_of_long_units(
    lens: list[int], query_tokens: int, group: int, kv_element_bytes: int, ctas: int
) -> None:
    """Units with many query rows are cut into fewer, longer pieces: the CTA
    that merges a unit reads all of its pieces alone."""
    plan = planned_and_checked(
        lens,
        1,
        132,
        256,
        query_tokens=query_tokens,
        group=group,
        kv_element_bytes=kv_element_bytes,
    )
    assert plan.num_ctas == ctas


@pytest.mark.parametrize(
    ("lens", "aligned_tiles", "ctas"),
    [
        # W1: 31-tile balanced ranges would leave most CTAs with the end of
        # one unit and the start of the next; pieces of 32 tiles give the
        # long unit 64 CTAs and every short one two.
        (LENGTH_SETS["w1"], 32, 126),
        # Eight equal units: 16 pieces of 32 tiles each instead of 17 or 18
        # ranges of 31 that cross unit boundaries.
        ([32768] * 8, 32, 128),
        # Many one-tile units beside a long one need more CTAs than offered
        # at any length within an eighth of 10 tiles: balanced ranges.
        ([64] * 200 + [64000], 0, 132),
    ],
)
def test_balanced_plans_align_to_units_when_whole_pieces_fit(
    lens: list[int], aligned_tiles: int, ctas: int
) -> None:
    """One work item per CTA where pieces of nearly the balanced length fit
    every unit into the balanced plan's CTAs."""
    plan = planned_and_checked(lens, 1, 132, 256)
    assert plan.num_ctas == ctas
    if aligned_tiles:
        assert plan.mode == SplitMode.BATCH_INVARIANT
        assert plan.split_tiles == aligned_tiles
        assert all(len(pieces) == 1 for pieces in walk(plan))
    else:
        assert plan.mode == SplitMode.BALANCED


@pytest.mark.parametrize("seed", range(5))
def test_batch_invariant_mode_ignores_neighbours(seed: int) -> None:
    """With a fixed split length, the pieces of a sequence, and so the order
    its partial results are combined in, are the same in any batch."""
    rng = random.Random(seed)
    target = rng.randint(1, 100000)
    split = TILE * 8
    alone = plan_of([target], 2, 132, 0, split)
    others = [rng.randint(0, 100000) for _ in range(rng.randint(1, 50))]
    position = rng.randint(0, len(others))
    batch = others[:position] + [target] + others[position:]
    mixed = plan_of(batch, 2, 132, 0, split)

    def pieces_of(plan: DecodePlan, unit: int) -> list[tuple[int, int]]:
        return sorted((lo, hi) for p in walk(plan) for u, lo, hi in p if u == unit)

    for head in range(2):
        assert pieces_of(alone, head) == pieces_of(mixed, head * len(batch) + position)


def test_plan_layout_keeps_offsets_and_aligns_descriptors() -> None:
    """The descriptors come after every other array, each on a 32-byte
    boundary, and end the plan."""
    for max_units, max_ctas in ((1, 1), (6, 16), (37, 132), (512, 8192)):
        layout = hpc_ops.decode_plan_layout(max_units, max_ctas)
        assert list(layout) == list(torch.ops._hpc_C.decode_plan_layout_fields())
        header, offset, pieces, partial, begin, first, item, size = (
            layout[name]
            for name in (
                "header",
                "unit_granule_offset",
                "unit_num_pieces",
                "unit_first_partial",
                "cta_granule_begin",
                "cta_first_unit",
                "cta_first_item",
                "size",
            )
        )
        assert (header, offset) == (8, 8)
        assert pieces == offset + max_units + 1
        assert partial == pieces + max_units
        assert begin == partial + max_units
        assert first == begin + max_ctas + 1
        assert first + max_ctas <= item < first + max_ctas + 8
        assert item % 8 == 0
        assert size == item + 8 * max_ctas
        assert hpc_ops.decode_plan_size(max_units, max_ctas) == size


def test_replan_rewrites_every_descriptor() -> None:
    """A smaller plan written over a larger one leaves no stale descriptor:
    the slots the larger plan used are marked idle again."""
    num_kv_heads, num_ctas = 2, 132
    big = torch.tensor([100000, 4096, 70, 5000], dtype=torch.int32)
    small = torch.tensor([64, 0], dtype=torch.int32)
    max_units = big.numel() * num_kv_heads
    buffer = torch.zeros(
        hpc_ops.decode_plan_size(max_units, num_ctas), dtype=torch.int32
    )
    for kv_lens in (big, small):
        torch.ops._hpc_C.plan_decode(
            kv_lens, buffer, num_kv_heads, 1, 0, num_ctas, max_units, 1, 0, 0, 1, 2
        )
    fresh = plan_decode_host(
        small, num_kv_heads, 1, num_ctas, min_split_len=64, max_batch=big.numel()
    )
    replanned = decode_plan_of(buffer, max_units, num_ctas)
    assert replanned.num_ctas == 2
    assert torch.equal(
        replanned.cta_first_item,
        decode_plan_of(fresh, max_units, num_ctas).cta_first_item,
    )
    check_plan(replanned, small.tolist(), num_kv_heads, num_ctas, 64, 0)


@pytest.mark.parametrize("field", range(8))
def test_first_item_check_detects_a_wrong_descriptor(field: int) -> None:
    """The descriptor check fails when any word of a working CTA's
    descriptor or of an idle slot is off by one."""
    lens = [7, 100000, 3, 65536, 0, 2048]
    plan = plan_of(lens, 2, 132, 256, 0, window=1000, query_tokens=2)
    check_plan(plan, lens, 2, 132, 256, 0, window=1000, query_tokens=2)
    assert 0 < plan.num_ctas < plan.cta_first_item.shape[0]
    for c in (0, plan.num_ctas // 2, plan.num_ctas):
        items = plan.cta_first_item.clone()
        items[c, field] += 1
        tampered = dataclasses.replace(plan, cta_first_item=items)
        with pytest.raises(AssertionError):
            check_first_items(tampered, lens, 0, SplitMode.BALANCED, 1000, 2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kv_lens": torch.tensor([1], dtype=torch.int64)}, "kv_lens"),
        ({"kv_lens": torch.tensor([[1]], dtype=torch.int32)}, "kv_lens"),
        ({"num_kv_heads": 0}, "num_kv_heads"),
        ({"query_tokens": 9}, "query_tokens"),
        ({"query_tokens": 0}, "query_tokens"),
        ({"num_ctas": 0}, "num_ctas"),
        ({"min_split_len": 100}, "min_split_len"),
        ({"fixed_split_len": -64}, "fixed_split_len"),
        ({"max_batch": 0}, "max_batch"),
        ({"window": -1}, "window"),
        ({"mode": SplitMode.BATCH_INVARIANT}, "fixed_split_len"),
    ],
)
def test_plan_validation(kwargs: dict, match: str) -> None:
    args = {
        "kv_lens": torch.tensor([100, 200], dtype=torch.int32),
        "num_kv_heads": 1,
        "query_tokens": 1,
        "num_ctas": 8,
    }
    args.update(kwargs)
    positional = [args.pop(k) for k in ("kv_lens", "num_kv_heads", "query_tokens")]
    positional.append(args.pop("num_ctas"))
    with pytest.raises(ValueError, match=match):
        plan_decode_host(*positional, **args)


def test_plan_op_schema_and_fake() -> None:
    kv_lens = torch.tensor([100, 5000, 1], dtype=torch.int32)
    size = hpc_ops.decode_plan_size(3 * 2, 16)
    plan = torch.zeros(size, dtype=torch.int32)
    torch.library.opcheck(
        torch.ops._hpc_C.plan_decode.default,
        (kv_lens, plan, 2, 1, 0, 16, 6, 1, 0, 0, 4, 1),
        test_utils=("test_schema", "test_faketensor"),
    )
