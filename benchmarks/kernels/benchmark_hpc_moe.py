# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmark of the fused FP8 MoE (W3): ``vllm._hpc_ops.fused_moe_fp8``.

Workload W3 (Tencent Hy3 experts: hidden 4096, 192 routed experts, top-8):

* ``tp8``: one rank of 8-way tensor parallelism, all 192 experts with the
  per-rank intermediate 1536 / 8 = 192;
* ``ep8``: rank 0 of 8-way expert parallelism, 24 local experts (global ids
  0..23, placed through an ``expert_map`` as vLLM passes it) of intermediate
  1536; the other ranks' choices are skipped by the op;
* ``tp1``: all 192 experts of intermediate 1536 on one GPU.

Quantization ``pertensor``: FP8 weights with one scale per expert, static
per-tensor scales for the input (bf16 ``hidden_states`` quantized inside
the op) and the intermediate. ``blockwise``: 128x128-block weight scales
and dynamic 1x128 activation scales. Block-wise needs the per-rank
intermediate to be a multiple of 128, which tp8's 192 is not. vLLM (0.33)
loads such a TP shard as whole 128-row checkpoint blocks when the MoE
backend takes only 128x128 blocks, as ``hpc`` does: the per-rank
intermediate becomes 256 (rank 0 holds checkpoint rows 0..255; the last
ranks get zeros). So the tp8 block-wise cases run with intermediate 256,
recorded as ``intermediate_size`` with a note, and their floor counts the
256 rows the op reads.

Tokens {1, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096}; routing uniform
(8 distinct experts per token, all equally likely) or ``-skewed``: each of a
token's 8 choices is, with probability 1/2, one of 8 hot experts (one per
EP rank's range, so ``ep8`` rank 0 holds one of them), else one of the
other 184. Routing weights: a softmax over random logits. Case names
``<tp8|ep8|tp1>-<pertensor|blockwise>-t<tokens>[-skewed]``.

Protocol: the whole op of one layer (routing tables, quantization, both
grouped GEMMs, SiLU-and-mul, the weighted top-k reduction) runs as
CUDA-graph replays timed one by one with CUDA events; warm-up, then the
median of at least 50. Weight sets (each its own ``w13``/``w2`` tensors and
scales, and its own output) are replayed round-robin: at least 4 and, up to
64, enough that the expert weights the routing touches over the rotation
exceed four times the L2 cache; fewer where they would pass the
``--max-weight-gb`` budget (``tp1`` is 3.6 GB a set), recorded as
``num_sets``. When the rotation still touches less than four times the L2
cache, L2 is scrubbed before each timed replay, outside the timed region.

Floor: ``floor_us = max(byte_floor_us, flop_floor_us)``, both in every
record. Bytes: the distinct local experts the case's routing hits
(``experts_touched``) times each expert's ``w13`` + ``w2`` bytes and scales,
plus the bf16 input and output rows and the routing (ids, weights), at the
device-to-device copy bandwidth measured in the same run. FLOPs
(``moe_flops``): the two GEMMs of the routes to local experts
(``local_routes``), at the dense FP8 matmul rate measured in the same run
(``torch._scaled_mm``; twice the bf16 rate, with a note, where that cannot
be measured), recorded at the top level as ``fp8_matmul_tflops``. Small
batches are bound by the weight bytes, prefill-sized ones by the FLOPs.

Implementations, on the same inputs and timed the same way:

* ``hpc``: ``fused_moe_fp8`` with a workspace sized for the case (the
  fields of ``hpc_moe.MoeWorkspace``, sized by ``moe_workspace_bytes``);
* ``torch``: plain PyTorch. The input is quantized as the op does; then for
  every expert the routing touches (known when the case is built, so the
  loop is static and graph-captured; eager with events if capture fails):
  its FP8 weights dequantized to bf16, its tokens gathered, bf16 matmuls,
  SiLU-and-mul with the FP8 round trip of the intermediate, and a weighted
  ``index_add_`` into a float32 sum. Its bf16 rounding of the dequantized
  operands and of gate/up flips some FP8 roundings of the intermediate, so
  it sits about 1-3% from the op's contract, which accumulates in float32
  (hence the guard's 5e-2 below);
* ``fused_experts``: vLLM's whole Triton MoE as vLLM runs it for FP8
  (``fused_experts`` with ``fp8_w8a8_moe_quant_config``: per-tensor scales,
  or 128x128 blocks with dynamic 1x128 activation groups): input
  quantization, routing alignment (``moe_align_block_size``), both Triton
  GEMMs, SiLU-and-mul with its quantization and the top-k sum
  (``moe_sum``). Besides vLLM's Python it needs vLLM's compiled core and
  MoE ops (``torch.ops._C``, ``torch.ops._moe_C``); where they are not
  loaded it is skipped, the reason recorded in the ``hpc`` record's
  ``skipped_baselines`` and the top-level ``skipped``;
* ``triton_gemms``: the two GEMMs of ``fused_experts`` alone: vLLM's Triton
  ``fused_moe_kernel`` launched as ``fused_experts`` launches it (its config
  for the shape and batch, its token-block assignment, routed weights
  applied by the down GEMM), on inputs prepared in PyTorch outside the timed
  replay (quantized input, routing alignment, the quantized SiLU-and-mul
  of the gate-up GEMM's own output). It needs only vLLM's Python and
  Triton, so it runs where vLLM's compiled ops (which ``fused_experts``
  calls around its GEMMs) do not load; being a part of ``fused_experts``,
  its time is a lower bound of that op's. Its output check runs the whole
  chain, with the top-k sum in PyTorch.

Before timing, on the first weight set: every output (NaN-poisoned first)
is compared with a float64 reference on a few token rows (``ref_rel_err``),
and ``hpc`` with ``torch`` over the whole output (``rel_err_vs_torch``,
||hpc - torch|| / ||torch||). ``hpc`` must be finite and within 5e-2 of
both (of the reference alone when ``torch`` itself fails it), else it gets
no time and the run exits 1; a baseline that fails the reference is
recorded with its error and not timed. Results go to
``benchmarks/results/benchmark_hpc_moe.json`` (and under ``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import inspect
import math
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import torch
from bench_utils import (
    L2Scrub,
    add_merge_arg,
    capture_graphs,
    check_impls,
    finish_run,
    floor_matmul_tflops,
    import_hpc_ops,
    json_float,
    make_record,
    measure_copy_bandwidth_gbps,
    median_ms,
    merge_records,
    missing_baselines,
    missing_ops,
    new_events,
    print_progress,
    ratios_over,
    short_error,
    significant,
    sync_quietly,
    time_graphs,
    unavailable_reason,
    validated_op,
)

RESULT_NAME = Path(__file__).stem + ".json"
WORKLOAD = "W3"
DEVICE = "cuda"

HIDDEN = 4096
NUM_EXPERTS = 192
TOPK = 8
EP_SIZE = 8
EP_RANK = 0
FULL_INTERMEDIATE = 1536
BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# (local experts, per-rank intermediate size) of each parallel config.
CONFIGS = {
    "tp8": (NUM_EXPERTS, FULL_INTERMEDIATE // 8),
    "ep8": (NUM_EXPERTS // EP_SIZE, FULL_INTERMEDIATE),
    "tp1": (NUM_EXPERTS, FULL_INTERMEDIATE),
}
TOKENS = (1, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
QUICK_CASES = tuple(
    f"{tp}-pertensor-t{t}" for tp in ("tp8", "tp1") for t in (1, 8, 64, 256)
) + ("tp1-blockwise-t64",)

# Skewed routing: the share of choices drawn from the hot experts.
HOT_EXPERTS = EP_SIZE
HOT_SHARE = 0.5

# Synthetic checkpoint: FP8 codes of about this standard deviation; each
# expert's (or block's) scale makes the weights' standard deviation
# 0.5..1.5 over sqrt(fan-in), so gate and up are of about unit variance.
FP8_CODE_STD = 64.0
# Static scale of the intermediate (per-tensor mode): |silu(g) * u| stays
# well under 448 * A2_SCALE with these magnitudes.
A2_SCALE = 0.15

MIN_SETS = 4
MAX_SETS = 64
# The expert weights touched over the rotation should exceed this many L2s.
L2_MULTIPLE = 4
WEIGHT_MEMORY_SHARE = 0.5
MAX_WEIGHT_GB = 64.0
MIN_ITERS = 50
# ||out - ref|| / ||ref|| allowed before an output counts as wrong (a guard
# of the timings; the tests hold the accuracy bars).
REL_TOL = 5e-2
REF_ROWS = 4

HPC = "hpc"
TORCH = "torch"
FUSED_EXPERTS = "fused_experts"
TRITON_GEMMS = "triton_gemms"
BASELINES = (TORCH, FUSED_EXPERTS, TRITON_GEMMS)
FUSED_MOE_MODULE = "vllm.model_executor.layers.fused_moe.fused_moe"
# The compiled vLLM ops fused_experts calls around its Triton GEMMs (FP8,
# SiLU). A stand-in for vLLM's core library may define silu_and_mul with a
# body that raises; the two quantization ops exist only in the real one.
FUSED_EXPERTS_OPS = (
    "_moe_C.moe_align_block_size",
    "_moe_C.moe_sum",
    "_C.silu_and_mul",
    "_C.static_scaled_fp8_quant",
    "_C.per_token_group_fp8_quant",
)
FUSED_EXPERTS_VARIANT = (
    "vLLM's fused_experts with fp8_w8a8_moe_quant_config: input quantization, "
    "moe_align_block_size, both Triton GEMMs, SiLU-and-mul with its "
    "quantization, moe_sum"
)
TRITON_GEMMS_VARIANT = (
    "vLLM's Triton fused_moe_kernel for the gate-up and down GEMMs only, "
    "launched as fused_experts launches it; input quantization, routing "
    "alignment, SiLU-and-mul with its quantization and the top-k sum in "
    "PyTorch, outside the timed replay"
)
TORCH_VARIANT = (
    "input quantized as the op does; per touched expert (static loop): FP8 "
    "weights dequantized to bf16, tokens gathered, bf16 matmuls, SiLU-and-mul "
    "with the FP8 round trip of the intermediate, weighted index_add_ in float32"
)
PAD_NOTE = (
    "block-wise TP shard of {inter} rows loaded as whole 128-row checkpoint "
    "blocks, as vLLM does for backends that take only 128x128 blocks: "
    "intermediate {padded} per rank (rank 0 holds real rows 0..{last})"
)


# ---------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    tp: str
    block_wise: bool
    tokens: int
    skewed: bool

    @property
    def quant(self) -> str:
        return "blockwise" if self.block_wise else "pertensor"

    @property
    def name(self) -> str:
        skew = "-skewed" if self.skewed else ""
        return f"{self.tp}-{self.quant}-t{self.tokens}{skew}"

    @property
    def local_experts(self) -> int:
        return CONFIGS[self.tp][0]

    @property
    def tp_shard(self) -> int:
        """The per-rank intermediate of an even TP split."""
        return CONFIGS[self.tp][1]

    def block_padded(self) -> bool:
        return self.block_wise and self.tp_shard % BLOCK != 0

    def intermediate(self) -> int:
        """The per-rank intermediate size the op sees: the TP shard, rounded
        up to whole 128-row blocks in block-wise mode (vLLM's loading)."""
        if self.block_padded():
            return math.ceil(self.tp_shard / BLOCK) * BLOCK
        return self.tp_shard

    @property
    def weight_key(self) -> tuple[int, int, bool]:
        return (self.local_experts, self.intermediate(), self.block_wise)


def all_cases() -> list[Case]:
    return [
        Case(tp, block_wise, tokens, skewed)
        for tp in CONFIGS
        for block_wise in (False, True)
        for skewed in (False, True)
        for tokens in TOKENS
    ]


def expert_bytes(inter: int, block_wise: bool) -> int:
    """One expert's FP8 ``w13`` and ``w2`` and their float32 scales."""
    weights = 3 * inter * HIDDEN
    scale_count = 3 * (inter // BLOCK) * (HIDDEN // BLOCK) if block_wise else 2
    return weights + 4 * scale_count


def moe_flops(local_routes: int, hidden: int, inter: int) -> int:
    """FLOPs of the two expert GEMMs: each route of a token to a local
    expert multiplies the token's row by that expert's ``w13`` (gate and up,
    ``2 * inter`` x ``hidden``) and its intermediate by ``w2`` (``hidden`` x
    ``inter``), 2 FLOPs a multiply-add. Routes to experts of other EP ranks
    do no work here; SiLU, quantization and the reduce are not counted."""
    return 2 * local_routes * (hidden * 2 * inter + inter * hidden)


@dataclasses.dataclass(frozen=True)
class Floor:
    """A case's floor: the larger of its byte and FLOP floors (µs)."""

    byte_us: float
    flop_us: float

    @property
    def us(self) -> float:
        return max(self.byte_us, self.flop_us)

    def fields(self) -> dict[str, float]:
        return {
            "byte_floor_us": significant(self.byte_us, 4),
            "flop_floor_us": significant(self.flop_us, 4),
        }


def _seed(*parts: object) -> int:
    return zlib.crc32("/".join(str(p) for p in parts).encode())


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class WeightSet:
    """One rank's FP8 expert weights and scales."""

    w13: torch.Tensor  # [E_local, 2I, H]
    w13_scale: torch.Tensor  # [E_local] or [E_local, 2I/128, H/128]
    w2: torch.Tensor  # [E_local, H, I]
    w2_scale: torch.Tensor  # [E_local] or [E_local, H/128, I/128]


def _fill_fp8_(t: torch.Tensor, gen: torch.Generator) -> None:
    """FP8 codes of standard deviation FP8_CODE_STD, in chunks of experts
    (no normal_ for float8: bf16 draws, saturated and cast)."""
    per_expert = t[0].numel()
    step = max(1, 2**27 // per_expert)
    for first in range(0, t.shape[0], step):
        part = t[first : first + step]
        draw = torch.randn(
            part.shape, generator=gen, device=t.device, dtype=torch.bfloat16
        )
        part.copy_(draw.mul_(FP8_CODE_STD).clamp_(-FP8_MAX, FP8_MAX))


def _scales(
    shape: tuple[int, ...], fan_in: int, gen: torch.Generator, device: str
) -> torch.Tensor:
    """Scales giving the weights a standard deviation of 0.5..1.5 over
    sqrt(fan-in), different per expert (and per block)."""
    spread = 0.5 + torch.rand(shape, generator=gen, device=device)
    return (spread / (FP8_CODE_STD * math.sqrt(fan_in))).float().contiguous()


def make_weight_set(
    num_experts: int,
    inter: int,
    block_wise: bool,
    seed: int,
    device: str | None = None,
) -> WeightSet:
    """Random FP8 weights with per-expert or per-128x128-block scales."""
    device = device or DEVICE
    gen = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.empty(num_experts, 2 * inter, HIDDEN, dtype=FP8, device=device)
    w2 = torch.empty(num_experts, HIDDEN, inter, dtype=FP8, device=device)
    _fill_fp8_(w13, gen)
    _fill_fp8_(w2, gen)
    if block_wise:
        hb, ib = HIDDEN // BLOCK, inter // BLOCK
        s13 = _scales((num_experts, 2 * ib, hb), HIDDEN, gen, device)
        s2 = _scales((num_experts, hb, ib), inter, gen, device)
    else:
        s13 = _scales((num_experts,), HIDDEN, gen, device)
        s2 = _scales((num_experts,), inter, gen, device)
    return WeightSet(w13=w13, w13_scale=s13, w2=w2, w2_scale=s2)


class WeightCache:
    """Weight sets of one shape, kept across the cases that share it (the
    cases run grouped by shape); a new shape frees the old sets."""

    def __init__(self) -> None:
        self.key: tuple[int, int, bool] | None = None
        self.sets: list[WeightSet] = []

    def get(self, case: Case, count: int) -> list[WeightSet]:
        if case.weight_key != self.key:
            self.sets = []
            self.key = case.weight_key
            torch.accelerator.empty_cache()
        while len(self.sets) < count:
            seed = _seed("weights", *case.weight_key, len(self.sets))
            self.sets.append(
                make_weight_set(
                    case.local_experts,
                    case.intermediate(),
                    case.block_wise,
                    seed,
                )
            )
        return self.sets[:count]

    def clear(self) -> None:
        self.sets = []
        self.key = None


@dataclasses.dataclass
class Problem:
    """What every weight set of a case shares: activations, routing, the
    static scales and the expert placement."""

    hidden: torch.Tensor  # [M, H] bf16
    topk_weights: torch.Tensor  # [M, k] float32
    topk_ids: torch.Tensor  # [M, k] int32, global ids
    a1_scale: torch.Tensor | None  # [1] float32, per-tensor only
    a2_scale: torch.Tensor | None
    expert_map: torch.Tensor | None  # int32 [192], ep8 only
    slots: torch.Tensor  # int64 [M, k] on the host: local slot or -1
    weights_host: torch.Tensor  # float32 [M, k] on the host
    touched: list[int]  # local experts the routing hits

    def local_routes(self) -> int:
        """(token, choice) pairs routed to an expert of this rank."""
        return int((self.slots >= 0).sum())

    def routing_bytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in (self.topk_weights, self.topk_ids, self.expert_map)
            if t is not None
        )


def make_routing(
    tokens: int, skewed: bool, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Host ``(weights float32 [M, k], ids int64 [M, k])``: k distinct
    global experts per token."""
    if not skewed:
        ids = torch.rand(tokens, NUM_EXPERTS, generator=gen).topk(TOPK).indices
    else:
        per_rank = NUM_EXPERTS // EP_SIZE
        offsets = torch.randint(0, per_rank, (HOT_EXPERTS,), generator=gen)
        hot = torch.arange(HOT_EXPERTS) * per_rank + offsets
        is_hot = torch.zeros(NUM_EXPERTS, dtype=torch.bool)
        is_hot[hot] = True
        cold = torch.arange(NUM_EXPERTS)[~is_hot]
        # Hot and cold picks are each distinct and the two sets disjoint,
        # so any mix of them per position is too.
        hot_order = torch.rand(tokens, HOT_EXPERTS, generator=gen).argsort(dim=-1)
        hot_pick = hot[hot_order[:, :TOPK]]
        cold_pick = cold[torch.rand(tokens, cold.numel(), generator=gen).topk(TOPK)[1]]
        take_hot = torch.rand(tokens, TOPK, generator=gen) < HOT_SHARE
        ids = torch.where(take_hot, hot_pick, cold_pick)
    logits = torch.randn(tokens, TOPK, generator=gen)
    return torch.softmax(logits, dim=-1).float(), ids.long()


def make_problem(case: Case, device: str | None = None) -> Problem:
    device = device or DEVICE
    gen = torch.Generator().manual_seed(_seed("routing", case.name))
    weights, ids = make_routing(case.tokens, case.skewed, gen)
    expert_map = None
    if case.tp == "ep8":
        local = case.local_experts
        emap = torch.full((NUM_EXPERTS,), -1, dtype=torch.int32)
        first = EP_RANK * local
        emap[first : first + local] = torch.arange(local, dtype=torch.int32)
        slots = emap.long()[ids]
        expert_map = emap.to(device)
    else:
        slots = ids.clone()
    touched = sorted(int(e) for e in torch.unique(slots[slots >= 0]))
    x = torch.randn(case.tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    a1_scale = a2_scale = None
    if not case.block_wise:
        amax = x.float().abs().amax().clamp_min(1e-6)
        a1_scale = (amax / FP8_MAX).reshape(1).float().to(device)
        a2_scale = torch.full((1,), A2_SCALE, dtype=torch.float32, device=device)
    return Problem(
        hidden=x.to(device),
        topk_weights=weights.to(device),
        topk_ids=ids.to(torch.int32).to(device),
        a1_scale=a1_scale,
        a2_scale=a2_scale,
        expert_map=expert_map,
        slots=slots,
        weights_host=weights,
        touched=touched,
    )


def case_floor(
    case: Case, problem: Problem, bandwidth_gbps: float, fp8_tflops: float
) -> Floor:
    """The case's byte floor (touched expert weights and scales, bf16 input
    and output rows, routing, at ``bandwidth_gbps``) and FLOP floor
    (``moe_flops`` at ``fp8_tflops``)."""
    inter = case.intermediate()
    touched_bytes = len(problem.touched) * expert_bytes(inter, case.block_wise)
    activation_bytes = 2 * case.tokens * HIDDEN * 2 + problem.routing_bytes()
    flops = moe_flops(problem.local_routes(), HIDDEN, inter)
    return Floor(
        byte_us=(touched_bytes + activation_bytes) / (bandwidth_gbps * 1e3),
        flop_us=flops / (fp8_tflops * 1e6),
    )


@dataclasses.dataclass
class InputSet:
    weights: WeightSet
    out: torch.Tensor  # [M, H] bf16


# ---------------------------------------------------------------------------
# Quantization as the op defines it (torch baseline and reference)
# ---------------------------------------------------------------------------


def fp8_codes(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 codes of float32 ``x / scale``, saturated."""
    return (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def fp8_round_trip(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` -> FP8 codes of ``x / scale`` (saturated) -> float32."""
    return fp8_codes(x, scale).float() * scale


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 codes and float32 ``[rows, cols / 128]`` scales of dynamic 1x128
    quantization (scale amax / 448 per group, 1 for an all-zero group), as
    the op and vLLM define it."""
    rows, cols = x.shape
    groups = x.float().view(rows, cols // BLOCK, BLOCK)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return fp8_codes(groups, scale).view(rows, cols), scale.squeeze(-1)


def group_round_trip(x: torch.Tensor) -> torch.Tensor:
    """float32 ``[rows, cols]`` through dynamic 1x128 FP8 quantization."""
    rows, cols = x.shape
    codes, scale = quantize_groups(x)
    groups = codes.float().view(rows, cols // BLOCK, BLOCK)
    return (groups * scale.unsqueeze(-1)).view(rows, cols)


def quantize_input(problem: Problem, x: torch.Tensor, block_wise: bool) -> torch.Tensor:
    """The FP8 input the op multiplies, dequantized to float32."""
    if block_wise:
        return group_round_trip(x.float())
    assert problem.a1_scale is not None
    return fp8_round_trip(x.float(), problem.a1_scale)


def quantize_intermediate(
    problem: Problem, h: torch.Tensor, block_wise: bool
) -> torch.Tensor:
    """float32 ``h`` after the op's FP8 round trip of the intermediate."""
    if block_wise:
        return group_round_trip(h)
    assert problem.a2_scale is not None
    return fp8_round_trip(h, problem.a2_scale)


def dequantize_weight(
    w: torch.Tensor, scale: torch.Tensor, block_wise: bool, dtype: torch.dtype
) -> torch.Tensor:
    """One expert's ``[N, K]`` FP8 weights times their scale (one element,
    or ``[N / 128, K / 128]`` blocks) in ``dtype``."""
    if not block_wise:
        return w.to(dtype) * scale.to(dtype)
    n, k = w.shape
    blocks = w.view(n // BLOCK, BLOCK, k // BLOCK, BLOCK).to(dtype)
    return (blocks * scale.to(dtype)[:, None, :, None]).view(n, k)


def reference_rows(
    case: Case, problem: Problem, weights: WeightSet, rows: list[int]
) -> torch.Tensor:
    """float64 ``[len(rows), H]``: the op's contract for the given tokens,
    one choice at a time. The input and the intermediate are quantized in
    float32 as the op defines it; the GEMMs run in float64 on the exactly
    dequantized weights."""
    inter = case.intermediate()
    f64 = torch.float64
    x = quantize_input(problem, problem.hidden[rows], case.block_wise).to(f64)
    out = torch.zeros(len(rows), HIDDEN, dtype=f64, device=x.device)
    for i, t in enumerate(rows):
        for j in range(TOPK):
            e = int(problem.slots[t, j])
            if e < 0:
                continue
            w13 = dequantize_weight(
                weights.w13[e], weights.w13_scale[e], case.block_wise, f64
            )
            gate_up = w13 @ x[i]
            g, u = gate_up[:inter], gate_up[inter:]
            h = (torch.nn.functional.silu(g) * u).float()
            h = quantize_intermediate(problem, h[None], case.block_wise)[0]
            w2 = dequantize_weight(
                weights.w2[e], weights.w2_scale[e], case.block_wise, f64
            )
            out[i] += float(problem.weights_host[t, j]) * (w2 @ h.to(f64))
    return out


def ref_rows(problem: Problem) -> list[int]:
    """First, middle and last token, and the first one with a local expert
    (ep8 may route a token to none)."""
    tokens = problem.slots.shape[0]
    rows = {0, tokens // 2, tokens - 1}
    routed = torch.nonzero((problem.slots >= 0).any(dim=-1)).flatten()
    if routed.numel():
        rows.add(int(routed[0]))
    return sorted(rows)[:REF_ROWS]


def rel_l2(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``||got - ref|| / ||ref||``; inf for NaN/Inf; for an all-zero
    reference, 0 only when ``got`` is zero too."""
    got, ref = got.float(), ref.float()
    if not bool(torch.isfinite(got).all()):
        return math.inf
    num = torch.linalg.vector_norm(got - ref).item()
    den = torch.linalg.vector_norm(ref).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


# ---------------------------------------------------------------------------
# Implementations: each runs one input set and returns its output
# ---------------------------------------------------------------------------

Impl = Callable[[InputSet], torch.Tensor]


def moe_workspace(hpc_ops: ModuleType, **sizes: int) -> SimpleNamespace:
    """What ``fused_moe_fp8`` reads of a workspace: ``hpc_moe.MoeWorkspace``'s
    fields (that class belongs to the vLLM layer, and this benchmark runs
    without vLLM), with a buffer of the size the library asks for."""
    nbytes = hpc_ops.moe_workspace_bytes(**sizes)
    buffer = torch.zeros(nbytes, dtype=torch.uint8, device=DEVICE)
    return SimpleNamespace(buffer=buffer, **sizes)


def make_hpc(case: Case, problem: Problem, hpc_ops: ModuleType) -> Impl:
    ws = moe_workspace(
        hpc_ops,
        max_tokens=case.tokens,
        topk=TOPK,
        num_local_experts=case.local_experts,
        hidden_size=HIDDEN,
        intermediate_size=case.intermediate(),
    )
    block_shape = (BLOCK, BLOCK) if case.block_wise else None
    fused_moe_fp8 = validated_op("fused_moe_fp8", hpc_ops)

    def run(s: InputSet) -> torch.Tensor:
        fused_moe_fp8(
            problem.hidden,
            s.weights.w13,
            s.weights.w2,
            problem.topk_weights,
            problem.topk_ids,
            s.out,
            ws,
            w13_scale=s.weights.w13_scale,
            w2_scale=s.weights.w2_scale,
            a1_scale=problem.a1_scale,
            a2_scale=problem.a2_scale,
            block_shape=block_shape,
            expert_map=problem.expert_map,
        )
        return s.out

    return run


def make_torch(case: Case, problem: Problem) -> Impl:
    """The plain PyTorch baseline: a static loop over the touched experts,
    with their token rows and routing weights gathered up front."""
    inter = case.intermediate()
    block_wise = case.block_wise
    device = problem.hidden.device
    plan = []
    for e in problem.touched:
        tok, j = torch.nonzero(problem.slots == e, as_tuple=True)
        w = problem.weights_host[tok, j].unsqueeze(-1)
        plan.append((e, tok.to(device), w.to(device)))
    bf16 = torch.bfloat16

    def run(s: InputSet) -> torch.Tensor:
        x = quantize_input(problem, problem.hidden, block_wise).to(bf16)
        acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        ws = s.weights
        for e, tok, w in plan:
            w13 = dequantize_weight(ws.w13[e], ws.w13_scale[e], block_wise, bf16)
            gate_up = x.index_select(0, tok) @ w13.t()
            g, u = gate_up[:, :inter].float(), gate_up[:, inter:].float()
            h = quantize_intermediate(
                problem, torch.nn.functional.silu(g) * u, block_wise
            )
            w2 = dequantize_weight(ws.w2[e], ws.w2_scale[e], block_wise, bf16)
            y = h.to(bf16) @ w2.t()
            acc.index_add_(0, tok, y.float() * w)
        s.out.copy_(acc)
        return s.out

    return run


def make_fused_experts(case: Case, problem: Problem, sets: list[InputSet]) -> Impl:
    """The Triton ``fused_experts`` of vLLM with the same FP8 scheme: a quant
    config on releases that take one, the older keyword flags otherwise."""
    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts

    params = inspect.signature(fused_experts).parameters
    block_shape = [BLOCK, BLOCK] if case.block_wise else None
    common: dict[str, Any] = {}
    if "global_num_experts" in params:
        common["global_num_experts"] = NUM_EXPERTS
    if problem.expert_map is not None:
        common["expert_map"] = problem.expert_map

    def quant_kwargs(ws: WeightSet) -> dict[str, Any]:
        scales = {
            "w1_scale": ws.w13_scale,
            "w2_scale": ws.w2_scale,
            "a1_scale": problem.a1_scale,
            "a2_scale": problem.a2_scale,
            "block_shape": block_shape,
        }
        if "quant_config" in params:
            from vllm.model_executor.layers.fused_moe.config import (
                fp8_w8a8_moe_quant_config,
            )

            return {"quant_config": fp8_w8a8_moe_quant_config(**scales)}
        return {"use_fp8_w8a8": True, **scales}

    per_set = {id(s.weights): quant_kwargs(s.weights) for s in sets}

    def run(s: InputSet) -> torch.Tensor:
        return fused_experts(
            problem.hidden,
            s.weights.w13,
            s.weights.w2,
            problem.topk_weights,
            problem.topk_ids,
            **common,
            **per_set[id(s.weights)],
        )

    return run


def quantize_activation(
    x: torch.Tensor, static_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 codes and scales of an activation: static per-tensor where a
    scale is given, else dynamic 1x128 groups."""
    if static_scale is None:
        return quantize_groups(x)
    return fp8_codes(x.float(), static_scale), static_scale


def align_routing(
    slots: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``moe_align_block_size`` of vLLM with ``ignore_invalid_experts``:
    each local expert's routed rows (flat ``token * k + j`` indices, from the
    host ``slots``: local expert or -1) padded to a multiple of ``block_m``
    with the sentinel ``slots.numel()``; the local expert of every block
    (-1 past the last); the padded row count."""
    flat = slots.flatten()
    sentinel = flat.numel()
    capacity = sentinel + num_experts * (block_m - 1)
    sorted_ids = torch.full((capacity,), sentinel, dtype=torch.int32)
    expert_ids = torch.full((math.ceil(capacity / block_m),), -1, dtype=torch.int32)
    row = 0
    for e in range(num_experts):
        rows = torch.nonzero(flat == e).flatten()
        if rows.numel() == 0:
            continue
        padded = math.ceil(rows.numel() / block_m) * block_m
        sorted_ids[row : row + rows.numel()] = rows.to(torch.int32)
        expert_ids[row // block_m : (row + padded) // block_m] = e
        row += padded
    return (
        sorted_ids.to(DEVICE),
        expert_ids.to(DEVICE),
        torch.tensor([row], dtype=torch.int32, device=DEVICE),
    )


def make_triton_gemms(case: Case, problem: Problem, sets: list[InputSet]) -> Impl:
    """The ``triton_gemms`` baseline: ``run`` computes the whole op around
    vLLM's two Triton GEMM launches (for the output check); ``run.timed``
    replays the two launches alone, on inputs prepared here per set."""
    import triton.language as tl

    from vllm.model_executor.layers.fused_moe.fused_moe import (
        invoke_fused_moe_triton_kernel,
        try_get_optimal_moe_config,
    )

    tokens, inter = case.tokens, case.intermediate()
    block_shape = [BLOCK, BLOCK] if case.block_wise else None
    w = sets[0].weights
    config = try_get_optimal_moe_config(
        tuple(w.w13.shape),
        tuple(w.w2.shape),
        TOPK,
        "fp8_w8a8",
        tokens,
        block_shape=block_shape,
    )
    # fused_experts' choice: with no expert map and few routed rows, one
    # token block per (token, expert) pair and no alignment.
    if problem.expert_map is None and tokens * TOPK * 4 <= NUM_EXPERTS:
        sorted_ids = None
        expert_ids = problem.topk_ids.flatten()
        padded = torch.full(
            (1,), tokens * TOPK * config["BLOCK_SIZE_M"], dtype=torch.int32
        ).to(DEVICE)
    else:
        sorted_ids, expert_ids, padded = align_routing(
            problem.slots, config["BLOCK_SIZE_M"], case.local_experts
        )
    x_codes, x_scale = quantize_activation(problem.hidden, problem.a1_scale)

    def gemm(a, a_scale, b, b_scale, c, routed_weight: bool, top_k: int) -> None:
        invoke_fused_moe_triton_kernel(
            a,
            b,
            c,
            a_scale,
            b_scale,
            problem.topk_weights,
            sorted_ids,
            expert_ids,
            padded,
            routed_weight,
            top_k,
            config,
            compute_type=tl.bfloat16,
            use_fp8_w8a8=True,
            use_int8_w8a8=False,
            use_int8_w8a16=False,
            use_int4_w4a16=False,
            per_channel_quant=False,
            block_shape=block_shape,
        )

    gate_up = torch.empty(tokens, TOPK, 2 * inter, dtype=torch.bfloat16, device=DEVICE)
    down = torch.empty(tokens, TOPK, HIDDEN, dtype=torch.bfloat16, device=DEVICE)
    # Per set: its intermediate (codes, scales) from its own gate-up GEMM.
    inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def intermediate(ws: WeightSet) -> tuple[torch.Tensor, torch.Tensor]:
        gate_up.zero_()  # rows of experts off this rank stay zero
        gemm(x_codes, x_scale, ws.w13, ws.w13_scale, gate_up, False, TOPK)
        g, u = gate_up.view(-1, 2 * inter).float().split(inter, dim=-1)
        h = (torch.nn.functional.silu(g) * u).to(torch.bfloat16)
        return quantize_activation(h, problem.a2_scale)

    def run(s: InputSet) -> torch.Tensor:
        ws = s.weights
        h_codes, h_scale = intermediate(ws)
        down.zero_()
        gemm(h_codes, h_scale, ws.w2, ws.w2_scale, down, True, 1)
        s.out.copy_(down.float().sum(dim=1))
        return s.out

    def timed(s: InputSet) -> torch.Tensor:
        ws = s.weights
        h_codes, h_scale = inputs[id(ws)]
        gemm(x_codes, x_scale, ws.w13, ws.w13_scale, gate_up, False, TOPK)
        gemm(h_codes, h_scale, ws.w2, ws.w2_scale, down, True, 1)
        return s.out

    for s in sets:  # prepared here, not under graph capture
        inputs[id(s.weights)] = intermediate(s.weights)
    run.timed = timed  # type: ignore[attr-defined]
    return run


# ---------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------


def time_eager(
    impl: Impl,
    sets: Sequence[InputSet],
    iters: int,
    warmup: int,
    scrub: L2Scrub | None,
) -> float:
    """Median microseconds of one eager call (host launches included),
    round-robin over ``sets``, each call between a pair of CUDA events."""
    for i in range(warmup):
        impl(sets[i % len(sets)])
    torch.accelerator.synchronize()
    events = new_events(iters)
    for i, (start, end) in enumerate(events):
        if scrub is not None:
            scrub()
        start.record()
        impl(sets[i % len(sets)])
        end.record()
    torch.accelerator.synchronize()
    return median_ms(events) * 1e3


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Options:
    iters: int
    warmup: int
    baselines: tuple[str, ...]
    max_weight_bytes: int


@dataclasses.dataclass
class Env:
    hpc_ops: ModuleType
    bandwidth_gbps: float
    fp8_tflops: float  # the FP8 matmul rate behind the FLOP floors
    scrub: L2Scrub
    missing: dict[str, str]  # baseline -> why it cannot run here
    weights: WeightCache


def _record(
    case: Case, impl: str, us: float | None, floor: Floor | None, **extra: Any
) -> dict[str, Any]:
    floor_us = None if floor is None else floor.us
    fields = {} if floor is None else floor.fields()
    return make_record(WORKLOAD, case.name, impl, us, floor_us, **fields, **extra)


def choose_num_sets(
    touched_bytes: int, set_bytes: int, l2_bytes: int, budget: int
) -> int:
    """Weight sets to rotate: enough that the touched weights over the
    rotation pass L2_MULTIPLE x L2, within [MIN_SETS, MAX_SETS], fewer
    where they would pass the memory budget (0: even one does not)."""
    if touched_bytes == 0:
        wanted = MIN_SETS
    else:
        needed = math.ceil((L2_MULTIPLE * l2_bytes + 1) / touched_bytes)
        wanted = min(MAX_SETS, max(MIN_SETS, needed))
    return min(wanted, budget // set_bytes)


def bench_case(case: Case, env: Env, opts: Options) -> tuple[list[dict], bool]:
    """Records of one case and whether the hpc result is sound."""
    inter = case.intermediate()
    problem = make_problem(case)
    per_expert = expert_bytes(inter, case.block_wise)
    touched_bytes = len(problem.touched) * per_expert
    floor = case_floor(case, problem, env.bandwidth_gbps, env.fp8_tflops)
    set_bytes = case.local_experts * per_expert
    l2_bytes = env.scrub.l2_bytes
    num_sets = choose_num_sets(
        touched_bytes, set_bytes, l2_bytes, opts.max_weight_bytes
    )
    if num_sets < 1:
        gb = set_bytes / 1e9
        reason = f"skipped: one weight set is {gb:.1f} GB, over --max-weight-gb"
        return [_record(case, HPC, None, floor, error=reason)], True

    weight_sets = env.weights.get(case, num_sets)
    sets = [
        InputSet(
            weights=w,
            out=torch.empty(case.tokens, HIDDEN, dtype=torch.bfloat16, device=DEVICE),
        )
        for w in weight_sets
    ]
    rotated = num_sets * touched_bytes
    scrub = env.scrub if rotated < L2_MULTIPLE * l2_bytes else None

    makers: dict[str, Callable[[], Impl]] = {
        HPC: lambda: make_hpc(case, problem, env.hpc_ops),
        TORCH: lambda: make_torch(case, problem),
        FUSED_EXPERTS: lambda: make_fused_experts(case, problem, sets),
        TRITON_GEMMS: lambda: make_triton_gemms(case, problem, sets),
    }
    # torch always runs once: it is what hpc is checked against.
    names = [HPC, TORCH] + [
        b for b in opts.baselines if b != TORCH and b not in env.missing
    ]
    rows = ref_rows(problem)
    ref = reference_rows(case, problem, sets[0].weights, rows)

    checked = check_impls(
        names,
        makers,
        sets[0],
        lambda out: rel_l2(out[rows], ref),
        REL_TOL,
        "float64 reference rows",
    )
    impls, outputs, errors, ref_err = (
        checked.impls,
        checked.outputs,
        checked.errors,
        checked.ref_err,
    )

    vs_torch: dict[str, float] = {}
    if TORCH in impls:
        for name, out in outputs.items():
            if name != TORCH:
                vs_torch[name] = rel_l2(out, outputs[TORCH])
    if HPC in impls and vs_torch.get(HPC, 0.0) > REL_TOL:
        errors[HPC] = (
            f"wrong output: rel error {vs_torch[HPC]:.3g} vs the torch baseline "
            f"(tolerance {REL_TOL:g})"
        )
        del impls[HPC]
    del outputs

    timings: dict[str, float] = {}
    modes: dict[str, str] = {}
    timed = [n for n in impls if n == HPC or n in opts.baselines]
    if HPC in impls:
        pool = torch.cuda.graph_pool_handle()
        for name in timed:
            # What a baseline times may be a part of what it was checked on.
            impl = getattr(impls[name], "timed", impls[name])
            try:
                try:
                    graphs = capture_graphs(impl, sets, pool)
                except Exception:  # noqa: BLE001 - retried once, below
                    # A process's first capture of a Triton launch has
                    # failed in the caching allocator; a second one has not.
                    sync_quietly()
                    graphs = capture_graphs(impl, sets, torch.cuda.graph_pool_handle())
                timings[name] = time_graphs(graphs, opts.iters, opts.warmup, scrub)
                modes[name] = "cuda_graph"
                del graphs
            except Exception as err:  # noqa: BLE001 - recorded, the run goes on
                sync_quietly()
                if name == HPC:
                    errors[name] = short_error(err)
                    break
                try:
                    timings[name] = time_eager(
                        impl, sets, opts.iters, opts.warmup, scrub
                    )
                    modes[name] = f"eager (graph capture failed: {short_error(err)})"
                except Exception as err2:  # noqa: BLE001 - recorded
                    errors[name] = short_error(err2)
                    sync_quietly()

    ok = HPC in timings
    records = []
    for name in names:
        if name != HPC and name not in opts.baselines:
            continue
        extra: dict[str, Any] = {}
        if name in ref_err:
            extra["ref_rel_err"] = json_float(ref_err[name], 3)
        if name in vs_torch:
            extra["rel_err_vs_torch"] = json_float(vs_torch[name], 3)
        if name == HPC:
            extra.update(
                tokens=case.tokens,
                local_experts=case.local_experts,
                intermediate_size=inter,
                experts_touched=len(problem.touched),
                local_routes=problem.local_routes(),
                num_sets=num_sets,
                weights_gb_per_set=round(set_bytes / 1e9, 3),
                rotated_touched_gb=round(rotated / 1e9, 3),
                l2_scrub=scrub is not None,
                ref_rows=len(rows),
                tiling=dataclasses.asdict(
                    env.hpc_ops.moe_tiling(
                        case.tokens,
                        TOPK,
                        case.local_experts,
                        NUM_EXPERTS,
                        HIDDEN,
                        inter,
                        torch.cuda.get_device_properties(0).multi_processor_count,
                        case.block_wise,
                    )
                ),
            )
            if case.tp == "ep8":
                extra["placement"] = (
                    f"rank {EP_RANK} of {EP_SIZE}: global experts "
                    f"{EP_RANK * case.local_experts}.."
                    f"{(EP_RANK + 1) * case.local_experts - 1} through expert_map"
                )
            if case.block_padded():
                extra["note"] = PAD_NOTE.format(
                    inter=case.tp_shard, padded=inter, last=inter - 1
                )
            if TORCH not in impls and HPC in impls:
                extra["check"] = "reference rows only: the torch baseline failed"
            skipped = {b: env.missing[b] for b in opts.baselines if b in env.missing}
            if skipped:
                extra["skipped_baselines"] = skipped
        if name == TORCH:
            extra["variant"] = TORCH_VARIANT
        if name == FUSED_EXPERTS:
            extra["variant"] = FUSED_EXPERTS_VARIANT
        if name == TRITON_GEMMS:
            extra["variant"] = TRITON_GEMMS_VARIANT
        if name in modes:
            extra["timing"] = modes[name]
        if name not in timings:
            extra["error"] = errors.get(name, "not timed: the hpc result failed")
        us = timings.get(name)
        record = _record(case, name, us, floor, **extra)
        if name == HPC:
            record["ratios"] = ratios_over(timings, HPC)
        records.append(record)
    return records, ok


def select_cases(quick: bool, patterns: list[str]) -> list[Case]:
    cases = all_cases()
    if quick:
        cases = [c for c in cases if c.name in QUICK_CASES]
    return [c for c in cases if any(fnmatch.fnmatch(c.name, p) for p in patterns)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="only " + ", ".join(QUICK_CASES),
    )
    parser.add_argument("--out", type=Path, help="also write the JSON under this dir")
    parser.add_argument("--iters", type=int, default=100, help="timed replays (>= 50)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument(
        "--cases",
        default="*",
        help="comma-separated globs over case names "
        "(<tp8|ep8|tp1>-<pertensor|blockwise>-t<tokens>[-skewed])",
    )
    parser.add_argument(
        "--baselines",
        default=",".join(BASELINES),
        help="comma-separated subset of: "
        + ", ".join(BASELINES)
        + " (default: all; those that cannot run here are skipped with the "
        "reason: vLLM does not import, or for fused_experts vLLM's compiled "
        "_C/_moe_C ops are not loaded; torch always runs once as the "
        "correctness check of hpc)",
    )
    parser.add_argument(
        "--max-weight-gb",
        type=float,
        default=None,
        help="memory for one case's rotated weight sets (default: "
        f"{WEIGHT_MEMORY_SHARE:g} of the device's memory, at most "
        f"{MAX_WEIGHT_GB:g})",
    )
    add_merge_arg(parser)
    args = parser.parse_args(argv)
    if args.iters < MIN_ITERS:
        parser.error(f"--iters must be at least {MIN_ITERS}")
    unknown = set(filter(None, args.baselines.split(","))) - set(BASELINES)
    if unknown:
        parser.error(f"unknown baselines: {', '.join(sorted(unknown))}")
    return args


def moe_unavailable_reason(hpc_ops: ModuleType) -> str | None:
    """Why the MoE op cannot run, or None (a tiny workspace exercises the
    library's MoE entry points)."""
    try:
        moe_workspace(
            hpc_ops,
            max_tokens=1,
            topk=1,
            num_local_experts=1,
            hidden_size=BLOCK,
            intermediate_size=BLOCK,
        )
    except Exception as err:  # noqa: BLE001 - reported
        return short_error(err)
    return None


def find_missing(baselines: Sequence[str]) -> dict[str, str]:
    """The wanted baselines that cannot run here, each with the reason
    (printed): vLLM's Python does not import, or, for ``fused_experts``,
    the compiled vLLM ops it calls are not loaded (importing vLLM's op
    wrappers loads the libraries that exist, so the check follows the
    import)."""
    missing = {
        name: f"not importable: {why}"
        for name, why in missing_baselines(
            {
                FUSED_EXPERTS: (FUSED_MOE_MODULE, "fused_experts"),
                TRITON_GEMMS: (FUSED_MOE_MODULE, "invoke_fused_moe_triton_kernel"),
            },
            baselines,
        ).items()
    }
    if FUSED_EXPERTS in baselines and FUSED_EXPERTS not in missing:
        absent = missing_ops(FUSED_EXPERTS_OPS)
        if absent:
            missing[FUSED_EXPERTS] = (
                "vLLM's compiled ops are not loaded ("
                + ", ".join(f"torch.ops.{op}" for op in absent)
                + "): needs vLLM's _C and _moe_C libraries"
            )
            print(f"{FUSED_EXPERTS} skipped: {missing[FUSED_EXPERTS]}")
    return missing


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    cases = select_cases(args.quick, args.cases.split(","))
    if not cases:
        print(f"benchmark_hpc_moe: no case matches {args.cases!r}")
        return 1
    reason = unavailable_reason()
    if reason is None:
        hpc_ops = import_hpc_ops()
        reason = moe_unavailable_reason(hpc_ops)
    if reason is not None:
        print(f"benchmark_hpc_moe: not run: {reason}")
        return 1

    max_weight_gb = args.max_weight_gb
    if max_weight_gb is None:
        props = torch.cuda.get_device_properties()
        max_weight_gb = min(
            MAX_WEIGHT_GB, WEIGHT_MEMORY_SHARE * props.total_memory / 1e9
        )
    opts = Options(
        iters=args.iters,
        warmup=args.warmup,
        baselines=tuple(b for b in args.baselines.split(",") if b),
        max_weight_bytes=int(max_weight_gb * 1e9),
    )
    missing = find_missing(opts.baselines)
    bandwidth = measure_copy_bandwidth_gbps()
    tflops, rates, rate_notes = floor_matmul_tflops()
    torch.accelerator.empty_cache()
    env = Env(
        hpc_ops=hpc_ops,
        bandwidth_gbps=bandwidth,
        fp8_tflops=tflops["fp8"],
        scrub=L2Scrub(),
        missing=missing,
        weights=WeightCache(),
    )
    print(
        f"copy bandwidth {bandwidth:.0f} GB/s, fp8 matmul {env.fp8_tflops:.0f} "
        f"TFLOP/s, {len(cases)} MoE cases"
    )

    records: list[dict[str, Any]] = []
    sound = True
    for case in cases:
        try:
            case_records, ok = bench_case(case, env, opts)
        except Exception as err:  # noqa: BLE001 - e.g. out of memory: go on
            sync_quietly()
            case_records = [_record(case, HPC, None, None, error=short_error(err))]
            ok = False
            env.weights.clear()
        sound &= ok
        records.extend(case_records)
        touched = case_records[0].get("experts_touched")
        print_progress(
            WORKLOAD, case.name, case_records, started, f", {touched} experts"
        )
        torch.accelerator.empty_cache()
    env.weights.clear()

    extra: dict[str, Any] = {
        "fp8_matmul_tflops": round(env.fp8_tflops, 1),
        "matmul_tflops": {
            k: None if v is None else round(v, 1) for k, v in rates.items()
        },
        "matmul_notes": rate_notes,
        "skipped": missing,
    }
    if args.merge is not None:
        order = [(WORKLOAD, c.name) for c in all_cases()]
        records, extra["merged"] = merge_records(
            args.merge, records, order, carried=("fp8_matmul_tflops",)
        )
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
