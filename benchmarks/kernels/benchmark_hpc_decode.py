# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmark of split-KV paged decode attention (W1, W1B, W2) and its planner.

Workloads (head size 128, block size 64; ``tp1`` = 64 q / 8 kv heads, ``tp8``
= 8 q / 1 kv head; KV cache bf16, or fp8_e4m3 with per-tensor K/V scales
and bf16 queries; the HPC_ATTN cache layout: one ``(num_blocks, Hkv, 64,
2 * D)`` tensor whose K and V are permuted slices):

* W1 mixed decode: one query token per sequence, context lengths
  [131072] + [4096] * 31. Cases ``<tp>-<bf16|fp8>``.
* W1B chained decode: W1's cases (same names) as a model runs them, 8 layers
  back to back in one CUDA graph, each layer with its own KV cache, queries
  and output (so no layer finds another's KV in L2) and the same call as
  W1's single-call graph. Work done once per step for all layers runs once
  per graph: ``hpc`` and ``static`` run the decode planner in the graph,
  before the first layer, and it is counted (``us_without_plan`` times the
  8 layers alone), while the baselines' per-step work stays outside it as
  their vLLM backends do it (``step_work`` in each record says what). Times
  are per layer: graph time / 8.
* W2 uniform decode: batch {1, 8, 32, 64, 128, 256} x context {1024, 4096,
  32768} x query tokens {1, 2, 4}. Cases
  ``<tp>-<bf16|fp8>-b<batch>x<context>-q<tokens>``; every case in bf16, a
  subset in fp8 (all with ``--fp8-all``). The context counts the query
  tokens, which attend causally to each other.
* PLAN: the GPU planner ``DecodeWorkspace.plan``, run once per step for all
  layers, timed on its own as one of 20 back-to-back calls in a CUDA graph
  (it runs inside the model's graph; a graph of one call, launch included,
  is recorded as ``us_single_graph``). Cases ``b<batch>`` (``b32``: W1's
  lengths, else uniform 4096-token contexts), ``tp1`` KV heads; ``static``
  times the static mode's planner. Floor: the lengths read and the plan
  written.

Protocol: what a user pays per layer, ``decode_attention`` (one kernel:
decode and the merge of split sequences), runs as CUDA-graph replays timed
one by one with CUDA events; warm-up, then the median of at least 50. The
plan is computed once before capture, as the backend does once per step.
Every input set (its own KV cache tensor, queries and output) gets its own
graph and the sets are replayed round-robin: at least 4 sets and, up to 64,
enough for 240 MB of KV. Cases whose sets would exceed ``--max-kv-gb`` use
fewer sets (recorded as ``num_sets``; one set of such a case is many times
the L2 cache), and a case whose single set does not fit is skipped. W1B
rotates graphs of 8 sets each (one graph for every W1 case: 8 layers' KV
are at least 8 x 66 MB). When the KV bytes the rotation touches are under
four times the L2 cache, L2 is scrubbed before each timed replay, outside
the timed region. The floor (W1B: per layer): all
K and V bytes of the batch read once (sum of lengths x Hkv x D x 2 x element
size) at the device-to-device copy bandwidth measured in the same run.

Implementations, timed the same way on the same inputs:

* ``hpc``: ``SplitMode.BALANCED`` (the backend's default);
* ``static``: the same kernels with ``SplitMode.STATIC`` (classic split-KV);
* ``flex_attention``: ``torch.compile(flex_attention)`` (static shapes, so
  one compilation per case) over a paged BlockMask. The cache is used in
  place: its rows of 2 * D read as one ``[1, 1, pages * 64, D]`` K (and V)
  with the KV heads folded into the batch, so each (sequence, KV head) row
  reads only its own pages through the block table, and a ``mask_mod`` maps
  physical to logical positions for the length and causal limits. (torch's
  experimental ``PagedAttention`` helper wants a ``[1, Hkv, pages * 64, D]``
  cache, which cannot view this layout when Hkv > 1, and dense per-batch
  page tables; its mechanism is used directly.) The query regrouping (a
  copy when q > 1) and the FP8 V scale are timed with it;
* ``fa3`` and ``fa3_capped``: vLLM's FlashAttention-3
  (``flash_attn_varlen_func``, ``fa_version=3``) on the same paged cache, as
  vLLM's FLASH_ATTN backend calls it for decode: ``cu_seqlens_q``,
  ``seqused_k``, the block table, and scheduler metadata from
  ``get_scheduler_metadata`` computed once before capture (vLLM's builder
  computes it once per step). ``fa3`` passes ``num_splits=0``, FA3's own
  split heuristic, which is what vLLM runs outside full CUDA graphs;
  ``fa3_capped`` passes ``num_splits=32`` to both calls, vLLM's cap under
  full CUDA graphs (``flash_attn_max_num_splits_for_cuda_graph``), the
  default for decode batches. FA3 takes the K and V views of this cache as
  they are (last dim contiguous, token stride 2 * D, page stride Hkv * 64 *
  2 * D), with size-1 strides canonicalised as vLLM does. With an FP8 cache
  FA3 needs E4M3 queries too: each set's bf16 queries are cast to E4M3
  (scale 1, as vLLM's static query scale defaults to) before capture, so the
  cast is not timed (vLLM's attention layer quantises the query before the
  call), and FA3 is checked against a reference of those E4M3 queries;
  descales are (batch, Hkv) expansions of the per-tensor scales. Only where
  ``vllm.vllm_flash_attn`` imports and reports FA3 supported; otherwise
  both are skipped with the reason (JSON ``skipped``);
* ``triton_unified`` (vLLM's ``unified_attention``) and ``flashinfer``, only
  where they import.

Before timing, every implementation's output is compared with a float32
reference on a few sequences (``ref_rel_err``), and the ``hpc`` output with
every other output over the whole batch (``max_abs_diff``): a baseline that
fails is recorded with its error and not timed; a failing ``hpc`` result is
recorded without a time and makes the run exit 1. W1B checks each layer's
call as W1 does, then every layer's output of one replay of the chained
graph (poisoned with NaN first) against its float32 reference. Results go
to ``benchmarks/results/benchmark_hpc_decode.json``.
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

import torch
from bench_utils import (
    CheckedImpls,
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
    gather_tokens,
    import_attn_workspace,
    import_hpc_ops,
    json_float,
    make_record,
    max_abs_diff,
    measure_copy_bandwidth_gbps,
    merge_records,
    missing_baselines,
    missing_fa3,
    print_progress,
    ratios_over,
    relative_error,
    run_flashinfer_hnd,
    run_guarded,
    short_error,
    sync_quietly,
    time_graphs,
    time_impls,
    unavailable_reason,
    validated_op,
)

RESULT_NAME = Path(__file__).stem + ".json"

HEAD_CONFIGS = {"tp1": (64, 8), "tp8": (8, 1)}
HEAD_SIZE = 128
BLOCK_SIZE = 64
SCALE = HEAD_SIZE**-0.5
FP8 = torch.float8_e4m3fn
K_SCALE = 0.5
V_SCALE = 0.75

W1_LENGTHS = (131072,) + (4096,) * 31
W2_BATCHES = (1, 8, 32, 64, 128, 256)
W2_CONTEXTS = (1024, 4096, 32768)
W2_QUERY_TOKENS = (1, 2, 4)
# fp8 cases of the default W2 run (all of them with --fp8-all).
W2_FP8_BATCHES = (1, 32, 128)
W2_FP8_QUERY_TOKENS = (1, 4)
QUICK_W2 = ("tp1-bf16-b64x4096-q1", "tp8-bf16-b1x1024-q1")
PLAN_BATCHES = (1, 8, 32, 64, 128, 256)
QUICK_PLAN_BATCHES = (32, 256)
PLAN_CONTEXT = 4096
WORKLOADS = ("W1", "W1B", "W2", "PLAN")
# Layers chained in one W1B graph.
W1B_LAYERS = 8

ROTATION_BYTES = 240 * 10**6
MIN_SETS = 4
MAX_SETS = 64
# Memory for one case's rotated input sets: this share of the device's
# memory, at most MAX_KV_GB.
KV_MEMORY_SHARE = 0.6
MAX_KV_GB = 90.0
MIN_ITERS = 50
# Sequences the float32 reference checks: the first, the last and the
# longest.
REF_SEQS = 3
# ||out - ref|| / ||ref|| allowed before an output counts as wrong (loose:
# this guards the timings, the tests hold the accuracy bars).
REL_TOL = {False: 2e-2, True: 5e-2}

HPC = "hpc"
STATIC = "static"
FLEX = "flex_attention"
TRITON = "triton_unified"
FLASHINFER = "flashinfer"
FA3 = "fa3"
FA3_CAPPED = "fa3_capped"
BASELINES = (STATIC, FA3, FA3_CAPPED, FLEX, TRITON, FLASHINFER)
# num_splits of each FA3 baseline: 0 lets FA3's heuristic choose; 32 is
# vLLM's cap under full CUDA graphs (AttentionConfig's
# flash_attn_max_num_splits_for_cuda_graph), passed to the scheduler
# metadata and to the call alike, as vLLM's FLASH_ATTN backend does.
FA3_SPLITS = {FA3: 0, FA3_CAPPED: 32}
FLEX_VARIANT = (
    "paged BlockMask over the cache blocks (block table), KV heads folded "
    "into the batch, cache used in place, flex decoding kernel"
)
# What each implementation does once per step for all layers, and whether
# the W1B graph holds it (a model pays it once per step, so hpc's planner is
# counted once for all the graph's layers).
STEP_WORK = {
    HPC: f"decode planner once per graph, before the {W1B_LAYERS} layers (counted)",
    STATIC: (
        f"static-mode planner once per graph, before the {W1B_LAYERS} layers (counted)"
    ),
    FA3: "get_scheduler_metadata once before capture (not counted)",
    FA3_CAPPED: "get_scheduler_metadata once before capture (not counted)",
    FLEX: "BlockMask built once before capture (not counted)",
    TRITON: "none",
    FLASHINFER: "plan() on the host once before capture (not counted)",
}


# ---------------------------------------------------------------------------
# Cases and inputs
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    workload: str
    tp: str
    fp8: bool
    lengths: tuple[int, ...]
    query_tokens: int

    @property
    def name(self) -> str:
        cache = "fp8" if self.fp8 else "bf16"
        if self.workload in ("W1", "W1B"):
            return f"{self.tp}-{cache}"
        return f"{self.tp}-{cache}-b{self.batch}x{self.lengths[0]}-q{self.query_tokens}"

    @property
    def heads(self) -> tuple[int, int]:
        return HEAD_CONFIGS[self.tp]

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def kv_dtype(self) -> torch.dtype:
        return FP8 if self.fp8 else torch.bfloat16

    @property
    def elem_bytes(self) -> int:
        return 1 if self.fp8 else 2

    @property
    def num_blocks(self) -> int:
        return sum(math.ceil(n / BLOCK_SIZE) for n in self.lengths)

    def kv_bytes(self) -> int:
        _, hkv = self.heads
        return self.num_blocks * hkv * BLOCK_SIZE * 2 * HEAD_SIZE * self.elem_bytes

    def set_bytes(self) -> int:
        """One input set: the KV cache, the queries and the output (and the
        E4M3 queries FA3 takes with an FP8 cache)."""
        hq, _ = self.heads
        rows = self.batch * self.query_tokens * hq * HEAD_SIZE
        return self.kv_bytes() + 2 * rows * 2 + (rows if self.fp8 else 0)

    def floor_bytes(self) -> int:
        """Every K and V element of the batch read once."""
        _, hkv = self.heads
        return sum(self.lengths) * hkv * HEAD_SIZE * 2 * self.elem_bytes


def w1_cases() -> list[Case]:
    return [
        Case("W1", tp, fp8, W1_LENGTHS, 1)
        for tp in HEAD_CONFIGS
        for fp8 in (False, True)
    ]


def w1b_cases() -> list[Case]:
    return [dataclasses.replace(c, workload="W1B") for c in w1_cases()]


def w2_cases(fp8_all: bool) -> list[Case]:
    cases = []
    for tp in HEAD_CONFIGS:
        for fp8 in (False, True):
            for batch in W2_BATCHES:
                for context in W2_CONTEXTS:
                    for q in W2_QUERY_TOKENS:
                        default_fp8 = (
                            batch in W2_FP8_BATCHES and q in W2_FP8_QUERY_TOKENS
                        )
                        if fp8 and not (fp8_all or default_fp8):
                            continue
                        cases.append(Case("W2", tp, fp8, (context,) * batch, q))
    return cases


@dataclasses.dataclass
class Layout:
    """What every input set of a case shares: lengths, block table, scales."""

    kv_lens: torch.Tensor  # int32 [batch], cuda
    block_table: torch.Tensor  # int32 [batch, max_blocks], cuda
    block_table_cpu: torch.Tensor
    k_scale: torch.Tensor | None  # float32 [1], fp8 only
    v_scale: torch.Tensor | None


def make_layout(case: Case, seed: int = 0, device: str = "cuda") -> Layout:
    """Each sequence gets its own blocks, shuffled over the cache."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [math.ceil(n / BLOCK_SIZE) for n in case.lengths]
    perm = torch.randperm(case.num_blocks, generator=gen, dtype=torch.int32)
    table = torch.zeros(case.batch, max(blocks), dtype=torch.int32)
    first = 0
    for b, nb in enumerate(blocks):
        table[b, :nb] = perm[first : first + nb]
        first += nb
    scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
    if case.fp8:
        scales = (
            torch.tensor([K_SCALE], device=device),
            torch.tensor([V_SCALE], device=device),
        )
    return Layout(
        kv_lens=torch.tensor(case.lengths, dtype=torch.int32, device=device),
        block_table=table.to(device),
        block_table_cpu=table,
        k_scale=scales[0],
        v_scale=scales[1],
    )


@dataclasses.dataclass
class InputSet:
    kv: torch.Tensor  # (num_blocks, Hkv, block_size, 2 * D)
    key_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D] views
    value_cache: torch.Tensor
    q: torch.Tensor  # [batch * query_tokens, Hq, D] bf16
    out: torch.Tensor
    # q cast to E4M3, for FA3 with an FP8 cache (it wants one dtype for Q, K
    # and V); None for bf16 caches.
    q_fp8: torch.Tensor | None = None


def make_input_set(case: Case, seed: int, device: str = "cuda") -> InputSet:
    hq, hkv = case.heads
    gen = torch.Generator(device=device).manual_seed(seed)
    kv = torch.empty(
        case.num_blocks,
        hkv,
        BLOCK_SIZE,
        2 * HEAD_SIZE,
        dtype=case.kv_dtype,
        device=device,
    )
    fill_normal_(kv, gen)
    tokens = case.batch * case.query_tokens
    q = torch.randn(
        tokens, hq, HEAD_SIZE, generator=gen, device=device, dtype=torch.bfloat16
    )
    return InputSet(
        kv=kv,
        key_cache=kv[..., :HEAD_SIZE].permute(0, 2, 1, 3),
        value_cache=kv[..., HEAD_SIZE:].permute(0, 2, 1, 3),
        q=q,
        out=torch.empty_like(q),
        q_fp8=q.to(FP8) if case.fp8 else None,
    )


# ---------------------------------------------------------------------------
# Implementations: each runs one input set and returns its output
# ---------------------------------------------------------------------------

Impl = Callable[[InputSet], torch.Tensor]


class HpcDecode:
    """``decode_attention`` of one input set (one layer's call) over the
    workspace of a step; :meth:`plan` is the step's planner, which the
    backend runs once per step for all layers. It runs once here, so a
    single call's graph holds the attention call alone; W1B's graph runs it
    again before its layers."""

    def __init__(
        self, case: Case, layout: Layout, hpc_ops: ModuleType, mode: Any
    ) -> None:
        hq, hkv = case.heads
        self.layout = layout
        self.q_tokens = case.query_tokens
        self.attention = validated_op("decode_attention", hpc_ops)
        self.ws = import_attn_workspace().DecodeWorkspace.create(
            max_batch=case.batch,
            num_q_heads=hq,
            num_kv_heads=hkv,
            head_size=HEAD_SIZE,
            max_kv_tokens=case.num_blocks * BLOCK_SIZE,
            device=layout.kv_lens.device,
            max_query_tokens=self.q_tokens,
            kv_cache_dtype=case.kv_dtype,
            mode=mode,
        )
        self.plan()

    def plan(self) -> None:
        self.ws.plan(self.layout.kv_lens, self.q_tokens)

    def __call__(self, s: Any) -> torch.Tensor:
        layout = self.layout
        self.attention(
            s.q,
            s.key_cache,
            s.value_cache,
            layout.block_table,
            layout.kv_lens,
            s.out,
            self.ws,
            scale=SCALE,
            query_tokens=self.q_tokens,
            k_scale=layout.k_scale,
            v_scale=layout.v_scale,
        )
        return s.out


def make_hpc(case: Case, layout: Layout, hpc_ops: ModuleType, mode: Any) -> HpcDecode:
    return HpcDecode(case, layout, hpc_ops, mode)


def fa3_variant(num_splits: int, fp8: bool) -> str:
    splits = (
        "num_splits=0 (FA3's heuristic)"
        if num_splits == 0
        else f"num_splits={num_splits} (vLLM's cap under full CUDA graphs)"
    )
    text = (
        "flash_attn_varlen_func fa_version=3 on the cache in place (block "
        f"table), {splits}, scheduler metadata from get_scheduler_metadata "
        "once before capture"
    )
    if fp8:
        text += ", E4M3 queries cast (scale 1) before capture, (batch, Hkv) descales"
    return text


def make_fa3(
    case: Case, layout: Layout, num_splits: int, notes: dict[str, str], name: str
) -> Impl:
    """The FLASH_ATTN decode call of vLLM (flash_attn.py ``forward``): the step's
    scheduler metadata once, here, then one ``flash_attn_varlen_func`` per
    call with the same ``num_splits``."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    hq, hkv = case.heads
    batch, q_tokens = case.batch, case.query_tokens
    device = layout.kv_lens.device
    cu_seqlens_q = torch.arange(
        0, (batch + 1) * q_tokens, q_tokens, dtype=torch.int32, device=device
    )
    max_len = max(case.lengths)
    descales: dict[str, torch.Tensor] = {}
    if case.fp8:
        assert layout.k_scale is not None and layout.v_scale is not None
        shape = (batch, hkv)
        one = torch.ones(1, dtype=torch.float32, device=device)
        descales = {
            "q_descale": one.expand(shape),
            "k_descale": layout.k_scale.expand(shape),
            "v_descale": layout.v_scale.expand(shape),
        }
    metadata, error = fa3_scheduler_metadata(
        batch_size=batch,
        max_seqlen_q=q_tokens,
        max_seqlen_k=max_len,
        num_heads_q=hq,
        num_heads_kv=hkv,
        headdim=HEAD_SIZE,
        cache_seqlens=layout.kv_lens,
        qkv_dtype=case.kv_dtype,
        cu_seqlens_q=cu_seqlens_q,
        page_size=BLOCK_SIZE,
        causal=True,
        num_splits=num_splits,
    )
    notes[name] = fa3_variant(num_splits, case.fp8)
    if error is not None:
        notes[name] += f"; no scheduler metadata (get_scheduler_metadata: {error})"

    def run(s: InputSet) -> torch.Tensor:
        k, v = fa3_kv_views(s.key_cache, s.value_cache)
        flash_attn_varlen_func(
            q=s.q_fp8 if case.fp8 else s.q,
            k=k,
            v=v,
            max_seqlen_q=q_tokens,
            cu_seqlens_q=cu_seqlens_q,
            max_seqlen_k=max_len,
            seqused_k=layout.kv_lens,
            softmax_scale=SCALE,
            causal=True,
            block_table=layout.block_table,
            out=s.out,
            scheduler_metadata=metadata,
            num_splits=num_splits,
            fa_version=3,
            **descales,
        )
        return s.out

    return run


class FlexPaged:
    """FlexAttention over the paged cache, in place.

    The cache tensor ``(num_blocks, Hkv, 64, 2 * D)`` read as rows of 2 * D
    is a ``[1, 1, num_blocks * Hkv * 64, D]`` K (and V, offset by D) view in
    which block ``p`` of KV head ``h`` is page ``p * Hkv + h``. Queries are
    regrouped as batch ``b * Hkv + h`` with the GQA group as heads, so each
    row's BlockMask lists exactly its sequence's pages for its KV head
    (every block partial, as vLLM's FlexAttention backend builds them, which
    lets the decoding kernel split each row's own blocks over its CTAs), and
    ``mask_mod`` maps a physical position to its sequence and logical
    position for the length and causal limits.
    """

    def __init__(self, case: Case, layout: Layout, device: str = "cuda") -> None:
        hq, hkv = case.heads
        self.batch, self.kv_heads = case.batch, hkv
        self.group, self.q_tokens = hq // hkv, case.query_tokens
        num_pages = case.num_blocks * hkv
        self.tokens = num_pages * BLOCK_SIZE

        table = layout.block_table_cpu.long()
        lengths = torch.tensor(case.lengths)
        blocks = (lengths + BLOCK_SIZE - 1) // BLOCK_SIZE
        heads = torch.arange(hkv)
        pages = table[:, None, :] * hkv + heads[None, :, None]  # [B, Hkv, max]
        rows = self.batch * hkv
        kv_indices = pages.reshape(rows, 1, 1, -1).to(torch.int32)
        kv_num_blocks = blocks.repeat_interleave(hkv).view(rows, 1, 1)
        live = torch.arange(table.shape[1])[None, None, :] < blocks[:, None, None]
        live = live.expand_as(pages)
        owner, logical = flex_page_maps(pages, num_pages, live)
        page_owner, page_logical = owner.to(device), logical.to(device)
        # Query t of a row sees logical positions <= len - q_tokens + t.
        limit = (lengths - self.q_tokens).repeat_interleave(hkv).to(torch.int32)
        limit = limit.to(device)
        self.block_mask = flex_paged_block_mask(
            kv_num_blocks,
            kv_indices,
            BLOCK_SIZE,
            page_owner,
            page_logical,
            limit,
            (self.q_tokens, self.tokens),
            device=device,
        )
        self.scale = SCALE * (K_SCALE if case.fp8 else 1.0)
        self.out_scale = V_SCALE if case.fp8 else 1.0

    def __call__(
        self,
        fn: Callable[..., torch.Tensor],
        q: torch.Tensor,
        kv: torch.Tensor,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Attention of ``q`` ([batch * q_tokens, Hq, D]) over the cache
        ``kv``; the result lands in ``out`` unless it is a view of flex's
        own output (one query token, no V scale)."""
        b, hkv, g, t = self.batch, self.kv_heads, self.group, self.q_tokens
        d = q.shape[-1]
        # Rows b * Hkv + h, heads = the GQA group (a copy only when t > 1).
        qf = q.view(b, t, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b * hkv, g, t, d)
        k, v = flex_kv_views(kv, self.tokens, HEAD_SIZE)
        o = fn(qf, k, v, block_mask=self.block_mask, scale=self.scale, enable_gqa=True)
        o = o.reshape(b, hkv, g, t, d).permute(0, 3, 1, 2, 4)  # [b, t, Hkv, g, D]
        if t == 1 and self.out_scale == 1.0:
            return o.reshape(b * t, hkv * g, d)
        torch.mul(o, self.out_scale, out=out.view(b, t, hkv, g, d))
        return out


def make_flex(case: Case, layout: Layout) -> Impl:
    paged = FlexPaged(case, layout)
    fn = compiled_flex()

    def run(s: InputSet) -> torch.Tensor:
        return paged(fn, s.q, s.kv, s.out)

    return run


def make_triton(case: Case, layout: Layout) -> Impl:
    """The Triton backend call of vLLM (triton_attn.py), with its split-KV (3D)
    scratch sized as the backend sizes it."""
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    from vllm.v1.kv_cache_interface import KVQuantMode

    hq, hkv = case.heads
    batch, q_tokens = case.batch, case.query_tokens
    segments = 16
    threshold = max(1, 128 // hkv)
    scratch_rows = min(threshold, batch) * q_tokens
    f32 = {"dtype": torch.float32, "device": "cuda"}
    segm_out = torch.empty(scratch_rows, hq, segments, HEAD_SIZE, **f32)
    segm_max = torch.empty(scratch_rows, hq, segments, **f32)
    segm_expsum = torch.empty(scratch_rows, hq, segments, **f32)
    cu_seqlens_q = torch.arange(
        0, (batch + 1) * q_tokens, q_tokens, dtype=torch.int32, device="cuda"
    )
    one = torch.ones(1, **f32)
    k_scale = layout.k_scale if layout.k_scale is not None else one
    v_scale = layout.v_scale if layout.v_scale is not None else one
    k_descale = k_scale.expand(batch, hkv)
    v_descale = v_scale.expand(batch, hkv)
    quant = KVQuantMode.FP8_PER_TENSOR if case.fp8 else KVQuantMode.NONE
    max_len = max(case.lengths)

    def run(s: InputSet) -> torch.Tensor:
        unified_attention(
            q=s.q,
            k=s.key_cache,
            v=s.value_cache,
            out=s.out,
            cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=q_tokens,
            seqused_k=layout.kv_lens,
            max_seqlen_k=max_len,
            softmax_scale=SCALE,
            causal=True,
            window_size=(-1, -1),
            block_table=layout.block_table,
            softcap=0,
            q_descale=None,
            k_descale=k_descale,
            v_descale=v_descale,
            seq_threshold_3D=threshold,
            num_par_softmax_segments=segments,
            softmax_segm_output=segm_out,
            softmax_segm_max=segm_max,
            softmax_segm_expsum=segm_expsum,
            kv_quant_mode=quant,
        )
        return s.out

    return run


def make_flashinfer(case: Case, layout: Layout) -> Impl:
    """FlashInfer's paged decode wrapper (one query token) or its paged
    prefill wrapper with a causal mask (several), HND cache views, plan
    outside the graph."""
    import flashinfer

    hq, hkv = case.heads
    batch, q_tokens = case.batch, case.query_tokens
    lengths = torch.tensor(case.lengths, dtype=torch.int32)
    blocks = (lengths + BLOCK_SIZE - 1) // BLOCK_SIZE
    indptr = torch.zeros(batch + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(blocks, 0)
    indices = torch.cat(
        [layout.block_table_cpu[b, : int(n)] for b, n in enumerate(blocks)]
    )
    last_page_len = (lengths - 1) % BLOCK_SIZE + 1
    indptr, indices = indptr.cuda(), indices.cuda()
    last_page_len = last_page_len.cuda()
    workspace = torch.zeros(256 * 2**20, dtype=torch.uint8, device="cuda")
    common = {
        "q_data_type": torch.bfloat16,
        "kv_data_type": case.kv_dtype,
        "sm_scale": SCALE,
    }
    if q_tokens == 1:
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace,
            "HND",
            use_cuda_graph=True,
            use_tensor_cores=True,
            paged_kv_indptr_buffer=indptr,
            paged_kv_indices_buffer=indices,
            paged_kv_last_page_len_buffer=last_page_len,
        )
        wrapper.plan(
            indptr, indices, last_page_len, hq, hkv, HEAD_SIZE, BLOCK_SIZE, **common
        )
    else:
        qo_indptr = torch.arange(
            0, (batch + 1) * q_tokens, q_tokens, dtype=torch.int32, device="cuda"
        )
        wrapper = flashinfer_prefill_wrapper(
            workspace,
            qo_indptr,
            indptr,
            indices,
            last_page_len,
            hq,
            hkv,
            HEAD_SIZE,
            BLOCK_SIZE,
            **common,
        )
    scales: dict[str, float] = {}
    if case.fp8:
        scales = {"k_scale": K_SCALE, "v_scale": V_SCALE}

    def run(s: InputSet) -> torch.Tensor:
        return run_flashinfer_hnd(wrapper, s.q, s.kv, s.out, HEAD_SIZE, scales)

    return run


# ---------------------------------------------------------------------------
# Checking
# ---------------------------------------------------------------------------


def reference_rows(
    case: Case,
    layout: Layout,
    s: Any,
    seqs: list[int],
    queries: torch.Tensor | None = None,
) -> dict[int, torch.Tensor]:
    """Float32 attention of the given sequences: [q_tokens, Hq, D] each, of
    the set's queries or of ``queries`` (e.g. the E4M3 ones)."""
    q_tokens = case.query_tokens
    k_scale = K_SCALE if case.fp8 else 1.0
    v_scale = V_SCALE if case.fp8 else 1.0
    queries = s.q if queries is None else queries
    refs = {}
    for b in seqs:
        n = case.lengths[b]
        table = layout.block_table_cpu[b, : math.ceil(n / BLOCK_SIZE)]
        blocks = table.long().to(queries.device)
        k = gather_tokens(s.key_cache, blocks, n) * k_scale
        v = gather_tokens(s.value_cache, blocks, n) * v_scale
        q = queries[b * q_tokens : (b + 1) * q_tokens].float()
        last = n - q_tokens + torch.arange(q_tokens, device=q.device)
        refs[b] = causal_attention_rows(q, k, v, last, SCALE)
    return refs


def ref_seqs(case: Case) -> list[int]:
    longest = max(range(case.batch), key=lambda b: case.lengths[b])
    return sorted({0, case.batch - 1, longest})[:REF_SEQS]


def rel_error(out: torch.Tensor, refs: dict[int, torch.Tensor], q_tokens: int) -> float:
    got = torch.cat([out[b * q_tokens : (b + 1) * q_tokens] for b in refs])
    return relative_error(got, torch.cat(list(refs.values())))


def takes_fp8_query(case: Case, name: str) -> bool:
    """Whether ``name`` reads the set's E4M3 queries (FA3 with an FP8
    cache) instead of its bf16 ones."""
    return case.fp8 and name in FA3_SPLITS


class Refs:
    """Float32 reference rows of a case's input sets, per query form (the
    bf16 queries, or the E4M3 ones FA3 takes with an FP8 cache), each
    computed when first asked for."""

    def __init__(self, case: Case, layout: Layout, sets: list[InputSet]) -> None:
        self.case, self.layout, self.sets = case, layout, sets
        self.seqs = ref_seqs(case)
        self._rows: dict[tuple[int, bool], dict[int, torch.Tensor]] = {}

    def get(self, index: int, fp8_query: bool) -> dict[int, torch.Tensor]:
        key = (index, fp8_query)
        if key not in self._rows:
            s = self.sets[index]
            queries = s.q_fp8 if fp8_query else None
            self._rows[key] = reference_rows(
                self.case, self.layout, s, self.seqs, queries
            )
        return self._rows[key]

    def error(self, index: int, fp8_query: bool, out: torch.Tensor) -> float:
        return rel_error(out, self.get(index, fp8_query), self.case.query_tokens)


def check_case(
    case: Case,
    names: list[str],
    makers: dict[str, Callable[[], Impl]],
    first: InputSet,
    refs: Refs,
) -> CheckedImpls:
    """:func:`check_impls` on the first input set, each implementation
    against the reference of the queries it reads."""
    checked = CheckedImpls({}, {}, {}, {})
    tol = REL_TOL[case.fp8]
    for fp8_query in (False, True):
        group = [n for n in names if takes_fp8_query(case, n) == fp8_query]
        if not group:
            continue
        part = check_impls(
            group,
            makers,
            first,
            lambda out, q8=fp8_query: refs.error(0, q8, out),
            tol,
            "float32 reference" + (" of the E4M3 queries" if fp8_query else ""),
        )
        checked.impls.update(part.impls)
        checked.outputs.update(part.outputs)
        checked.errors.update(part.errors)
        checked.ref_err.update(part.ref_err)
    return checked


def impl_makers(
    case: Case, layout: Layout, hpc_ops: ModuleType, notes: dict[str, str]
) -> dict[str, Callable[[], Impl]]:
    """How to build each implementation of a case; FA3 and FlexAttention
    write how they were called into ``notes``."""

    def flex() -> Impl:
        notes[FLEX] = FLEX_VARIANT
        return make_flex(case, layout)

    makers: dict[str, Callable[[], Impl]] = {
        HPC: lambda: make_hpc(case, layout, hpc_ops, hpc_ops.SplitMode.BALANCED),
        STATIC: lambda: make_hpc(case, layout, hpc_ops, hpc_ops.SplitMode.STATIC),
        FLEX: flex,
        TRITON: lambda: make_triton(case, layout),
        FLASHINFER: lambda: make_flashinfer(case, layout),
    }
    for name, splits in FA3_SPLITS.items():
        makers[name] = lambda n=name, k=splits: make_fa3(case, layout, k, notes, n)
    return makers


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Options:
    iters: int
    warmup: int
    baselines: tuple[str, ...]
    max_kv_bytes: int


@dataclasses.dataclass
class Env:
    hpc_ops: ModuleType
    bandwidth_gbps: float
    scrub: L2Scrub
    missing: dict[str, str]  # baseline -> why it does not import


def choose_num_sets(case: Case, opts: Options) -> int:
    """Sets to rotate: enough for ROTATION_BYTES within [MIN_SETS, MAX_SETS],
    fewer where they would pass the memory budget (0: even one does not)."""
    size = case.set_bytes()
    wanted = min(MAX_SETS, max(MIN_SETS, math.ceil(ROTATION_BYTES / size)))
    return min(wanted, opts.max_kv_bytes // size)


def bench_case(case: Case, env: Env, opts: Options) -> tuple[list[dict], bool]:
    """Records of one W1/W2 case and whether the hpc result is sound."""
    floor_us = case.floor_bytes() / (env.bandwidth_gbps * 1e3)
    num_sets = choose_num_sets(case, opts)
    if num_sets < 1:
        gb = case.set_bytes() / 1e9
        reason = f"skipped: one input set is {gb:.1f} GB, over the --max-kv-gb budget"
        record = make_record(
            case.workload, case.name, HPC, None, floor_us, error=reason
        )
        return [record], True

    layout = make_layout(case)
    sets = [make_input_set(case, seed=i) for i in range(num_sets)]
    touched = num_sets * case.floor_bytes()
    scrub = env.scrub if touched < 4 * env.scrub.l2_bytes else None

    notes: dict[str, str] = {}
    makers = impl_makers(case, layout, env.hpc_ops, notes)
    names = impl_names(opts, env)
    checked = check_case(case, names, makers, sets[0], Refs(case, layout, sets))
    impls, outputs, errors, ref_err = (
        checked.impls,
        checked.outputs,
        checked.errors,
        checked.ref_err,
    )

    diffs = {}
    if HPC in outputs:
        diffs = {
            name: json_float(max_abs_diff(outputs[HPC], out), 3)
            for name, out in outputs.items()
            if name != HPC
        }
    del outputs

    timings: dict[str, float] = {}
    if HPC in impls:
        timings = time_impls(impls, sets, opts.iters, opts.warmup, scrub, errors, HPC)

    ok = HPC in timings
    records = []
    for name in names:
        extra: dict[str, Any] = {}
        if name in ref_err:
            extra["ref_rel_err"] = json_float(ref_err[name], 3)
        if name == HPC:
            extra["num_sets"] = num_sets
            extra["rotated_gb"] = round(num_sets * case.set_bytes() / 1e9, 3)
            extra["l2_scrub"] = scrub is not None
            extra["max_abs_diff"] = diffs
        records.append(impl_record(case, name, timings, errors, notes, floor_us, extra))
    return records, ok


def impl_record(
    case: Case,
    name: str,
    timings: dict[str, float],
    errors: dict[str, str],
    notes: dict[str, str],
    floor_us: float,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """One implementation's record of a case: its time (or why it has
    none), its variant note, and for ``hpc`` the ratios over the others."""
    if name in notes:
        extra["variant"] = notes[name]
    if name not in timings:
        extra["error"] = errors.get(name, "not timed: the hpc result failed")
    record = make_record(
        case.workload, case.name, name, timings.get(name), floor_us, **extra
    )
    if name == HPC:
        record["ratios"] = ratios_over(timings, HPC)
    return record


def impl_names(opts: Options, env: Env) -> list[str]:
    """``hpc`` and the asked-for baselines that import here."""
    return [HPC] + [b for b in opts.baselines if b not in env.missing]


def choose_num_graphs(case: Case, opts: Options) -> int:
    """W1B graphs to rotate, each of W1B_LAYERS input sets: as many sets as
    a single call's rotation would use, in whole graphs, fewer where they
    would pass the memory budget (0: even one graph does not fit)."""
    size = case.set_bytes()
    wanted = min(MAX_SETS, max(MIN_SETS, math.ceil(ROTATION_BYTES / size)))
    return min(math.ceil(wanted / W1B_LAYERS), opts.max_kv_bytes // (W1B_LAYERS * size))


def chain_layers(
    impl: Callable[[Any], torch.Tensor], plan: bool = True
) -> Callable[[list[Any]], list[torch.Tensor]]:
    """One step of a model's layers: the implementation's per-step planner
    (when it has one and ``plan``), then its call on each layer's set in
    order; returns every layer's output."""
    step = getattr(impl, "plan", None) if plan else None

    def run(layers: list[Any]) -> list[torch.Tensor]:
        if step is not None:
            step()
        return [impl(s) for s in layers]

    return run


def check_replay(
    graph: torch.cuda.CUDAGraph, outs: list[torch.Tensor], error: Callable[..., float]
) -> list[float]:
    """Relative error of each layer's output after one replay of ``graph``
    (outputs poisoned with NaN first, so a layer left unwritten fails)."""
    for out in outs:
        out.fill_(float("nan"))
    graph.replay()
    torch.accelerator.synchronize()
    return [error(i, out) for i, out in enumerate(outs)]


def bench_chained(case: Case, env: Env, opts: Options) -> tuple[list[dict], bool]:
    """Records of one W1B case (per-layer times of W1B_LAYERS chained calls
    in one graph) and whether the hpc result is sound."""
    floor_us = case.floor_bytes() / (env.bandwidth_gbps * 1e3)
    num_graphs = choose_num_graphs(case, opts)
    if num_graphs < 1:
        gb = W1B_LAYERS * case.set_bytes() / 1e9
        reason = (
            f"skipped: {W1B_LAYERS} layers' input sets are {gb:.1f} GB, over "
            "the --max-kv-gb budget"
        )
        record = make_record(
            case.workload, case.name, HPC, None, floor_us, error=reason
        )
        return [record], True

    layout = make_layout(case)
    sets = [make_input_set(case, seed=i) for i in range(num_graphs * W1B_LAYERS)]
    groups = [sets[i : i + W1B_LAYERS] for i in range(0, len(sets), W1B_LAYERS)]
    touched = len(sets) * case.floor_bytes()
    scrub = env.scrub if touched < 4 * env.scrub.l2_bytes else None
    notes: dict[str, str] = {}
    makers = impl_makers(case, layout, env.hpc_ops, notes)
    names = impl_names(opts, env)
    refs = Refs(case, layout, groups[0])
    # Each layer's call alone first, as W1 checks it.
    checked = check_case(case, names, makers, sets[0], refs)
    errors = checked.errors
    checked.outputs.clear()
    tol = REL_TOL[case.fp8]

    timings: dict[str, float] = {}
    without_plan: dict[str, float | str] = {}
    chained_err: dict[str, float] = {}
    pool = torch.cuda.graph_pool_handle()
    # Baselines are timed only beside a sound hpc result, as in W1.
    impls = checked.impls if HPC in checked.impls else {}
    for name, impl in impls.items():
        q8 = takes_fp8_query(case, name)
        try:
            outputs: list[Any] = []
            graphs = capture_graphs(chain_layers(impl), groups, pool, outputs)
            errs = check_replay(
                graphs[0],
                outputs[0],
                lambda i, out, q8=q8: refs.error(i, q8, out),
            )
            chained_err[name] = max(errs)
            if not chained_err[name] <= tol:
                layer = max(range(len(errs)), key=lambda i: errs[i])
                errors[name] = (
                    f"wrong output in the chained graph: layer {layer} rel "
                    f"error {errs[layer]:.3g} vs float32 reference "
                    f"(tolerance {tol:g})"
                )
            else:
                us = time_graphs(graphs, opts.iters, opts.warmup, scrub)
                timings[name] = us / W1B_LAYERS
            del graphs, outputs
        except Exception as err:  # noqa: BLE001 - recorded, the run goes on
            errors[name] = short_error(err)
            sync_quietly()
        if name == HPC and name not in timings:
            break
        if name in timings and getattr(impl, "plan", None) is not None:
            try:
                graphs = capture_graphs(chain_layers(impl, plan=False), groups, pool)
                us = time_graphs(graphs, opts.iters, opts.warmup, scrub)
                without_plan[name] = round(us / W1B_LAYERS, 2)
                del graphs
            except Exception as err:  # noqa: BLE001 - recorded beside the time
                without_plan[name] = f"not timed: {short_error(err)}"
                sync_quietly()

    ok = HPC in timings
    records = []
    for name in names:
        extra: dict[str, Any] = {"layers": W1B_LAYERS}
        if name in chained_err:
            extra["ref_rel_err"] = json_float(chained_err[name], 3)
        if name == HPC:
            extra["num_graphs"] = num_graphs
            extra["rotated_gb"] = round(len(sets) * case.set_bytes() / 1e9, 3)
            extra["l2_scrub"] = scrub is not None
        if name in without_plan:
            extra["us_without_plan"] = without_plan[name]
        extra["step_work"] = STEP_WORK[name]
        records.append(impl_record(case, name, timings, errors, notes, floor_us, extra))
    return records, ok


def plan_cases(quick: bool) -> list[tuple[str, tuple[int, ...]]]:
    batches = QUICK_PLAN_BATCHES if quick else PLAN_BATCHES
    return [
        (f"b{b}", W1_LENGTHS if b == len(W1_LENGTHS) else (PLAN_CONTEXT,) * b)
        for b in batches
    ]


# The planner runs once per step inside the model's CUDA graph, so its cost
# is a kernel among others, not a graph launch: it is timed as one of
# PLAN_CALLS_PER_GRAPH back-to-back calls in one graph. A graph holding a
# single call is timed too and recorded as `us_single_graph`.
PLAN_CALLS_PER_GRAPH = 20


def _plan_runner(
    ws: Any, kv_lens: torch.Tensor, calls: int
) -> Callable[[object], None]:
    def run(_: object) -> None:
        for _ in range(calls):
            ws.plan(kv_lens, 1)

    return run


def bench_plan(
    name: str, lengths: tuple[int, ...], env: Env, opts: Options
) -> tuple[list[dict], bool]:
    """The GPU planner alone (tp1 KV heads, one query token), balanced as
    ``hpc`` and the static mode's planner as a baseline."""
    hpc_ops = env.hpc_ops
    hq, hkv = HEAD_CONFIGS["tp1"]
    case = Case("PLAN", "tp1", False, lengths, 1)
    kv_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    timings: dict[str, float] = {}
    single_us: dict[str, float] = {}
    errors: dict[str, str] = {}
    floor_us = 0.0
    modes = {HPC: hpc_ops.SplitMode.BALANCED}
    if STATIC in opts.baselines:
        modes[STATIC] = hpc_ops.SplitMode.STATIC
    pool = torch.cuda.graph_pool_handle()
    for impl, mode in modes.items():
        try:
            ws = import_attn_workspace().DecodeWorkspace.create(
                max_batch=case.batch,
                num_q_heads=hq,
                num_kv_heads=hkv,
                head_size=HEAD_SIZE,
                max_kv_tokens=case.num_blocks * BLOCK_SIZE,
                device="cuda",
                kv_cache_dtype=torch.bfloat16,
                mode=mode,
            )
            ws.plan(kv_lens, 1)
            if impl == HPC:
                # Lengths read, plan written.
                plan_bytes = 4 * kv_lens.numel() + 4 * ws.plan_buffer.numel()
                floor_us = plan_bytes / (env.bandwidth_gbps * 1e3)
            graphs = capture_graphs(
                _plan_runner(ws, kv_lens, PLAN_CALLS_PER_GRAPH), [None], pool
            )
            timings[impl] = (
                time_graphs(graphs, opts.iters, opts.warmup, None)
                / PLAN_CALLS_PER_GRAPH
            )
            single = capture_graphs(_plan_runner(ws, kv_lens, 1), [None], pool)
            single_us[impl] = time_graphs(single, opts.iters, opts.warmup, None)
            del graphs, single
        except Exception as err:  # noqa: BLE001 - recorded, the run goes on
            errors[impl] = short_error(err)
            torch.accelerator.synchronize()
    records = []
    for impl in modes:
        extra = (
            {
                "calls_per_graph": PLAN_CALLS_PER_GRAPH,
                "us_single_graph": round(single_us[impl], 3),
            }
            if impl in timings
            else {"error": errors.get(impl, "not timed")}
        )
        record = make_record("PLAN", name, impl, timings.get(impl), floor_us, **extra)
        if impl == HPC:
            record["ratios"] = ratios_over(timings, HPC)
        records.append(record)
    return records, HPC in timings


def all_cases(quick: bool, fp8_all: bool, workloads: set[str]) -> list[Case]:
    cases: list[Case] = []
    if "W1" in workloads:
        cases += w1_cases()
    if "W1B" in workloads:
        cases += w1b_cases()
    if "W2" in workloads:
        w2 = w2_cases(fp8_all=fp8_all)
        if quick:
            w2 = [c for c in w2 if c.name in QUICK_W2]
        cases += w2
    return cases


def find_missing(wanted: tuple[str, ...]) -> dict[str, str]:
    """The wanted baselines that cannot run here, each with the reason."""
    missing = missing_baselines(
        {
            TRITON: (
                "vllm.v1.attention.ops.triton_unified_attention",
                "unified_attention",
            ),
            FLASHINFER: ("flashinfer", None),
        },
        wanted,
    )
    missing.update(missing_fa3(wanted, tuple(FA3_SPLITS)))
    return missing


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="W1, W1B, a few W2 cases (" + ", ".join(QUICK_W2) + ") and PLAN b32/b256",
    )
    add_run_args(parser, 100, 10, WORKLOADS, BASELINES)
    parser.add_argument(
        "--fp8-all", action="store_true", help="every W2 case in fp8 too"
    )
    parser.add_argument(
        "--max-kv-gb",
        type=float,
        default=None,
        help="memory for one case's rotated input sets (default: "
        f"{KV_MEMORY_SHARE:g} of the device's memory, at most {MAX_KV_GB:g})",
    )
    add_merge_arg(parser)
    args = parser.parse_args(argv)
    check_run_args(parser, args, MIN_ITERS, WORKLOADS, BASELINES)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    reason = unavailable_reason()
    if reason is not None:
        print(f"benchmark_hpc_decode: not run: {reason}")
        return 1
    max_kv_gb = args.max_kv_gb
    if max_kv_gb is None:
        props = torch.cuda.get_device_properties()
        max_kv_gb = min(MAX_KV_GB, KV_MEMORY_SHARE * props.total_memory / 1e9)
    opts = Options(
        iters=args.iters,
        warmup=args.warmup,
        baselines=tuple(b for b in args.baselines.split(",") if b),
        max_kv_bytes=int(max_kv_gb * 1e9),
    )
    workloads = set(filter(None, args.workloads.split(",")))
    patterns = args.cases.split(",")
    cases = [
        c
        for c in all_cases(args.quick, args.fp8_all, workloads)
        if any(fnmatch.fnmatch(c.name, pattern) for pattern in patterns)
    ]
    plans = []
    if "PLAN" in workloads:
        plans = [
            p
            for p in plan_cases(args.quick)
            if any(fnmatch.fnmatch(p[0], pattern) for pattern in patterns)
        ]
    if not cases and not plans:
        print(f"benchmark_hpc_decode: no case matches {args.cases!r}")
        return 1

    missing = find_missing(opts.baselines)
    bandwidth = measure_copy_bandwidth_gbps()
    torch.accelerator.empty_cache()
    env = Env(
        hpc_ops=import_hpc_ops(),
        bandwidth_gbps=bandwidth,
        scrub=L2Scrub(),
        missing=missing,
    )
    print(
        f"copy bandwidth {bandwidth:.0f} GB/s, {len(cases)} decode cases, "
        f"{len(plans)} planner cases"
    )

    records: list[dict[str, Any]] = []
    sound = True
    device_lost = None
    try:
        for case in cases:
            bench = bench_chained if case.workload == "W1B" else bench_case
            sound &= run_guarded(
                case.workload,
                case.name,
                lambda case=case, bench=bench: bench(case, env, opts),
                lambda error, case=case: make_record(
                    case.workload,
                    case.name,
                    HPC,
                    None,
                    case.floor_bytes() / (bandwidth * 1e3),
                    error=error,
                ),
                records,
                started,
            )
        for name, lengths in plans:
            case_records, ok = bench_plan(name, lengths, env, opts)
            sound &= ok
            records.extend(case_records)
            print_progress("PLAN", name, case_records, started)
    except DeviceLost as err:
        device_lost = str(err)
        sound = False
        print(
            f"benchmark_hpc_decode: the device failed ({err}); later cases did not run"
        )

    extra: dict[str, Any] = {"skipped": missing}
    if device_lost is not None:
        extra["device_lost"] = device_lost
    if args.merge is not None:
        order = [(c.workload, c.name) for c in all_cases(False, True, set(WORKLOADS))]
        order += [("PLAN", p[0]) for p in plan_cases(False)]
        records, extra["merged"] = merge_records(args.merge, records, order)
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
