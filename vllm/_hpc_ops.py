# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Typed Python entry points of the ``_hpc_C`` kernels.

As ``vllm/_custom_ops.py`` does for ``_C``: one thin function per kernel op
under the op's name, forwarding to ``torch.ops._hpc_C``; the fake (meta)
implementations, so the ops trace under ``torch.compile`` and
``FakeTensor``; the size, layout and field queries; and the kernels' limits.
This is the only module that names ``torch.ops._hpc_C``.

Nothing here checks its arguments: the C++ adapters check only what memory
safety needs (raising ``RuntimeError``). ``vllm._hpc_ops_validation`` has a
``validate_<op>`` for each op, raising ``ValueError`` that names the
offending argument and the accepted values; tests, workspace creation and
direct callers run it, the vLLM layers check their configuration once
instead.

The ops take their persistent state from a workspace owned by the caller
(``DecodeWorkspace`` and ``PrefillWorkspace`` in
``vllm/v1/attention/ops/hpc_attn_workspace.py``, ``MoeWorkspace`` in
``vllm/model_executor/layers/fused_moe/hpc_moe.py``), typed here by the
protocols of the fields the ops and their validation read.

This module imports torch only: it works on a machine that has the compiled
library but no vLLM installation.
"""

from __future__ import annotations

import dataclasses
import enum
import glob
import os
from typing import Any, Protocol

import torch

__all__ = [
    "DECODE_TILE_TOKENS",
    "FP8_E4M3_MAX",
    "MAX_DECODE_QUERY_TOKENS",
    "MAX_DECODE_ROWS",
    "MAX_GQA_RATIO",
    "MOE_BLOCK_SHAPE",
    "MOE_HIDDEN_ALIGN",
    "MOE_INTERMEDIATE_ALIGN",
    "MOE_MAX_TOPK",
    "PREFILL_MAX_KV_HEADS",
    "SUPPORTED_BLOCK_SIZES",
    "SUPPORTED_HEAD_SIZES",
    "DecodeWorkspaceLike",
    "MoeTiling",
    "MoeWorkspaceLike",
    "PrefillWorkspaceLike",
    "QkNormPolicy",
    "SplitMode",
    "decode_attention",
    "decode_ctas_per_sm",
    "decode_plan_layout",
    "decode_plan_size",
    "decode_workspace_sizes",
    "fused_moe_fp8",
    "hpc_ops_available",
    "moe_tiling",
    "moe_workspace_bytes",
    "plan_decode",
    "plan_prefill",
    "prefill_attention",
    "prefill_plan_layout",
    "rope_norm_store_kv",
]


class QkNormPolicy(enum.IntEnum):
    """Order of the per-head QK-RMSNorm relative to RoPE.

    The integer values are passed to the kernel unchanged.
    """

    NONE = 0
    ROPE_THEN_NORM = 1
    NORM_THEN_ROPE = 2


class SplitMode(enum.IntEnum):
    """How the decode planner cuts KV work (csrc/hpc/attention/decode/decode_plan.h).

    BALANCED: 64-token tiles dealt evenly over the CTAs, splitting sequences
    wherever the shares fall. BATCH_INVARIANT: fixed-length pieces per
    sequence, so a sequence's output is bitwise independent of its batch.
    STATIC: min(16, ceil(len / 512)) pieces per sequence, one CTA each (the
    classic split-KV schedule, for comparison).
    """

    BALANCED = 0
    BATCH_INVARIANT = 1
    STATIC = 2


# ---------------------------------------------------------------------------
# The library
# ---------------------------------------------------------------------------

_MISSING_LIBRARY = (
    "vllm._hpc_C is not built or failed to load (vLLM builds it when "
    "its CUDA architectures include sm_90a)"
)


def _library_path() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = sorted(glob.glob(os.path.join(here, "_hpc_C*.so")))
    return candidates[0] if candidates else None


def _load_library() -> bool:
    path = _library_path()
    if path is None:
        return False
    try:
        torch.ops.load_library(path)
    except OSError:
        return False
    return True


class _MissingLibrary:
    """Stands in for the op namespace when the library is absent: any op
    raises ``RuntimeError`` saying so."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(_MISSING_LIBRARY)


_LIBRARY_LOADED = _load_library()
# The op namespace, or its stand-in; every op below is called through it.
_C: Any = torch.ops._hpc_C if _LIBRARY_LOADED else _MissingLibrary()


def hpc_ops_available() -> bool:
    """True when the compiled ``_hpc_C`` library is loaded."""
    return _LIBRARY_LOADED


# ---------------------------------------------------------------------------
# Limits of the kernels
# ---------------------------------------------------------------------------


def _kernel_limits() -> dict[str, tuple[int, ...]]:
    """The library's limits by name (csrc/hpc/kernel_limits.h), or an empty dict
    when it is absent."""
    if not _LIBRARY_LOADED:
        return {}
    limits = {}
    for entry in _C.kernel_limits():
        name, _, values = entry.partition("=")
        limits[name] = tuple(int(v) for v in values.split(","))
    return limits


# What the limits read where the library is absent (a machine without the
# CUDA build: the validation and the fakes still work); the tests check that
# the library says the same.
_FALLBACK_LIMITS: dict[str, tuple[int, ...]] = {
    "head_sizes": (64, 128, 256),
    "block_sizes": (16, 32, 64),
    "max_gqa_ratio": (16,),
    "decode_tile_tokens": (64,),
    "max_decode_query_tokens": (8,),
    "max_decode_rows": (64,),
    "prefill_max_kv_heads": (256,),
    "moe_block_shape": (128, 128),
    "moe_max_topk": (16,),
    "moe_hidden_align": (128,),
    "moe_intermediate_align": (64,),
}
_LIMITS = _kernel_limits() or _FALLBACK_LIMITS

SUPPORTED_HEAD_SIZES = _LIMITS["head_sizes"]
SUPPORTED_BLOCK_SIZES = _LIMITS["block_sizes"]
(MAX_GQA_RATIO,) = _LIMITS["max_gqa_ratio"]
FP8_E4M3_MAX = 448.0
# KV tokens per decode tile; split lengths are multiples of it.
(DECODE_TILE_TOKENS,) = _LIMITS["decode_tile_tokens"]
# Query tokens per request (speculative decoding: up to 7 draft tokens), and
# rows of one KV head's decode tile: query tokens x GQA ratio.
(MAX_DECODE_QUERY_TOKENS,) = _LIMITS["max_decode_query_tokens"]
(MAX_DECODE_ROWS,) = _LIMITS["max_decode_rows"]
# A packed prefill tile keeps its KV head in the low 8 bits (prefill_plan.h).
(PREFILL_MAX_KV_HEADS,) = _LIMITS["prefill_max_kv_heads"]
MOE_BLOCK_SHAPE = _LIMITS["moe_block_shape"]
(MOE_MAX_TOPK,) = _LIMITS["moe_max_topk"]
# hidden_size must be a multiple of MOE_HIDDEN_ALIGN; intermediate_size of
# MOE_INTERMEDIATE_ALIGN (per-tensor) or of the block (block-wise).
(MOE_HIDDEN_ALIGN,) = _LIMITS["moe_hidden_align"]
(MOE_INTERMEDIATE_ALIGN,) = _LIMITS["moe_intermediate_align"]


# ---------------------------------------------------------------------------
# Workspaces: the fields the ops and their validation read
# ---------------------------------------------------------------------------


class DecodeWorkspaceLike(Protocol):
    """A decode workspace (``DecodeWorkspace``): the plan, the partial
    buffers and what they were sized for."""

    # What decode_attention hands to the kernel.
    window: int  # the plan's sliding window (0: none)
    max_ctas: int
    plan_buffer: torch.Tensor  # int32, flat
    partial_out: torch.Tensor  # float32
    partial_lse: torch.Tensor  # float32
    piece_counters: torch.Tensor  # int32 [max_units], zero between calls

    @property
    def max_units(self) -> int: ...

    # What its validation checks the call against besides.
    max_batch: int
    max_query_tokens: int
    num_q_heads: int
    num_kv_heads: int
    head_size: int


class PrefillWorkspaceLike(Protocol):
    """A prefill workspace (``PrefillWorkspace``): the tile plan and what it
    was sized for."""

    plan_buffer: torch.Tensor  # int32, flat
    max_tokens: int
    max_batch: int
    num_q_heads: int
    num_kv_heads: int


class MoeWorkspaceLike(Protocol):
    """A fused-MoE workspace (``MoeWorkspace``): the scratch memory and what
    it was sized for."""

    buffer: torch.Tensor  # uint8, flat
    max_tokens: int
    topk: int
    num_local_experts: int
    hidden_size: int
    intermediate_size: int


# ---------------------------------------------------------------------------
# rope_norm_store_kv: fused QK-RMSNorm + RoPE + KV-cache write (+ FP8 quant)
# ---------------------------------------------------------------------------


def rope_norm_store_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    q_out: torch.Tensor,
    *,
    q_scale: torch.Tensor | None = None,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    eps: float = 1e-6,
    norm_policy: int = QkNormPolicy.NONE,
    is_neox: bool = True,
) -> None:
    """Fused attention prologue in one launch.

    For each token ``t`` of ``qkv`` (``[T, (Hq + 2 * Hkv) * D]``, Q heads then
    K heads then V heads):

    * optional per-head RMSNorm of Q and K (``q_norm_weight``/``k_norm_weight``,
      ``eps``), before or after RoPE as ``norm_policy`` says;
    * RoPE at ``positions[t]`` from vLLM's ``cos_sin_cache``
      (``[max_position, rotary_dim]``, cos then sin halves), NeoX or GPT-J style
      (``is_neox``), rotating the first ``rotary_dim`` channels;
    * K and V written into ``key_cache``/``value_cache`` at slot
      ``slot_mapping[t]`` (``block = slot // block_size``, offset
      ``slot % block_size``); negative slots are padding and skipped. The
      caches are ``[num_blocks, block_size, Hkv, D]`` views with any strides
      (unit stride over ``D``); FP8-E4M3 caches store ``value / k_scale``
      (``v_scale``);
    * Q written to ``q_out`` (``[T, Hq, D]``) in the model dtype, or as
      FP8-E4M3 with per-token-per-head scales ``amax / 448`` stored in
      ``q_scale[t, h]``.

    No host synchronisation and no allocation: safe to capture in CUDA graphs.
    """
    if int(norm_policy) == QkNormPolicy.NONE:
        q_norm_weight = k_norm_weight = None
    _C.rope_norm_store_kv(
        qkv,
        positions,
        slot_mapping,
        cos_sin_cache,
        key_cache,
        value_cache,
        q_out,
        q_scale,
        q_norm_weight,
        k_norm_weight,
        k_scale,
        v_scale,
        float(eps),
        int(norm_policy),
        bool(is_neox),
    )


# ---------------------------------------------------------------------------
# Split-KV decode: planner and paged decode attention
# ---------------------------------------------------------------------------


def _named(values: list[int], names: list[str]) -> dict[str, int]:
    """An op's list of values keyed by the names its ``*_fields`` op gives,
    in the same order (written once in C++)."""
    return dict(zip(names, (int(v) for v in values), strict=True))


def decode_plan_layout(max_units: int, num_ctas: int) -> dict[str, int]:
    """The offsets of a decode plan's arrays and its size, in int32
    elements, for up to ``max_units`` (batch x KV heads) units and
    ``num_ctas`` CTA slots, by name (decode_plan.h's PlanLayout)."""
    return _named(
        _C.decode_plan_layout(max_units, num_ctas), _C.decode_plan_layout_fields()
    )


def decode_plan_size(max_units: int, num_ctas: int) -> int:
    """int32 elements of a plan for up to ``max_units`` units and
    ``num_ctas`` CTA slots."""
    return decode_plan_layout(max_units, num_ctas)["size"]


def decode_workspace_sizes(
    mode: SplitMode,
    max_batch: int,
    num_kv_heads: int,
    max_kv_tokens: int,
    num_ctas: int,
    split_tiles: int,
) -> tuple[int, int]:
    """(plan CTA slots, partial rows) a decode workspace needs for every
    step of up to ``max_batch`` sequences over ``max_kv_tokens`` cached
    tokens, asked of the planner (decode_plan.h ``workspace_sizes``)."""
    sizes = _named(
        _C.decode_workspace_sizes(
            int(mode), max_batch, num_kv_heads, max_kv_tokens, num_ctas, split_tiles
        ),
        _C.decode_workspace_sizes_fields(),
    )
    return sizes["plan_ctas"], sizes["max_partials"]


def decode_ctas_per_sm(head_size: int, kv_element_bytes: int) -> int:
    """Decode CTAs that share an SM for this head size and KV element size
    (1 for an FP8 cache, 2 for a 16-bit one), asked of the library."""
    return int(_C.decode_ctas_per_sm(head_size, kv_element_bytes))


def plan_decode(
    kv_lens: torch.Tensor,
    plan: torch.Tensor,
    *,
    num_kv_heads: int,
    query_tokens: int,
    window: int,
    num_ctas: int,
    max_units: int,
    min_split_tiles: int,
    mode: SplitMode,
    split_tiles: int,
    group: int,
    kv_element_bytes: int,
) -> None:
    """Writes the split-KV decode plan for this step's KV lengths (int32
    ``[batch]``, including the query tokens) into ``plan``: on the GPU
    without synchronising, or on the host for CPU tensors. ``num_ctas``: the
    CTA slots the mode may use; ``min_split_tiles`` and ``split_tiles``: the
    balanced mode's least and the batch-invariant mode's piece length, in
    decode tiles. ``group`` (query heads per KV head) and
    ``kv_element_bytes`` (1 for FP8 caches, else 2) weigh a split unit's
    merge against its pieces: the balanced mode cuts long units into fewer,
    longer pieces when they have many query rows."""
    _C.plan_decode(
        kv_lens,
        plan,
        num_kv_heads,
        query_tokens,
        window,
        num_ctas,
        max_units,
        min_split_tiles,
        int(mode),
        split_tiles,
        group,
        kv_element_bytes,
    )


def decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_lens: torch.Tensor,
    out: torch.Tensor,
    workspace: DecodeWorkspaceLike,
    *,
    scale: float,
    query_tokens: int = 1,
    q_scale: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> None:
    """Paged decode attention over a split-KV plan, in one kernel launch (the
    last CTA to finish a split sequence merges its pieces).

    ``q``: ``[batch * query_tokens, num_q_heads, head_size]``, token-major
    per sequence (query t of sequence b is row b * query_tokens + t); bf16 or
    fp16 matching a 16-bit cache, or bf16/fp16/FP8-E4M3 (with ``q_scale``
    ``[tokens, num_q_heads]``) for an FP8 cache. ``key_cache``/``value_cache``:
    strided ``[num_blocks, block_size, num_kv_heads, head_size]`` views.
    ``kv_lens``: int32 ``[batch]`` KV lengths including the query tokens,
    which attend causally to each other (a row that sees no key, e.g. a
    length shorter than ``query_tokens``, gets zeros). ``workspace.plan(kv_lens,
    query_tokens)`` must have run for these lengths; its sliding window
    applies, and a different ``query_tokens`` fails the launch. With an FP8
    cache both products run on FP8 tensor cores: FP8 queries are used as
    given, bf16/fp16 queries are quantized per row inside the kernel into
    two E4M3 terms (value and residual), and the probabilities are rounded
    to E4M3.
    ``k_scale``/``v_scale``: per-tensor FP8 dequantisation scales.
    ``softcap``: logits soft-cap (0: none). ``out`` (bf16/fp16, shape of
    ``q``) is written.
    """
    _C.decode_attention(
        q,
        key_cache,
        value_cache,
        block_table,
        kv_lens,
        workspace.plan_buffer,
        out,
        workspace.partial_out,
        workspace.partial_lse,
        workspace.piece_counters,
        q_scale,
        k_scale,
        v_scale,
        float(scale),
        float(softcap),
        query_tokens,
        workspace.max_units,
        workspace.max_ctas,
    )


# ---------------------------------------------------------------------------
# Paged prefill: tile planner and prefill / chunked-prefill attention
# ---------------------------------------------------------------------------


def prefill_plan_layout(
    max_tokens: int, max_batch: int, num_q_heads: int, num_kv_heads: int
) -> dict[str, int]:
    """The prefill plan for up to ``max_tokens`` query tokens in up to
    ``max_batch`` requests, asked of the planner, by name: its tile capacity
    (``max_tiles``), the offsets of its arrays (``request_first_item``,
    ``tiles``) and its ``size``, in int32 elements (prefill_plan.h)."""
    return _named(
        _C.prefill_plan_layout(max_tokens, max_batch, num_q_heads, num_kv_heads),
        _C.prefill_plan_layout_fields(),
    )


def plan_prefill(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    plan: torch.Tensor,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    max_batch: int,
    max_tiles: int,
) -> None:
    """Writes the prefill tile plan for this step's lengths into ``plan``
    (``query_start_loc`` int32 ``[batch + 1]``, ``seq_lens`` int32
    ``[batch]``): on the GPU without synchronising, or on the host for CPU
    tensors."""
    _C.plan_prefill(
        query_start_loc,
        seq_lens,
        plan,
        num_q_heads,
        num_kv_heads,
        max_batch,
        max_tiles,
    )


def prefill_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    workspace: PrefillWorkspaceLike,
    *,
    scale: float,
    q_scale: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    softcap: float = 0.0,
    window: int = 0,
) -> None:
    """Paged prefill / chunked-prefill attention over a varlen batch, into
    ``out``.

    Request ``b`` has ``q_len = query_start_loc[b + 1] - query_start_loc[b]``
    new query tokens (rows ``query_start_loc[b]..`` of ``q``) and
    ``kv_len = seq_lens[b]`` keys in the cache, its cached context followed
    by the new tokens (already written, e.g. by :func:`rope_norm_store_kv`),
    in blocks ``block_table[b, 0..]``. The mask is causal and bottom-right
    aligned: query token ``i`` sits at position ``pos = kv_len - q_len + i``
    and sees keys ``0..pos``. With ``window`` w > 0 it sees only keys in
    ``(pos - w, pos]``. ``softcap`` > 0 caps the logits:
    ``softcap * tanh(scale * q.k / softcap)``; ``scale`` multiplies ``q.k``.

    ``q``: ``[tokens, num_q_heads, head_size]`` with unit stride over the
    head size and 16-byte aligned rows: bf16 or fp16 equal to a 16-bit
    cache's dtype, or bf16, fp16 or FP8-E4M3 with an FP8-E4M3 cache. FP8
    queries carry per-token-per-head scales ``q_scale``, float32
    ``[tokens, num_q_heads]`` (the layout :func:`rope_norm_store_kv` writes).
    ``key_cache``/``value_cache``: strided
    ``[num_blocks, block_size, num_kv_heads, head_size]`` views; an FP8
    cache has per-tensor dequantisation scales ``k_scale``/``v_scale``
    (float32, one element each). ``block_table``: int32
    ``[>= batch, max_blocks]``. ``out``: bf16 or fp16, the shape of ``q``.

    ``workspace.plan(query_start_loc, seq_lens)`` must have run for these
    lengths, and ``query_start_loc[batch]`` must be ``q.shape[0]``. A query
    token that sees no key gets zeros. No host synchronisation and no
    allocation: safe to capture in CUDA graphs.
    """
    _C.prefill_attention(
        q,
        key_cache,
        value_cache,
        block_table,
        query_start_loc,
        seq_lens,
        workspace.plan_buffer,
        out,
        q_scale,
        k_scale,
        v_scale,
        float(scale),
        float(softcap),
        int(window),
    )


# ---------------------------------------------------------------------------
# Fused FP8 MoE: routing, quantization, two grouped GEMMs, SiLU-and-mul and
# the weighted top-k reduction
# ---------------------------------------------------------------------------


def moe_workspace_bytes(
    max_tokens: int,
    topk: int,
    num_local_experts: int,
    hidden_size: int,
    intermediate_size: int,
) -> int:
    """Bytes of the scratch memory (routing tables, quantized activations,
    the intermediate) :func:`fused_moe_fp8` needs for up to ``max_tokens``
    tokens routed to ``topk`` experts each, over ``num_local_experts``
    experts of shape ``hidden_size`` x ``intermediate_size`` (per rank);
    asked of the library."""
    return int(
        _C.moe_workspace_bytes(
            max_tokens, topk, num_local_experts, hidden_size, intermediate_size
        )
    )


def fused_moe_fp8(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    out: torch.Tensor,
    workspace: MoeWorkspaceLike,
    *,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    a1_scale: torch.Tensor | None = None,
    a2_scale: torch.Tensor | None = None,
    block_shape: tuple[int, int] | list[int] | None = None,
    expert_map: torch.Tensor | None = None,
    expert_offset: int = 0,
    shared_output: torch.Tensor | None = None,
    apply_router_weight_on_input: bool = False,
    global_num_experts: int | None = None,
) -> None:
    """FP8 mixture of experts with SiLU-and-mul, in place into ``out``.

    For each token ``t`` and each of its ``k`` choices ``j``, with
    ``e = local(topk_ids[t, j])`` (skipped when not on this rank)::

        g, u = split(W13[e] @ x_t)        # gate rows [0, I), up rows [I, 2I)
        y = W2[e] @ fp8(silu(g) * u)
        out[t] = sum_j topk_weights[t, j] * y (+ shared_output[t])

    ``hidden_states``: ``[M, H]`` bf16/fp16, quantized to FP8 inside, or
    float8_e4m3fn with ``a1_scale``. ``w13``: ``[E_local, 2I, H]`` and
    ``w2``: ``[E_local, H, I]`` float8_e4m3fn. ``topk_ids``: ``[M, k]``
    int32/int64 global expert ids; ``topk_weights``: ``[M, k]`` float32.
    ``out``: ``[M, H]`` bf16/fp16, every row written (zeros, or
    ``shared_output``, for tokens with no local expert).

    Per-tensor mode (``block_shape`` None): ``w13_scale``/``w2_scale`` are
    float32 ``[E_local]``; ``a1_scale`` is a one-element static scale, or None
    to quantize 16-bit inputs per token (amax / 448); ``a2_scale`` (required)
    is the static scale of the intermediate. Block-wise mode (``block_shape``
    ``(128, 128)``): ``w13_scale`` ``[E_local, 2I/128, H/128]``, ``w2_scale``
    ``[E_local, H/128, I/128]``; ``a1_scale`` None for 16-bit inputs
    (quantized per 1x128 group inside) or ``[M, H/128]`` with FP8 inputs;
    ``a2_scale`` None (the intermediate is quantized per 1x128 group).

    ``expert_map``: int32 ``[global_E]``, global id -> local slot or -1.
    Without it, local slot = id - ``expert_offset`` and ids outside
    ``[0, E_local)`` are skipped. ``apply_router_weight_on_input``: the
    weights were applied to the input already (``k`` must be 1); the kernel
    uses 1.0. ``global_num_experts``: experts of the whole model (default:
    the length of ``expert_map``, else ``E_local``); it only steers the
    tiling (:func:`moe_tiling`), which assumes an even spread over them.

    No host synchronisation and no allocation: safe to capture in CUDA graphs.
    """
    if hidden_states.shape[0] == 0:
        return
    if global_num_experts is None:
        global_num_experts = (
            expert_map.shape[0] if expert_map is not None else w13.shape[0]
        )
    _C.fused_moe_fp8(
        hidden_states,
        a1_scale,
        w13,
        w13_scale,
        w2,
        w2_scale,
        a2_scale,
        topk_weights,
        topk_ids,
        expert_map,
        shared_output,
        out,
        workspace.buffer,
        int(expert_offset),
        int(global_num_experts),
        block_shape is not None,
        bool(apply_router_weight_on_input),
    )


@dataclasses.dataclass(frozen=True)
class MoeTiling:
    """The run-time tiling of :func:`fused_moe_fp8` for one call (the
    ``moe_tiling`` function of ``csrc/hpc/moe/moe_tiling.h``)."""

    token_tile: int  # tokens per GEMM tile (the wgmma N side): 8..64, 96, 128
    max_tiles: int  # token tiles over all local experts, at most
    gate_up_rows: int  # weight rows per gate-up warpgroup: 128 or 192
    gate_up_blocks: int  # gate_up_rows-column blocks of the intermediate
    gate_up_split: int  # K splits of the gate-up GEMM
    gate_up_group: int  # column blocks per gate-up CTA (1 when K is split)
    gate_up_ctas_per_sm: int  # gate-up CTAs sharing an SM (1, 2 or 3)
    down_blocks: int  # 256-row blocks of the hidden dimension
    down_group: int  # row blocks per down-GEMM CTA
    down_ctas_per_sm: int  # down-GEMM CTAs sharing an SM (1, 2 or 3)
    decode: bool  # a few tokens: the decode path instead
    slot_tiles: bool  # few routed slots: grouped GEMMs without a route stage
    evict_first_weights: bool  # GEMM weights loaded evict-first (8-token tiles)


def moe_tiling(
    num_tokens: int,
    topk: int,
    num_local_experts: int,
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    num_sms: int,
    block_wise: bool = False,
) -> MoeTiling:
    """The tiling :func:`fused_moe_fp8` uses for ``num_tokens`` tokens on a
    GPU with ``num_sms`` SMs, for per-tensor or (``block_wise``) block-wise
    scaling (runs on the host; no GPU needed)."""
    values = list(
        _C.moe_tiling(
            num_tokens,
            topk,
            num_local_experts,
            num_experts,
            hidden_size,
            intermediate_size,
            num_sms,
            bool(block_wise),
        )
    )
    # By name, as C++ lists them: a field added there fails here loudly
    # instead of shifting the others.
    fields = _named(values, _C.moe_tiling_fields())
    flags = {f.name for f in dataclasses.fields(MoeTiling) if f.type == "bool"}
    kwargs: dict[str, Any] = {
        name: bool(v) if name in flags else int(v) for name, v in fields.items()
    }
    return MoeTiling(**kwargs)


if _LIBRARY_LOADED:

    @torch.library.register_fake("_hpc_C::plan_decode")
    def _plan_decode_fake(
        kv_lens: torch.Tensor,
        plan: torch.Tensor,
        num_kv_heads: int,
        query_tokens: int,
        window: int,
        num_ctas: int,
        max_units: int,
        min_split_tiles: int,
        mode: int,
        split_tiles: int,
        group: int,
        kv_elem_bytes: int,
    ) -> None:
        return None

    @torch.library.register_fake("_hpc_C::decode_attention")
    def _decode_attention_fake(
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        kv_lens: torch.Tensor,
        plan: torch.Tensor,
        out: torch.Tensor,
        partial_out: torch.Tensor,
        partial_lse: torch.Tensor,
        piece_counters: torch.Tensor,
        q_scale: torch.Tensor | None,
        k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None,
        scale: float,
        softcap: float,
        query_tokens: int,
        max_units: int,
        num_ctas: int,
    ) -> None:
        # out and the workspace are mutated in place.
        return None

    @torch.library.register_fake("_hpc_C::rope_norm_store_kv")
    def _rope_norm_store_kv_fake(
        qkv: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        q_out: torch.Tensor,
        q_scale: torch.Tensor | None,
        q_norm_weight: torch.Tensor | None,
        k_norm_weight: torch.Tensor | None,
        k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None,
        eps: float,
        norm_policy: int,
        is_neox: bool,
    ) -> None:
        # All outputs are mutated in place; nothing is returned.
        return None

    @torch.library.register_fake("_hpc_C::fused_moe_fp8")
    def _fused_moe_fp8_fake(
        hidden_states: torch.Tensor,
        a1_scale: torch.Tensor | None,
        w13: torch.Tensor,
        w13_scale: torch.Tensor,
        w2: torch.Tensor,
        w2_scale: torch.Tensor,
        a2_scale: torch.Tensor | None,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        expert_map: torch.Tensor | None,
        shared_output: torch.Tensor | None,
        out: torch.Tensor,
        workspace: torch.Tensor,
        expert_offset: int,
        global_num_experts: int,
        block_wise: bool,
        apply_router_weight_on_input: bool,
    ) -> None:
        # out and the workspace are mutated in place.
        return None

    @torch.library.register_fake("_hpc_C::plan_prefill")
    def _plan_prefill_fake(
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        plan: torch.Tensor,
        num_q_heads: int,
        num_kv_heads: int,
        max_batch: int,
        max_tiles: int,
    ) -> None:
        # The plan is written in place.
        return None

    @torch.library.register_fake("_hpc_C::prefill_attention")
    def _prefill_attention_fake(
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        plan: torch.Tensor,
        out: torch.Tensor,
        q_scale: torch.Tensor | None,
        k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None,
        scale: float,
        softcap: float,
        window: int,
    ) -> None:
        # out is written in place.
        return None
