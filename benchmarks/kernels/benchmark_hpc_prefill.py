# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmark of paged prefill attention (W5) and its planner.

Workload W5 (head size 128; ``tp1`` = 64 q / 8 kv heads, ``tp8`` = 8 q / 1
kv head; block size 64 unless ``--block-size``; bf16, or ``fp8``: an
FP8-E4M3 KV cache with per-tensor K/V scales and FP8-E4M3 queries with
per-token-per-head scales; bottom-right causal):

* prompts: one request whose whole prompt of {1024, 8192, 32768} tokens is
  the query (q_len = kv_len = context). Cases ``<tp>-<bf16|fp8>-c<context>``;
* 8 requests of 4096-token prompts (32768 tokens in all). Case
  ``<tp>-<bf16|fp8>-c32768-b8``;
* chunked prefill: one request whose 2048-token chunk is the query and whose
  KV length is the context {8192, 32768}, so the chunk is the last 2048 keys
  and attends to every earlier key and causally to itself (q_len 2048,
  kv_len = context). Cases ``<tp>-<bf16|fp8>-chunk2048-c<context>``;
* PLAN: ``PrefillWorkspace.plan``, which runs once per step for all layers,
  timed on its own as one of 20 back-to-back calls in a CUDA graph (a graph
  of one call is recorded as ``us_single_graph``). Cases
  ``prefill-<tp>-<shape>`` for each W5 shape (the plan does not depend on
  the cache dtype). Floor: the lengths read and the plan written, at the
  copy bandwidth.

Protocol: per layer a user pays the attention call alone, so the plan is
computed once before capture (as the backend does once per step) and each
replay holds one attention call. Calls run as CUDA-graph replays timed one by
one with CUDA events; warm-up, then the median of at least 50. Every input
set (its own KV cache, queries, scales and output) gets its own graph and the
sets are replayed round-robin: at least 4 and, up to 64, enough for 240 MB;
cases whose sets would pass ``--max-gb`` use fewer (``num_sets``). When the
bytes the rotation touches are under four times the L2 cache, L2 is scrubbed
before each timed replay, outside the timed region.

Floor: the unmasked causal FLOPs, sum over query rows of 4 * visible keys *
D per query head (QK^T and PV; a row of a request with kv_len keys and
q_len queries at position i sees kv_len - q_len + i + 1 keys), over the dense
matmul rate measured in the same run: ``torch.matmul`` bf16 for bf16 cases,
``torch._scaled_mm`` E4M3 for fp8 cases (twice the bf16 rate, with a note,
when the fp8 rate cannot be measured). The rates go to the JSON top level as
``matmul_tflops``, with the copy bandwidth as ``copy_bandwidth_gbps``.

The cache is one ``(num_blocks, Hkv, block_size, 2 * D)`` tensor whose K
and V are permuted ``[num_blocks, block_size, Hkv, D]`` slices (vLLM's
FLASH_ATTN, TRITON_ATTN and HPC_ATTN layout), each request's blocks shuffled
over it; every implementation reads the same tensor. FP8 queries: random
E4M3 values ``x`` and a power-of-two factor ``f`` per (token, head) in {1, 2,
4}; ``hpc`` gets ``x * f`` with scales ``1 / f`` (exact in E4M3), the
baselines the same query values in the form each takes (below).

Implementations, timed the same way on the same cache:

* ``hpc``: ``prefill_attention`` (its arguments validated once first);
* ``fa3``: vLLM's FlashAttention-3 (``flash_attn_varlen_func``,
  ``fa_version=3``) with the block table, as vLLM's FLASH_ATTN backend calls
  it: the scheduler metadata from ``get_scheduler_metadata`` once per step
  (outside the timing), fp8 with E4M3 queries ``x`` and descales of shape
  (batch, Hkv);
* ``triton_unified``: vLLM's ``unified_attention`` as the TRITON_ATTN
  backend calls it for prefill (the 2D kernel), fp8 with E4M3 queries ``x``
  and a per-tensor query descale;
* ``flex_attention``: ``torch.compile(flex_attention)`` over a paged
  BlockMask on the cache in place (nothing gathered): the cache rows of 2 *
  D read as one ``[1, 1, pages * block_size, D]`` K (and V), KV heads folded
  into the batch, each (request, KV head) row listing only its request's
  pages for its KV head and, per 128-query block, only the pages up to the
  causal limit (all blocks partial, as vLLM's FlexAttention backend builds
  them), and a ``mask_mod`` mapping physical to logical positions for the
  causal limit. The query regrouping into that batch (a copy for ``-b8``),
  the output copy into ``out`` and the FP8 V scale are timed with it; fp8
  with bf16 queries holding the same values;
* ``flashinfer``: its paged prefill wrapper (HND cache views, plan outside
  the graph), only where it imports; fp8 with bf16 queries.

A baseline that does not import is listed under ``skipped`` at the JSON top
level. Before timing, every output (poisoned with NaN first) is compared with
a float32 reference on query rows at the start, middle and end of the first
and last requests (``ref_rel_err``), and the ``hpc`` output over the whole
batch must be finite and, where ``fa3`` ran, agree with it (``fa3_rel_diff``;
``max_abs_diff`` to every baseline). A baseline that fails is recorded with
its error and not timed; a failing ``hpc`` result is recorded without a time
and makes the run exit 1. ``--list`` prints the cases without a GPU.
Results go to ``benchmarks/results/benchmark_hpc_prefill.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from bench_utils import (
    FP8,
    DeviceLost,
    L2Scrub,
    add_merge_arg,
    add_run_args,
    capture_graphs,
    causal_attention_rows,
    check_impls,
    check_run_args,
    compiled_flex,
    fa3_kv_views,
    fa3_scheduler_metadata,
    fill_normal_,
    finish_run,
    flashinfer_prefill_wrapper,
    flex_kv_views,
    flex_page_maps,
    flex_paged_block_mask,
    floor_matmul_tflops,
    gather_tokens,
    import_attn_workspace,
    import_hpc_ops,
    json_float,
    make_record,
    max_abs_diff,
    measure_copy_bandwidth_gbps,
    median_ms,
    merge_records,
    missing_baselines,
    missing_fa3,
    new_events,
    print_progress,
    ratios_over,
    relative_error,
    run_flashinfer_hnd,
    run_guarded,
    short_error,
    sleep_ahead,
    time_graphs,
    time_impls,
    unavailable_reason,
    validated_op,
)

RESULT_NAME = Path(__file__).stem + ".json"
DEVICE = "cuda"

HEAD_CONFIGS = {"tp1": (64, 8), "tp8": (8, 1)}
HEAD_SIZE = 128
BLOCK_SIZE = 64
BLOCK_SIZES = (16, 32, 64)
SCALE = HEAD_SIZE**-0.5
K_SCALE = 0.5
V_SCALE = 0.75
# FP8 queries: E4M3 values x with descale Q_SCALE for the baselines; hpc
# gets x * 2^k with descale Q_SCALE / 2^k, k in [0, Q_SHIFTS) per (token,
# head).
Q_SCALE = 1.0
Q_SHIFTS = 3

PROMPTS = (1024, 8192, 32768)
BATCH_REQUESTS = 8
BATCH_PROMPT = 4096
CHUNK = 2048
CHUNK_CONTEXTS = (8192, 32768)
QUICK = (
    "tp1-bf16-c8192",
    "tp1-fp8-c8192",
    "tp1-bf16-c32768-b8",
    "tp8-bf16-chunk2048-c32768",
)
WORKLOADS = ("W5", "PLAN")

ROTATION_BYTES = 240 * 10**6
MIN_SETS = 4
MAX_SETS = 64
# Memory for one case's rotated input sets: this share of the device's
# memory, at most MAX_GB.
MEMORY_SHARE = 0.5
MAX_GB = 70.0
MIN_ITERS = 50
# Query rows of the float32 reference: this many at the start, middle and
# end of the first and last requests.
REF_ROWS = 16
# ||out - ref|| / ||ref|| allowed before an output counts as wrong (loose:
# this guards the timings, the tests hold the accuracy bars; FP8 paths
# round the softmax weights to E4M3 for the PV product).
REL_TOL = {False: 2e-2, True: 8e-2}
FLEX_Q_BLOCK = 128

HPC = "hpc"
FA3 = "fa3"
TRITON = "triton_unified"
FLEX = "flex_attention"
FLASHINFER = "flashinfer"
BASELINES = (FA3, TRITON, FLEX, FLASHINFER)
FA3_VARIANT_BASE = "flash_attn_varlen_func fa_version=3, paged (block table)"
FA3_VARIANT = (
    f"{FA3_VARIANT_BASE}, scheduler metadata from get_scheduler_metadata "
    "outside the timing"
)
TRITON_VARIANT = "unified_attention, 2D kernel (no split-KV scratch)"
FLEX_VARIANT = (
    "paged BlockMask over the cache blocks (block table), causal pruning per "
    "128-query block, KV heads folded into the batch, cache used in place; "
    "query regrouping and output copy timed"
)


# ---------------------------------------------------------------------------
# Cases and inputs
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shape:
    """Requests of one case: ``batch`` requests, each ``q_len`` new tokens
    and ``kv_len`` keys (context before the new tokens + the new tokens)."""

    label: str  # c<context>, c<context>-b<batch> or chunk<q>-c<context>
    batch: int
    q_len: int
    kv_len: int

    @property
    def tokens(self) -> int:
        return self.batch * self.q_len

    def visible_keys(self) -> int:
        """Keys all query rows of the batch see under the causal mask."""
        before = self.kv_len - self.q_len
        return self.batch * (self.q_len * before + self.q_len * (self.q_len + 1) // 2)


def w5_shapes() -> list[Shape]:
    shapes = [Shape(f"c{n}", 1, n, n) for n in PROMPTS]
    total = BATCH_REQUESTS * BATCH_PROMPT
    shapes.append(
        Shape(f"c{total}-b{BATCH_REQUESTS}", BATCH_REQUESTS, BATCH_PROMPT, BATCH_PROMPT)
    )
    shapes += [Shape(f"chunk{CHUNK}-c{n}", 1, CHUNK, n) for n in CHUNK_CONTEXTS]
    return shapes


@dataclasses.dataclass(frozen=True)
class Case:
    tp: str
    fp8: bool
    shape: Shape
    block_size: int

    @property
    def name(self) -> str:
        return f"{self.tp}-{'fp8' if self.fp8 else 'bf16'}-{self.shape.label}"

    @property
    def heads(self) -> tuple[int, int]:
        return HEAD_CONFIGS[self.tp]

    @property
    def kv_dtype(self) -> torch.dtype:
        return FP8 if self.fp8 else torch.bfloat16

    @property
    def elem_bytes(self) -> int:
        return 1 if self.fp8 else 2

    @property
    def blocks_per_request(self) -> int:
        return math.ceil(self.shape.kv_len / self.block_size)

    @property
    def num_blocks(self) -> int:
        return self.shape.batch * self.blocks_per_request

    def flops(self) -> int:
        """Unmasked causal work: 4 * visible keys * D per query head (2 for
        QK^T, 2 for PV)."""
        hq, _ = self.heads
        return 4 * HEAD_SIZE * hq * self.shape.visible_keys()

    def set_bytes(self) -> int:
        """One input set as hpc reads and writes it: the KV cache, the
        queries (and their scales) and the output."""
        hq, hkv = self.heads
        kv = self.num_blocks * hkv * self.block_size * 2 * HEAD_SIZE * self.elem_bytes
        rows = self.shape.tokens * hq
        q = rows * HEAD_SIZE * self.elem_bytes + (4 * rows if self.fp8 else 0)
        return kv + q + rows * HEAD_SIZE * 2

    def extra_bytes(self) -> int:
        """What an fp8 set also holds for the baselines: E4M3 queries with a
        per-tensor scale and bf16 queries."""
        hq, _ = self.heads
        return self.shape.tokens * hq * HEAD_SIZE * 3 if self.fp8 else 0


def all_cases(block_size: int) -> list[Case]:
    return [
        Case(tp, fp8, shape, block_size)
        for tp in HEAD_CONFIGS
        for fp8 in (False, True)
        for shape in w5_shapes()
    ]


def plan_cases() -> list[tuple[str, str, Shape]]:
    """(case name, tp, shape) of the PLAN workload."""
    return [
        (f"prefill-{tp}-{shape.label}", tp, shape)
        for tp in HEAD_CONFIGS
        for shape in w5_shapes()
    ]


@dataclasses.dataclass
class Layout:
    """What every input set of a case shares: lengths, block table, scales."""

    query_start_loc: torch.Tensor  # int32 [batch + 1]
    seq_lens: torch.Tensor  # int32 [batch]
    block_table: torch.Tensor  # int32 [batch, blocks per request]
    block_table_cpu: torch.Tensor
    k_scale: torch.Tensor | None  # float32 [1], fp8 only
    v_scale: torch.Tensor | None
    q_descale: torch.Tensor | None  # float32 [1]: the baselines' query scale


def make_layout(case: Case, seed: int = 0) -> Layout:
    """Each request gets its own blocks, shuffled over the cache."""
    device = DEVICE
    shape = case.shape
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(case.num_blocks, generator=gen, dtype=torch.int32)
    table = perm.view(shape.batch, case.blocks_per_request).clone()
    starts = torch.arange(shape.batch + 1, dtype=torch.int32) * shape.q_len

    def scalar(x: float) -> torch.Tensor | None:
        return torch.tensor([x], device=device) if case.fp8 else None

    return Layout(
        query_start_loc=starts.to(device),
        seq_lens=torch.full((shape.batch,), shape.kv_len, dtype=torch.int32).to(device),
        block_table=table.to(device),
        block_table_cpu=table,
        k_scale=scalar(K_SCALE),
        v_scale=scalar(V_SCALE),
        q_descale=scalar(Q_SCALE),
    )


@dataclasses.dataclass
class InputSet:
    kv: torch.Tensor  # (num_blocks, Hkv, block_size, 2 * D)
    key_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D] views
    value_cache: torch.Tensor
    q: torch.Tensor  # hpc's queries [tokens, Hq, D], bf16 or E4M3
    q_scale: torch.Tensor | None  # float32 [tokens, Hq], fp8 only
    q_base: torch.Tensor  # E4M3 with descale Q_SCALE (fp8), else q
    q_bf16: torch.Tensor  # the same query values in bf16
    out: torch.Tensor  # bf16 [tokens, Hq, D]


def make_input_set(case: Case, seed: int) -> InputSet:
    device = DEVICE
    hq, hkv = case.heads
    gen = torch.Generator(device=device).manual_seed(seed)
    kv = torch.empty(
        case.num_blocks,
        hkv,
        case.block_size,
        2 * HEAD_SIZE,
        dtype=case.kv_dtype,
        device=device,
    )
    fill_normal_(kv, gen)
    tokens = case.shape.tokens
    q_bf16 = torch.randn(
        tokens, hq, HEAD_SIZE, generator=gen, device=device, dtype=torch.bfloat16
    )
    q, q_scale, q_base = q_bf16, None, q_bf16
    if case.fp8:
        q_base = q_bf16.to(FP8)
        del q_bf16
        shift = torch.randint(
            0, Q_SHIFTS, (tokens, hq), generator=gen, device=device
        ).float()
        factor = torch.exp2(shift)
        # x * 2^k is exact in E4M3 while |x| * 4 stays far below 448.
        q = (q_base.float() * factor[..., None]).to(FP8)
        q_scale = (Q_SCALE / factor).contiguous()
        q_bf16 = (q_base.float() * Q_SCALE).to(torch.bfloat16)
    return InputSet(
        kv=kv,
        key_cache=kv[..., :HEAD_SIZE].permute(0, 2, 1, 3),
        value_cache=kv[..., HEAD_SIZE:].permute(0, 2, 1, 3),
        q=q,
        q_scale=q_scale,
        q_base=q_base,
        q_bf16=q_bf16,
        out=torch.empty(tokens, hq, HEAD_SIZE, dtype=torch.bfloat16, device=device),
    )


# ---------------------------------------------------------------------------
# Implementations: each runs one input set and returns its output
# ---------------------------------------------------------------------------

Impl = Callable[[InputSet], torch.Tensor]


def create_workspace(tp: str, shape: Shape) -> Any:
    """A ``PrefillWorkspace`` sized for exactly ``shape``'s batch."""
    hq, hkv = HEAD_CONFIGS[tp]
    return import_attn_workspace().PrefillWorkspace.create(
        max_tokens=shape.tokens,
        max_batch=shape.batch,
        num_q_heads=hq,
        num_kv_heads=hkv,
        device=DEVICE,
    )


def make_hpc(case: Case, layout: Layout, hpc_ops: ModuleType, first: InputSet) -> Impl:
    ws = create_workspace(case.tp, case.shape)
    # Once per step for all layers: outside the timed region.
    ws.plan(layout.query_start_loc, layout.seq_lens)

    def args(s: InputSet) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (
            (
                s.q,
                s.key_cache,
                s.value_cache,
                layout.block_table,
                layout.query_start_loc,
                layout.seq_lens,
                s.out,
                ws,
            ),
            {
                "scale": SCALE,
                "q_scale": s.q_scale,
                "k_scale": layout.k_scale,
                "v_scale": layout.v_scale,
                "softcap": 0.0,
                "window": 0,
            },
        )

    # Validated once: a wrong call fails here, naming the argument.
    attention = validated_op("prefill_attention", hpc_ops)
    pos, kw = args(first)
    attention(*pos, **kw)

    def run(s: InputSet) -> torch.Tensor:
        pos, kw = args(s)
        attention(*pos, **kw)
        return s.out

    return run


def make_fa3(case: Case, layout: Layout, notes: dict[str, str]) -> Impl:
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    hq, hkv = case.heads
    shape = case.shape
    descales: dict[str, torch.Tensor] = {}
    if case.fp8:
        assert layout.q_descale is not None
        assert layout.k_scale is not None and layout.v_scale is not None
        descale_shape = (shape.batch, hkv)
        descales = {
            "q_descale": layout.q_descale.expand(descale_shape),
            "k_descale": layout.k_scale.expand(descale_shape),
            "v_descale": layout.v_scale.expand(descale_shape),
        }
    scheduler_metadata, error = fa3_scheduler_metadata(
        batch_size=shape.batch,
        max_seqlen_q=shape.q_len,
        max_seqlen_k=shape.kv_len,
        num_heads_q=hq,
        num_heads_kv=hkv,
        headdim=HEAD_SIZE,
        cache_seqlens=layout.seq_lens,
        qkv_dtype=case.kv_dtype,
        cu_seqlens_q=layout.query_start_loc,
        page_size=case.block_size,
        causal=True,
        num_splits=0,
    )
    notes[FA3] = FA3_VARIANT
    if error is not None:
        notes[FA3] = (
            f"{FA3_VARIANT_BASE}, no scheduler metadata "
            f"(get_scheduler_metadata: {error})"
        )

    def run(s: InputSet) -> torch.Tensor:
        k, v = fa3_kv_views(s.key_cache, s.value_cache)
        flash_attn_varlen_func(
            q=s.q_base,
            k=k,
            v=v,
            max_seqlen_q=shape.q_len,
            cu_seqlens_q=layout.query_start_loc,
            max_seqlen_k=shape.kv_len,
            seqused_k=layout.seq_lens,
            softmax_scale=SCALE,
            causal=True,
            block_table=layout.block_table,
            out=s.out,
            scheduler_metadata=scheduler_metadata,
            num_splits=0,
            fa_version=3,
            **descales,
        )
        return s.out

    return run


def make_triton(case: Case, layout: Layout) -> Impl:
    """The Triton backend call of vLLM (triton_attn.py) for a prefill batch:
    queries longer than the split-KV limit always take the 2D kernel, so no
    split-KV scratch is passed."""
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    from vllm.v1.kv_cache_interface import KVQuantMode

    _, hkv = case.heads
    shape = case.shape
    one = torch.ones(1, dtype=torch.float32, device=DEVICE)
    k_scale = layout.k_scale if layout.k_scale is not None else one
    v_scale = layout.v_scale if layout.v_scale is not None else one
    k_descale = k_scale.expand(shape.batch, hkv)
    v_descale = v_scale.expand(shape.batch, hkv)
    quant = KVQuantMode.FP8_PER_TENSOR if case.fp8 else KVQuantMode.NONE

    def run(s: InputSet) -> torch.Tensor:
        unified_attention(
            q=s.q_base,
            k=s.key_cache,
            v=s.value_cache,
            out=s.out,
            cu_seqlens_q=layout.query_start_loc,
            max_seqlen_q=shape.q_len,
            seqused_k=layout.seq_lens,
            max_seqlen_k=shape.kv_len,
            softmax_scale=SCALE,
            causal=True,
            window_size=(-1, -1),
            block_table=layout.block_table,
            softcap=0,
            q_descale=layout.q_descale,
            k_descale=k_descale,
            v_descale=v_descale,
            kv_quant_mode=quant,
        )
        return s.out

    return run


class FlexPaged:
    """FlexAttention over the paged cache, in place.

    The cache tensor ``(num_blocks, Hkv, bs, 2 * D)`` read as rows of 2 * D
    is a ``[1, 1, num_blocks * Hkv * bs, D]`` K (and V, offset by D) view in
    which block ``p`` of KV head ``h`` is page ``p * Hkv + h``. Queries are
    regrouped as batch ``b * Hkv + h`` with the GQA group as heads, so each
    row's BlockMask lists its request's pages for its KV head, in logical
    order, and each 128-query block only the pages up to its last query's
    causal limit; ``mask_mod`` maps a physical position to its row and
    logical position for the causal limit (every block partial).
    """

    def __init__(self, case: Case, layout: Layout) -> None:
        device = DEVICE
        hq, hkv = case.heads
        shape, bs = case.shape, case.block_size
        self.batch, self.kv_heads = shape.batch, hkv
        self.group, self.q_len = hq // hkv, shape.q_len
        num_pages = case.num_blocks * hkv
        self.tokens = num_pages * bs

        table = layout.block_table_cpu.long()  # [batch, blocks per request]
        nblk = table.shape[1]
        heads = torch.arange(hkv)
        pages = table[:, None, :] * hkv + heads[None, :, None]  # [B, Hkv, nblk]
        rows = self.batch * hkv
        q_blocks = math.ceil(shape.q_len / FLEX_Q_BLOCK)
        # Keys visible to the last query of each q block, in pages.
        before = shape.kv_len - shape.q_len
        last = torch.clamp((torch.arange(q_blocks) + 1) * FLEX_Q_BLOCK, max=shape.q_len)
        visible_pages = torch.div(before + last + bs - 1, bs, rounding_mode="floor")
        kv_num_blocks = visible_pages.view(1, 1, q_blocks).expand(rows, 1, q_blocks)
        kv_indices = pages.reshape(rows, 1, 1, nblk).expand(rows, 1, q_blocks, nblk)

        owner, logical = flex_page_maps(pages, num_pages)
        page_owner, page_logical = owner.to(device), logical.to(device)
        # Query t of a row sees logical positions <= kv_len - q_len + t.
        limit = torch.full((rows,), before, dtype=torch.int32).to(device)
        self.block_mask = flex_paged_block_mask(
            kv_num_blocks,
            kv_indices,
            bs,
            page_owner,
            page_logical,
            limit,
            (shape.q_len, self.tokens),
            q_block=FLEX_Q_BLOCK,
            device=device,
        )
        # The kernel's KV tile must divide the page.
        self.kernel_options = {"BLOCK_N": bs} if bs < 64 else None
        self.scale = SCALE * (K_SCALE if case.fp8 else 1.0)
        self.out_scale = V_SCALE if case.fp8 else 1.0

    def __call__(
        self,
        fn: Callable[..., torch.Tensor],
        q: torch.Tensor,
        kv: torch.Tensor,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Attention of ``q`` ([batch * q_len, Hq, D], bf16) over the cache
        ``kv``, written into ``out``."""
        b, hkv, g, t = self.batch, self.kv_heads, self.group, self.q_len
        d = q.shape[-1]
        # Rows b * Hkv + h, heads = the GQA group (a view for one request).
        qf = q.view(b, t, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b * hkv, g, t, d)
        k, v = flex_kv_views(kv, self.tokens, HEAD_SIZE)
        o = fn(
            qf,
            k,
            v,
            block_mask=self.block_mask,
            scale=self.scale,
            enable_gqa=True,
            kernel_options=self.kernel_options,
        )
        o = o.reshape(b, hkv, g, t, d).permute(0, 3, 1, 2, 4)  # [b, t, Hkv, g, D]
        dst = out.view(b, t, hkv, g, d)
        if self.out_scale == 1.0:
            dst.copy_(o)
        else:
            torch.mul(o, self.out_scale, out=dst)
        return out


def make_flex(case: Case, layout: Layout) -> Impl:
    paged = FlexPaged(case, layout)
    fn = compiled_flex()

    def run(s: InputSet) -> torch.Tensor:
        return paged(fn, s.q_bf16, s.kv, s.out)

    return run


def make_flashinfer(case: Case, layout: Layout) -> Impl:
    """FlashInfer's paged prefill wrapper with a causal mask, HND cache
    views, plan outside the graph."""
    hq, hkv = case.heads
    shape, bs = case.shape, case.block_size
    nblk = case.blocks_per_request
    indptr = torch.arange(shape.batch + 1, dtype=torch.int32) * nblk
    indices = layout.block_table_cpu.flatten()
    last_page_len = torch.full(
        (shape.batch,), (shape.kv_len - 1) % bs + 1, dtype=torch.int32
    )
    indptr, indices = indptr.to(DEVICE), indices.to(DEVICE)
    last_page_len = last_page_len.to(DEVICE)
    qo_indptr = layout.query_start_loc
    workspace = torch.zeros(256 * 2**20, dtype=torch.uint8, device=DEVICE)
    wrapper = flashinfer_prefill_wrapper(
        workspace,
        qo_indptr,
        indptr,
        indices,
        last_page_len,
        hq,
        hkv,
        HEAD_SIZE,
        bs,
        q_data_type=torch.bfloat16,
        kv_data_type=case.kv_dtype,
        sm_scale=SCALE,
    )
    scales: dict[str, float] = {}
    if case.fp8:
        scales = {"k_scale": K_SCALE, "v_scale": V_SCALE}

    def run(s: InputSet) -> torch.Tensor:
        return run_flashinfer_hnd(wrapper, s.q_bf16, s.kv, s.out, HEAD_SIZE, scales)

    return run


# ---------------------------------------------------------------------------
# Checking
# ---------------------------------------------------------------------------


def ref_rows(shape: Shape) -> dict[int, list[int]]:
    """Request -> local query rows the float32 reference checks: REF_ROWS at
    the start, middle and end of the first and the last request."""
    n = min(REF_ROWS, shape.q_len)
    mid = max(0, shape.q_len // 2 - n // 2)
    local = sorted(
        set(range(n))
        | set(range(mid, mid + n))
        | set(range(shape.q_len - n, shape.q_len))
    )
    return {b: local for b in sorted({0, shape.batch - 1})}


def reference_rows(
    case: Case, layout: Layout, s: InputSet, rows: dict[int, list[int]]
) -> torch.Tensor:
    """Float32 attention of the given query rows, ``[rows, Hq, D]`` in the
    order of ``token_indices(rows)``, from the dequantized inputs hpc reads."""
    shape = case.shape
    k_scale = K_SCALE if case.fp8 else 1.0
    v_scale = V_SCALE if case.fp8 else 1.0
    before = shape.kv_len - shape.q_len
    refs = []
    for b, local in rows.items():
        blocks = layout.block_table_cpu[b].long().to(s.kv.device)
        k = gather_tokens(s.key_cache, blocks, shape.kv_len) * k_scale
        v = gather_tokens(s.value_cache, blocks, shape.kv_len) * v_scale
        idx = torch.tensor(local, device=s.kv.device) + b * shape.q_len
        q = s.q[idx].float()
        if s.q_scale is not None:
            q = q * s.q_scale[idx].float()[..., None]
        limit = before + torch.tensor(local, device=q.device)
        refs.append(causal_attention_rows(q, k, v, limit, SCALE))
    return torch.cat(refs)


def token_indices(shape: Shape, rows: dict[int, list[int]]) -> list[int]:
    return [b * shape.q_len + r for b, local in rows.items() for r in local]


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Options:
    iters: int
    warmup: int
    baselines: tuple[str, ...]
    max_bytes: int


@dataclasses.dataclass
class Env:
    hpc_ops: ModuleType
    bandwidth_gbps: float
    tflops: dict[str, float]  # bf16 / fp8 rate behind the floors
    scrub: L2Scrub
    missing: dict[str, str]  # baseline -> why it cannot run


def case_floor_us(case: Case, tflops: dict[str, float]) -> float:
    rate = tflops["fp8" if case.fp8 else "bf16"]
    return case.flops() / (rate * 1e6)


def choose_num_sets(case: Case, max_bytes: int) -> int:
    """Sets to rotate: enough for ROTATION_BYTES within [MIN_SETS, MAX_SETS],
    fewer where they would pass the memory budget (0: even one does not)."""
    size = case.set_bytes()
    wanted = min(MAX_SETS, max(MIN_SETS, math.ceil(ROTATION_BYTES / size)))
    return min(wanted, max_bytes // (size + case.extra_bytes()))


def _drop(checked: Any, name: str, why: str) -> None:
    checked.impls.pop(name, None)
    checked.errors[name] = why


def bench_case(case: Case, env: Env, opts: Options) -> tuple[list[dict], bool]:
    """Records of one W5 case and whether the hpc result is sound."""
    floor_us = case_floor_us(case, env.tflops)
    num_sets = choose_num_sets(case, opts.max_bytes)
    if num_sets < 1:
        gb = (case.set_bytes() + case.extra_bytes()) / 1e9
        reason = f"skipped: one input set is {gb:.1f} GB, over the --max-gb budget"
        return [make_record("W5", case.name, HPC, None, floor_us, error=reason)], True

    layout = make_layout(case)
    sets = [make_input_set(case, seed=i) for i in range(num_sets)]
    touched = num_sets * case.set_bytes()
    scrub = env.scrub if touched < 4 * env.scrub.l2_bytes else None
    hpc_ops = env.hpc_ops

    variants = {FA3: FA3_VARIANT, TRITON: TRITON_VARIANT, FLEX: FLEX_VARIANT}
    makers: dict[str, Callable[[], Impl]] = {
        HPC: lambda: make_hpc(case, layout, hpc_ops, sets[0]),
        FA3: lambda: make_fa3(case, layout, variants),
        TRITON: lambda: make_triton(case, layout),
        FLEX: lambda: make_flex(case, layout),
        FLASHINFER: lambda: make_flashinfer(case, layout),
    }
    names = [HPC] + [b for b in opts.baselines if b not in env.missing]
    rows = ref_rows(case.shape)
    picked = torch.tensor(token_indices(case.shape, rows), device=DEVICE)
    ref = reference_rows(case, layout, sets[0], rows)
    tol = REL_TOL[case.fp8]

    checked = check_impls(
        names,
        makers,
        sets[0],
        lambda out, ref=ref: relative_error(out[picked], ref),
        tol,
        "float32 reference",
    )
    del ref
    outputs, errors = checked.outputs, checked.errors
    diffs: dict[str, float | str] = {}
    fa3_rel: float | None = None
    if HPC in outputs:
        hpc_out = outputs[HPC]
        if not torch.isfinite(hpc_out).all():
            _drop(checked, HPC, "wrong output: non-finite values (unwritten rows?)")
        diffs = {
            name: json_float(max_abs_diff(hpc_out, out), 3)
            for name, out in outputs.items()
            if name != HPC
        }
        if FA3 in checked.impls:
            fa3_rel = relative_error(hpc_out, outputs[FA3].float())
            if HPC in checked.impls and not fa3_rel <= tol:
                _drop(
                    checked,
                    HPC,
                    f"wrong output: rel difference {fa3_rel:.3g} to fa3 over the "
                    f"whole batch (tolerance {tol:g})",
                )
    del outputs
    checked.outputs = {}

    timings: dict[str, float] = {}
    if HPC in checked.impls:
        timings = time_impls(
            checked.impls, sets, opts.iters, opts.warmup, scrub, errors, HPC
        )

    records = []
    for name in names:
        extra: dict[str, Any] = {}
        if name in checked.ref_err:
            extra["ref_rel_err"] = json_float(checked.ref_err[name], 3)
        if name == HPC:
            extra["flops"] = case.flops()
            extra["num_sets"] = num_sets
            extra["rotated_gb"] = round(num_sets * case.set_bytes() / 1e9, 3)
            extra["l2_scrub"] = scrub is not None
            extra["max_abs_diff"] = diffs
            if fa3_rel is not None:
                extra["fa3_rel_diff"] = json_float(fa3_rel, 3)
        if name in variants:
            extra["variant"] = variants[name]
        if name not in timings:
            extra["error"] = errors.get(name, "not timed: the hpc result failed")
        record = make_record(
            "W5", case.name, name, timings.get(name), floor_us, **extra
        )
        if name == HPC:
            record["ratios"] = ratios_over(timings, HPC)
        records.append(record)
    return records, HPC in timings


# The plan runs once per step inside the model's CUDA graph, so its cost is
# a kernel among others, not a graph launch: it is timed as one of
# PLAN_CALLS_PER_GRAPH back-to-back calls in one graph. A graph holding a
# single call is timed too and recorded as `us_single_graph`.
PLAN_CALLS_PER_GRAPH = 20


def _plan_runner(ws: Any, layout: Layout, calls: int) -> Callable[[object], None]:
    def run(_: object) -> None:
        for _ in range(calls):
            ws.plan(layout.query_start_loc, layout.seq_lens)

    return run


def _time_eager(run: Callable[[object], None], iters: int, warmup: int) -> float:
    """Median microseconds of one eager call, each timed by CUDA events."""
    for _ in range(warmup):
        run(None)
    torch.accelerator.synchronize()
    events = new_events(iters)
    sleep_ahead()
    for start, end in events:
        start.record()
        run(None)
        end.record()
    torch.accelerator.synchronize()
    return median_ms(events) * 1e3


def bench_plan(
    name: str, tp: str, shape: Shape, env: Env, opts: Options
) -> tuple[list[dict], bool]:
    """``PrefillWorkspace.plan`` alone; timed eagerly (recorded as
    ``graph: false``) if it cannot be captured."""
    case = Case(tp, False, shape, BLOCK_SIZE)
    layout = make_layout(case)
    extra: dict[str, Any] = {}
    us: float | None = None
    floor_us: float | None = None
    try:
        ws = create_workspace(tp, shape)
        ws.plan(layout.query_start_loc, layout.seq_lens)
        torch.accelerator.synchronize()
        plan_buffer = getattr(ws, "plan_buffer", None)
        if isinstance(plan_buffer, torch.Tensor):
            nbytes = 4 * (2 * shape.batch + 1) + plan_buffer.nbytes
            floor_us = nbytes / (env.bandwidth_gbps * 1e3)
        pool = torch.cuda.graph_pool_handle()
        try:
            graphs = capture_graphs(
                _plan_runner(ws, layout, PLAN_CALLS_PER_GRAPH), [None], pool
            )
            us = (
                time_graphs(graphs, opts.iters, opts.warmup, None)
                / PLAN_CALLS_PER_GRAPH
            )
            single = capture_graphs(_plan_runner(ws, layout, 1), [None], pool)
            extra["calls_per_graph"] = PLAN_CALLS_PER_GRAPH
            extra["us_single_graph"] = round(
                time_graphs(single, opts.iters, opts.warmup, None), 3
            )
            del graphs, single
        except Exception as err:  # noqa: BLE001 - fall back to eager timing
            torch.accelerator.synchronize()
            us = _time_eager(_plan_runner(ws, layout, 1), opts.iters, opts.warmup)
            extra["graph"] = False
            extra["capture_error"] = short_error(err)
    except Exception as err:  # noqa: BLE001 - recorded, the run goes on
        extra["error"] = short_error(err)
        us = None
        torch.accelerator.synchronize()
    return [make_record("PLAN", name, HPC, us, floor_us, **extra)], us is not None


def find_missing(wanted: tuple[str, ...]) -> dict[str, str]:
    missing = missing_baselines(
        {
            TRITON: (
                "vllm.v1.attention.ops.triton_unified_attention",
                "unified_attention",
            ),
            FLEX: ("torch.nn.attention.flex_attention", "flex_attention"),
            FLASHINFER: ("flashinfer", None),
        },
        wanted,
    )
    missing.update(missing_fa3(wanted, (FA3,)))
    return missing


def select_cases(args: argparse.Namespace) -> tuple[list[Case], list[tuple]]:
    workloads = set(filter(None, args.workloads.split(",")))
    patterns = args.cases.split(",")
    cases: list[Case] = []
    if "W5" in workloads:
        cases = all_cases(args.block_size)
        if args.quick:
            cases = [c for c in cases if c.name in QUICK]
        cases = [c for c in cases if any(fnmatch.fnmatch(c.name, p) for p in patterns)]
    plans: list[tuple] = []
    if "PLAN" in workloads:
        plans = [
            p
            for p in plan_cases()
            if any(fnmatch.fnmatch(p[0], pat) for pat in patterns)
        ]
        if args.quick:
            quick_shapes = {c.tp + "-" + c.shape.label for c in cases}
            plans = [p for p in plans if p[0].removeprefix("prefill-") in quick_shapes]
    return cases, plans


def print_case_list(cases: list[Case], plans: list[tuple], max_bytes: int) -> None:
    """The cases with their sizes and work; needs no GPU."""
    print(
        f"{'case':<28} {'batch':>5} {'q_len':>6} {'kv_len':>6} {'GFLOP':>9} "
        f"{'set MB':>8} {'sets':>4}"
    )
    for c in cases:
        s = c.shape
        print(
            f"{c.name:<28} {s.batch:>5} {s.q_len:>6} {s.kv_len:>6} "
            f"{c.flops() / 1e9:>9.1f} {c.set_bytes() / 1e6:>8.1f} "
            f"{choose_num_sets(c, max_bytes):>4}"
        )
    for name, _, s in plans:
        print(f"{name:<28} {s.batch:>5} {s.q_len:>6} {s.kv_len:>6}  (PLAN)")
    print(f"{len(cases)} W5 cases, {len(plans)} planner cases")


def merge_into(
    path: Path, records: list[dict[str, Any]], block_size: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``records`` merged with an earlier run of the same block size
    (bench_utils.merge_records), in case order."""
    old = json.loads(path.read_text())
    if old.get("block_size", BLOCK_SIZE) != block_size:
        raise SystemExit(
            f"--merge: {path} was measured with block size {old.get('block_size')}"
        )
    order = [("W5", c.name) for c in all_cases(block_size)]
    order += [("PLAN", p[0]) for p in plan_cases()]
    return merge_records(path, records, order, carried=("matmul_tflops",))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--list",
        "--dry-run",
        dest="list",
        action="store_true",
        help="print the selected cases and exit (no GPU needed)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a few cases (" + ", ".join(QUICK) + ") and their plans",
    )
    add_run_args(parser, 60, 5, WORKLOADS, BASELINES)
    parser.add_argument(
        "--block-size",
        type=int,
        default=BLOCK_SIZE,
        choices=BLOCK_SIZES,
        help=f"KV-cache block size (default {BLOCK_SIZE})",
    )
    add_merge_arg(parser)
    parser.add_argument(
        "--max-gb",
        type=float,
        default=None,
        help="memory for one case's rotated input sets (default: "
        f"{MEMORY_SHARE:g} of the device's memory, at most {MAX_GB:g})",
    )
    args = parser.parse_args(argv)
    check_run_args(parser, args, MIN_ITERS, WORKLOADS, BASELINES)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    cases, plans = select_cases(args)
    if args.list:
        max_gb = MAX_GB if args.max_gb is None else args.max_gb
        print_case_list(cases, plans, int(max_gb * 1e9))
        return 0
    if not cases and not plans:
        print(f"benchmark_hpc_prefill: no case matches {args.cases!r}")
        return 1
    reason = unavailable_reason()
    if reason is not None:
        print(f"benchmark_hpc_prefill: not run: {reason}")
        return 1
    hpc_ops = import_hpc_ops()
    if not hasattr(torch.ops._hpc_C, "prefill_attention"):
        print("benchmark_hpc_prefill: not run: the _hpc_C library has no prefill")
        return 1
    max_gb = args.max_gb
    if max_gb is None:
        props = torch.cuda.get_device_properties()
        max_gb = min(MAX_GB, MEMORY_SHARE * props.total_memory / 1e9)
    opts = Options(
        iters=args.iters,
        warmup=args.warmup,
        baselines=tuple(b for b in args.baselines.split(",") if b),
        max_bytes=int(max_gb * 1e9),
    )

    missing = find_missing(opts.baselines)
    bandwidth = measure_copy_bandwidth_gbps()
    tflops, rates, rate_notes = floor_matmul_tflops()
    bf16_rate, fp8_rate = tflops["bf16"], tflops["fp8"]
    torch.accelerator.empty_cache()
    env = Env(
        hpc_ops=hpc_ops,
        bandwidth_gbps=bandwidth,
        tflops=tflops,
        scrub=L2Scrub(),
        missing=missing,
    )
    print(
        f"copy bandwidth {bandwidth:.0f} GB/s, matmul bf16 {bf16_rate:.0f} "
        f"TFLOP/s, fp8 {fp8_rate:.0f} TFLOP/s; {len(cases)} prefill cases, "
        f"{len(plans)} planner cases"
    )

    records: list[dict[str, Any]] = []
    sound = True
    device_lost = None
    try:
        for case in cases:
            sound &= run_guarded(
                "W5",
                case.name,
                lambda case=case: bench_case(case, env, opts),
                lambda error, case=case: make_record(
                    "W5",
                    case.name,
                    HPC,
                    None,
                    case_floor_us(case, env.tflops),
                    error=error,
                ),
                records,
                started,
            )
        for name, tp, shape in plans:
            case_records, ok = bench_plan(name, tp, shape, env, opts)
            sound &= ok
            records.extend(case_records)
            print_progress("PLAN", name, case_records, started)
    except DeviceLost as err:
        device_lost = str(err)
        sound = False
        print(
            f"benchmark_hpc_prefill: the device failed ({err}); later cases did not run"
        )

    extra: dict[str, Any] = {
        "matmul_tflops": {
            k: None if v is None else round(v, 1) for k, v in rates.items()
        },
        "matmul_notes": rate_notes,
        "block_size": args.block_size,
        "skipped": missing,
    }
    if device_lost is not None:
        extra["device_lost"] = device_lost
    if args.merge is not None:
        records, extra["merged"] = merge_into(args.merge, records, args.block_size)
    finish_run(
        RESULT_NAME,
        records,
        bandwidth,
        args.out,
        impl=HPC,
        started=started,
        extra=extra,
    )
    return 0 if sound else 1


if __name__ == "__main__":
    sys.exit(main())
