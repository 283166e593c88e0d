# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Calibration of the decode kernel's ceilings (workload CAL).

What one call can cost at best on this GPU, measured in one process and timed
as ``benchmark_hpc_decode.py`` times its calls (CUDA-graph replays timed one
by one with CUDA events, warm-up, median of at least 50; input sets rotated
round-robin, at least 4 and enough for 240 MB, fewer where memory runs out;
L2 scrubbed before each replay when the rotation is under four times L2):

* ``empty-graph``: a graph holding one empty kernel, the fixed cost that every
  single-call replay carries (submission and the event window), and
  ``empty-graph-x64``: a graph of 64 empty kernels, whose ``us_per_kernel``
  is what one more kernel costs inside a graph. Impl ``empty_kernel``.
* Read streams over exactly the K and V bytes of a decode case (the decode
  benchmark's floor bytes: every token of every sequence, each KV head, K
  and V once): W1's lengths (``w1``) and 256 sequences of 32768 tokens
  (``b256x32768``), ``tp1`` and ``tp8`` heads, bf16 and fp8 caches, block
  size 64, each sequence's blocks shuffled over the cache as in the
  benchmark. Cases ``<tp1|tp8>-<bf16|fp8>-<w1|b256x32768>-<layout>``, two
  layouts:

  - ``packed``: the decode benchmark's cache, one ``(num_blocks, Hkv, 64,
    2 * D)`` tensor: each page of a head holds every token's K row followed
    by its V row (vLLM 0.33's FLASH_ATTN and HPC_ATTN layout, whose K and V
    are ``[num_blocks, 64, Hkv, D]`` views with a 2 * D token stride);
  - ``separate``: K and V caches of their own, ``(num_blocks, Hkv, 64, D)``
    each, so a head's page of K is one contiguous run.

  Implementations on the same caches:

  - ``triton_read``: one program per (page, KV head), pages in block-table
    order, loading the page's 64-token K tile and V tile once (as int32
    words, whatever the cache dtype) and writing their XOR (one int32): the
    plain stream of the decode kernel's access pattern, with no math;
  - ``torch_copy``: ``Tensor.copy_`` of the cache tensors into a spare
    buffer, for reference (its ``tbps`` counts bytes read and written);
  - ``hpc``: the decode benchmark's ``decode_attention`` call (balanced
    split, one query token per sequence, planned before capture), checked
    against its float32 reference first.

  Each record has ``bytes`` (K and V read), ``tbps`` (bytes moved per
  second, 1e12) and, as everywhere, ``floor_us``: the bytes at the
  device-to-device copy bandwidth measured in the same run. The ``hpc``
  record's ratios are each stream's time over the kernel's (below 1: the
  stream is faster).

Not here: a per-CTA timeline of the decode kernel (start, first full
barrier, last tile, merge end) and a stream-only mode of its producer (TMA
loads with no consumer math) need a build option of the kernel; see
``benchmarks/notes/decode.md``. Results go to
``benchmarks/results/calibrate_decode.json``; ``--list`` prints the cases
without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import benchmark_hpc_decode as decode
import numpy as np
import torch
from bench_utils import (
    L2Scrub,
    capture_graphs,
    fill_normal_,
    finish_run,
    import_hpc_ops,
    make_record,
    measure_copy_bandwidth_gbps,
    ratios_over,
    short_error,
    sync_quietly,
    time_graphs,
    time_impls,
    unavailable_reason,
)

from vllm.triton_utils import tl, triton

RESULT_NAME = Path(__file__).stem + ".json"
WORKLOAD = "CAL"

SHAPES = {
    "w1": decode.W1_LENGTHS,
    "b256x32768": (32768,) * 256,
}
LAYOUTS = ("packed", "separate")
EMPTY_CASES = {"empty-graph": 1, "empty-graph-x64": 64}

HPC = "hpc"
READ = "triton_read"
COPY = "torch_copy"
EMPTY = "empty_kernel"
MIN_ITERS = decode.MIN_ITERS
INT32_BYTES = 4
# Sampled tiles whose read sums are checked against torch before timing.
CHECK_TILES = 8


# ---------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------


@triton.jit
def _empty_kernel(x_ptr):
    pass


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _read_pages_kernel(
    k_ptr,
    v_ptr,
    pages_ptr,
    sums_ptr,
    num_heads,
    page_stride,
    head_stride,
    token_stride,
    TOKENS: tl.constexpr,
    WORDS: tl.constexpr,
):
    # Program t reads KV head t % num_heads of page pages[t // num_heads]:
    # its K tile and its V tile, TOKENS x WORDS int32 words each, and keeps
    # their XOR so no load can be dropped.
    tile = tl.program_id(0)
    page = tl.load(pages_ptr + tile // num_heads).to(tl.int64)
    head = tile % num_heads
    rows = tl.arange(0, TOKENS)[:, None] * token_stride
    cols = tl.arange(0, WORDS)[None, :]
    offs = page * page_stride + head * head_stride + rows + cols
    k = tl.load(k_ptr + offs)
    v = tl.load(v_ptr + offs)
    folded = tl.reduce(tl.reduce(k ^ v, 1, _xor), 0, _xor)
    tl.store(sums_ptr + tile, folded)


def launch_read(
    k_words: torch.Tensor,
    v_words: torch.Tensor,
    pages: torch.Tensor,
    sums: torch.Tensor,
) -> torch.Tensor:
    """Reads K and V of every (page in ``pages``, KV head) once; ``k_words``
    and ``v_words`` are int32 ``(num_blocks, Hkv, block_size, words)`` views
    with the same strides. ``sums[t]`` gets the XOR of tile t's K and V
    words."""
    _, heads, tokens, words = k_words.shape
    assert v_words.shape == k_words.shape
    assert v_words.stride() == k_words.stride()
    assert k_words.stride(-1) == 1
    tiles = pages.numel() * heads
    assert sums.numel() >= tiles
    _read_pages_kernel[(tiles,)](
        k_words,
        v_words,
        pages,
        sums,
        heads,
        k_words.stride(0),
        k_words.stride(1),
        k_words.stride(2),
        TOKENS=tokens,
        WORDS=words,
    )
    return sums


def reference_sums(
    k_words: torch.Tensor,
    v_words: torch.Tensor,
    pages: torch.Tensor,
    tiles: list[int],
) -> list[int]:
    """What :func:`launch_read` writes for ``tiles``."""
    heads = k_words.shape[1]
    sums = []
    for t in tiles:
        page, head = int(pages[t // heads]), t % heads
        both = torch.cat([k_words[page, head].flatten(), v_words[page, head].flatten()])
        sums.append(int(np.bitwise_xor.reduce(both.cpu().numpy())))
    return sums


# ---------------------------------------------------------------------------
# Cases and inputs
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CalCase:
    tp: str
    fp8: bool
    shape: str
    layout: str

    @property
    def name(self) -> str:
        cache = "fp8" if self.fp8 else "bf16"
        return f"{self.tp}-{cache}-{self.shape}-{self.layout}"

    @property
    def decode_case(self) -> decode.Case:
        """The decode benchmark's case of the same lengths, heads and dtype
        (W1's for ``w1``), one query token per sequence."""
        workload = "W1" if self.shape == "w1" else "W2"
        return decode.Case(workload, self.tp, self.fp8, SHAPES[self.shape], 1)

    @property
    def kv_bytes(self) -> int:
        """K and V bytes read: the decode benchmark's floor bytes."""
        return self.decode_case.floor_bytes()

    @property
    def words(self) -> int:
        """int32 words of one token's K (or V) row."""
        return decode.HEAD_SIZE * self.decode_case.elem_bytes // INT32_BYTES

    @property
    def num_tiles(self) -> int:
        """(page, KV head) tiles the read kernel walks."""
        c = self.decode_case
        return c.num_blocks * c.heads[1]

    def set_bytes(self) -> int:
        return self.decode_case.set_bytes()


def cal_cases() -> list[CalCase]:
    return [
        CalCase(tp, fp8, shape, layout)
        for shape in SHAPES
        for tp in decode.HEAD_CONFIGS
        for fp8 in (False, True)
        for layout in LAYOUTS
    ]


@dataclasses.dataclass
class CalSet:
    """One input set: the cache tensors, the views each reader takes, and
    the decode call's queries and output."""

    buffers: tuple[torch.Tensor, ...]  # what torch_copy copies
    k_words: torch.Tensor  # int32 (num_blocks, Hkv, 64, words) views
    v_words: torch.Tensor
    key_cache: torch.Tensor  # [num_blocks, 64, Hkv, D] views
    value_cache: torch.Tensor
    q: torch.Tensor
    out: torch.Tensor


def make_cal_set(case: CalCase, seed: int, device: str = "cuda") -> CalSet:
    dcase = case.decode_case
    words = case.words
    if case.layout == "packed":
        s = decode.make_input_set(dcase, seed, device)
        kv_words = s.kv.view(torch.int32)
        return CalSet(
            buffers=(s.kv,),
            k_words=kv_words[..., :words],
            v_words=kv_words[..., words:],
            key_cache=s.key_cache,
            value_cache=s.value_cache,
            q=s.q,
            out=s.out,
        )
    hq, hkv = dcase.heads
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (dcase.num_blocks, hkv, decode.BLOCK_SIZE, decode.HEAD_SIZE)
    k = torch.empty(shape, dtype=dcase.kv_dtype, device=device)
    v = torch.empty_like(k)
    fill_normal_(k, gen)
    fill_normal_(v, gen)
    q = torch.randn(
        dcase.batch,
        hq,
        decode.HEAD_SIZE,
        generator=gen,
        device=device,
        dtype=torch.bfloat16,
    )
    return CalSet(
        buffers=(k, v),
        k_words=k.view(torch.int32),
        v_words=v.view(torch.int32),
        key_cache=k.permute(0, 2, 1, 3),
        value_cache=v.permute(0, 2, 1, 3),
        q=q,
        out=torch.empty_like(q),
    )


def page_order(layout: decode.Layout, case: decode.Case) -> torch.Tensor:
    """Every live block of the batch, sequence by sequence, in block-table
    order (shuffled over the cache): int32 on the table's device."""
    table = layout.block_table_cpu
    blocks = [math.ceil(n / decode.BLOCK_SIZE) for n in case.lengths]
    pages = torch.cat([table[b, :nb] for b, nb in enumerate(blocks)])
    return pages.to(layout.block_table.device)


def choose_num_sets(case: CalCase, max_bytes: int) -> int:
    """Sets to rotate, as the decode benchmark chooses them, leaving room
    for the copy's destination (one more cache)."""
    size = case.set_bytes()
    wanted = min(
        decode.MAX_SETS,
        max(decode.MIN_SETS, math.ceil(decode.ROTATION_BYTES / size)),
    )
    return min(wanted, max_bytes // size - 1)


# ---------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Env:
    bandwidth_gbps: float
    scrub: L2Scrub
    hpc_ops: ModuleType | None
    hpc_missing: str | None  # why the decode kernel cannot run here
    iters: int
    warmup: int
    max_bytes: int


def bench_empty(name: str, kernels: int, env: Env) -> dict[str, Any]:
    dummy = torch.zeros(1, device="cuda")

    def run(_: object) -> None:
        for _ in range(kernels):
            _empty_kernel[(1,)](dummy)

    try:
        pool = torch.cuda.graph_pool_handle()
        graphs = capture_graphs(run, [None], pool)
        us = time_graphs(graphs, env.iters, env.warmup, None)
    except Exception as err:  # noqa: BLE001 - recorded, the run goes on
        sync_quietly()
        return make_record(WORKLOAD, name, EMPTY, None, None, error=short_error(err))
    return make_record(
        WORKLOAD,
        name,
        EMPTY,
        us,
        None,
        kernels=kernels,
        us_per_kernel=round(us / kernels, 3),
    )


def check_read(case: CalCase, s: CalSet, pages: torch.Tensor) -> str | None:
    """Why the read kernel's sums of the first set are wrong, or None."""
    sums = torch.empty(case.num_tiles, dtype=torch.int32, device=pages.device)
    launch_read(s.k_words, s.v_words, pages, sums)
    torch.accelerator.synchronize()
    n = case.num_tiles
    tiles = sorted(
        set(range(min(CHECK_TILES, n))) | set(range(max(0, n - CHECK_TILES), n))
    )
    want = reference_sums(s.k_words, s.v_words, pages, tiles)
    got = [int(sums[t]) for t in tiles]
    bad = [t for t, w, g in zip(tiles, want, got, strict=True) if w != g]
    return f"wrong read sums at tiles {bad[:4]}" if bad else None


def bench_case(case: CalCase, env: Env) -> list[dict[str, Any]]:
    """Records of one case: hpc first, then the two streams."""
    floor_us = case.kv_bytes / (env.bandwidth_gbps * 1e3)
    num_sets = choose_num_sets(case, env.max_bytes)
    if num_sets < 1:
        gb = case.set_bytes() / 1e9
        reason = f"skipped: one input set and a copy is {2 * gb:.1f} GB, over budget"
        return [
            make_record(WORKLOAD, case.name, impl, None, floor_us, error=reason)
            for impl in (HPC, READ, COPY)
        ]
    dcase = case.decode_case
    layout = decode.make_layout(dcase)
    pages = page_order(layout, dcase)
    sets = [make_cal_set(case, seed=i) for i in range(num_sets)]
    touched = num_sets * case.kv_bytes
    scrub = env.scrub if touched < 4 * env.scrub.l2_bytes else None
    sums = torch.empty(case.num_tiles, dtype=torch.int32, device="cuda")
    spare = [torch.empty_like(b) for b in sets[0].buffers]

    def read(s: CalSet) -> torch.Tensor:
        return launch_read(s.k_words, s.v_words, pages, sums)

    def copy(s: CalSet) -> None:
        for dst, src in zip(spare, s.buffers, strict=True):
            dst.copy_(src)

    impls: dict[str, Callable[[CalSet], object]] = {}
    errors: dict[str, str] = {}
    ref_err: float | None = None
    if env.hpc_missing is not None:
        errors[HPC] = f"not run: {env.hpc_missing}"
    else:
        try:
            assert env.hpc_ops is not None
            hpc = decode.make_hpc(
                dcase, layout, env.hpc_ops, env.hpc_ops.SplitMode.BALANCED
            )
            first = sets[0]
            first.out.fill_(float("nan"))
            hpc(first)
            refs = decode.reference_rows(dcase, layout, first, decode.ref_seqs(dcase))
            ref_err = decode.rel_error(first.out, refs, 1)
            tol = decode.REL_TOL[case.fp8]
            if ref_err <= tol:
                impls[HPC] = hpc
            else:
                errors[HPC] = (
                    f"wrong output: rel error {ref_err:.3g} vs float32 "
                    f"reference (tolerance {tol:g})"
                )
        except Exception as err:  # noqa: BLE001 - recorded, the streams go on
            errors[HPC] = short_error(err)
            sync_quietly()
    why = check_read(case, sets[0], pages)
    if why is None:
        impls[READ] = read
    else:
        errors[READ] = why
    impls[COPY] = copy

    timings: dict[str, float] = {}
    for name, impl in impls.items():
        timings.update(
            time_impls({name: impl}, sets, env.iters, env.warmup, scrub, errors, name)
        )

    records = []
    for name in (HPC, READ, COPY):
        us = timings.get(name)
        moved = case.kv_bytes * (2 if name == COPY else 1)
        extra: dict[str, Any] = {"bytes": case.kv_bytes}
        if us is not None:
            extra["tbps"] = round(moved / (us * 1e-6) / 1e12, 3)
        else:
            extra["error"] = errors.get(name, "not timed")
        if name == HPC:
            extra["num_sets"] = num_sets
            extra["l2_scrub"] = scrub is not None
            if ref_err is not None:
                extra["ref_rel_err"] = float(f"{ref_err:.3g}")
        record = make_record(WORKLOAD, case.name, name, us, floor_us, **extra)
        if name == HPC:
            record["ratios"] = ratios_over(timings, HPC)
        records.append(record)
    return records


def print_case(records: list[dict[str, Any]], started: float) -> None:
    when = f"[{time.monotonic() - started:.0f} s]"
    parts = []
    for r in records:
        if r.get("us") is None:
            parts.append(f"{r['impl']} {r.get('error')}")
        elif "tbps" in r:
            parts.append(f"{r['impl']} {r['us']} us {r['tbps']} TB/s")
        else:
            parts.append(f"{r['impl']} {r['us']} us")
    print(f"  {when} {WORKLOAD} {records[0]['case']}: " + "; ".join(parts))


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------


def select(patterns: list[str]) -> tuple[list[str], list[CalCase]]:
    def wanted(name: str) -> bool:
        return any(fnmatch.fnmatch(name, p) for p in patterns)

    return [n for n in EMPTY_CASES if wanted(n)], [
        c for c in cal_cases() if wanted(c.name)
    ]


def print_case_list(empty: list[str], cases: list[CalCase], max_bytes: int) -> None:
    print(f"{'case':<34} {'K+V MB':>9} {'tiles':>8} {'set MB':>9} {'sets':>4}")
    for name in empty:
        print(
            f"{name:<34} {'':>9} {'':>8} {'':>9} {'':>4}  ({EMPTY_CASES[name]} kernels)"
        )
    for c in cases:
        print(
            f"{c.name:<34} {c.kv_bytes / 1e6:>9.1f} {c.num_tiles:>8} "
            f"{c.set_bytes() / 1e6:>9.1f} {choose_num_sets(c, max_bytes):>4}"
        )
    print(f"{len(empty)} empty-graph cases, {len(cases)} stream cases")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--list",
        action="store_true",
        help="print the selected cases and exit (no GPU needed)",
    )
    parser.add_argument("--out", type=Path, help="also write the JSON under this dir")
    parser.add_argument(
        "--iters", type=int, default=100, help=f"timed replays (>= {MIN_ITERS})"
    )
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument(
        "--cases", default="*", help="comma-separated globs over case names"
    )
    parser.add_argument(
        "--max-kv-gb",
        type=float,
        default=None,
        help="memory for one case's rotated input sets and the copy's "
        f"destination (default: {decode.KV_MEMORY_SHARE:g} of the device's "
        f"memory, at most {decode.MAX_KV_GB:g})",
    )
    args = parser.parse_args(argv)
    if args.iters < MIN_ITERS:
        parser.error(f"--iters must be at least {MIN_ITERS}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    empty, cases = select(args.cases.split(","))
    if args.list:
        max_gb = decode.MAX_KV_GB if args.max_kv_gb is None else args.max_kv_gb
        print_case_list(empty, cases, int(max_gb * 1e9))
        return 0
    if not empty and not cases:
        print(f"calibrate_decode: no case matches {args.cases!r}")
        return 1
    if not torch.cuda.is_available():
        print("calibrate_decode: not run: no CUDA GPU is available")
        return 1
    hpc_missing = unavailable_reason()
    if hpc_missing is not None:
        print(f"hpc skipped: {hpc_missing}")
    max_gb = args.max_kv_gb
    if max_gb is None:
        props = torch.cuda.get_device_properties()
        max_gb = min(
            decode.MAX_KV_GB, decode.KV_MEMORY_SHARE * props.total_memory / 1e9
        )
    bandwidth = measure_copy_bandwidth_gbps()
    torch.accelerator.empty_cache()
    env = Env(
        bandwidth_gbps=bandwidth,
        scrub=L2Scrub(),
        hpc_ops=import_hpc_ops() if hpc_missing is None else None,
        hpc_missing=hpc_missing,
        iters=args.iters,
        warmup=args.warmup,
        max_bytes=int(max_gb * 1e9),
    )
    print(
        f"copy bandwidth {bandwidth:.0f} GB/s, L2 {env.scrub.l2_bytes / 2**20:.0f} "
        f"MiB; {len(empty)} empty-graph cases, {len(cases)} stream cases"
    )

    records: list[dict[str, Any]] = []
    for name in empty:
        record = bench_empty(name, EMPTY_CASES[name], env)
        records.append(record)
        print_case([record], started)
    for case in cases:
        try:
            case_records = bench_case(case, env)
        except Exception as err:  # noqa: BLE001 - e.g. out of memory: go on
            floor_us = case.kv_bytes / (bandwidth * 1e3)
            case_records = [
                make_record(
                    WORKLOAD, case.name, HPC, None, floor_us, error=short_error(err)
                )
            ]
            sync_quietly()
        records.extend(case_records)
        print_case(case_records, started)
        torch.accelerator.empty_cache()

    extra = {
        "l2_bytes": env.scrub.l2_bytes,
        "skipped": {} if hpc_missing is None else {HPC: hpc_missing},
    }
    finish_run(RESULT_NAME, records, bandwidth, args.out, started=started, extra=extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
