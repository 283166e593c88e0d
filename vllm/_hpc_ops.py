# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Typed Python entry points of the ``_hpc_C`` kernels.

One function per kernel entry point, in two forms. The checked form
validates its inputs and raises ``ValueError`` naming the offending argument
and the accepted values before anything reaches the kernels (whose
adapters check only what the kernels themselves rely on, raising
``RuntimeError``); the ``*_unchecked`` form is for callers
that validated their configuration once. Fake (meta) implementations are
registered so the ops trace under ``torch.compile`` and ``FakeTensor``.

The ops take their persistent state from a workspace owned by the caller:
``DecodeWorkspace`` and ``PrefillWorkspace``
(``vllm/v1/attention/ops/hpc_attn_workspace.py``) and ``MoeWorkspace``
(``vllm/model_executor/layers/fused_moe/hpc_moe.py``). The checked forms
check the workspace fields they read, not its class.

This module imports torch only: it must work on a machine that has the
compiled library but no vLLM installation.
"""

from __future__ import annotations

import dataclasses
import enum
import glob
import math
import os
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from vllm.model_executor.layers.fused_moe.hpc_moe import MoeWorkspace
    from vllm.v1.attention.ops.hpc_attn_workspace import (
        DecodeWorkspace,
        PrefillWorkspace,
    )

__all__ = [
    "DECODE_TILE_TOKENS",
    "MOE_BLOCK_SHAPE",
    "MOE_MAX_TOPK",
    "MoeTiling",
    "SplitMode",
    "QkNormPolicy",
    "SUPPORTED_BLOCK_SIZES",
    "SUPPORTED_HEAD_SIZES",
    "decode_attention",
    "decode_attention_unchecked",
    "decode_plan_size",
    "fused_moe_fp8",
    "fused_moe_fp8_unchecked",
    "moe_tiling",
    "moe_workspace_bytes",
    "hpc_ops_available",
    "prefill_attention",
    "prefill_attention_unchecked",
    "rope_norm_store_kv",
    "rope_norm_store_kv_unchecked",
]

SUPPORTED_HEAD_SIZES = (64, 128, 256)
SUPPORTED_BLOCK_SIZES = (16, 32, 64)
MAX_GQA_RATIO = 16
FP8_E4M3_MAX = 448.0

_ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)
_INDEX_DTYPES = (torch.int32, torch.int64)
# Where the kernels' tensors may live: CUDA, or meta while tracing.
_KERNEL_DEVICES = ("cuda", "meta")


class QkNormPolicy(enum.IntEnum):
    """Order of the per-head QK-RMSNorm relative to RoPE.

    The integer values are passed to the kernel unchanged.
    """

    NONE = 0
    ROPE_THEN_NORM = 1
    NORM_THEN_ROPE = 2


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


_LIBRARY_LOADED = _load_library()


def hpc_ops_available() -> bool:
    """True when the compiled ``_hpc_C`` library is loaded."""
    return _LIBRARY_LOADED


def _require_library() -> None:
    if not _LIBRARY_LOADED:
        raise RuntimeError(
            "vllm._hpc_C is not built or failed to load (vLLM builds it when "
            "its CUDA architectures include sm_90a)"
        )


# ---------------------------------------------------------------------------
# Validation helpers: each raises ValueError naming the argument.
# ---------------------------------------------------------------------------


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def _check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _check_positive(**values: int) -> None:
    """Each keyword's value must be >= 1 (a ValueError names the first that
    is not)."""
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def _check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]):
    if t.dtype not in allowed:
        raise ValueError(
            f"{name} has dtype {t.dtype}; accepted dtypes: {_names(allowed)}"
        )


def _check_ndim(name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if t.dim() != ndim:
        raise ValueError(
            f"{name} must be {ndim}-D {layout}, got shape {tuple(t.shape)}"
        )


def _check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}; expected {device} like qkv")


def _check_aligned(name: str, t: torch.Tensor) -> None:
    # Kernels move 16-byte vectors. Fake and meta tensors have no address.
    if t.device.type == "meta" or type(t).__name__ == "FakeTensor":
        return
    if t.data_ptr() % 16 != 0:
        raise ValueError(f"{name} must start on a 16-byte boundary")


def _check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")


def _check_workspace(
    workspace: object, kind: str, op: str, **fields: torch.dtype
) -> torch.device:
    """The tensor fields ``op`` reads of ``workspace`` (a ``kind``), by
    keyword with their dtypes: each present and a tensor of its dtype, all
    on the first one's device, a CUDA device (meta while tracing), which is
    returned."""
    device = None
    first = ""
    for field, dtype in fields.items():
        name = f"workspace.{field}"
        t = getattr(workspace, field, None)
        if t is None:
            raise ValueError(
                f"{name} is missing: workspace must be a {kind}, got "
                f"{type(workspace).__name__}"
            )
        _check_tensor(name, t)
        _check_dtype(name, t, (dtype,))
        if device is None:
            device, first = t.device, name
            if device.type not in _KERNEL_DEVICES:
                raise ValueError(f"{name} is on {device}; {op} needs a CUDA device")
        elif t.device != device:
            raise ValueError(
                f"{name} is on {t.device}; expected {first}'s device {device}"
            )
    assert device is not None
    return device


def _check_cache_pair(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    dtypes: tuple[torch.dtype, ...],
) -> tuple[int, int, int]:
    """Shapes and dtypes of a K/V cache pair given as
    [num_blocks, block_size, num_kv_heads, head_size] views; returns
    (block_size, num_kv_heads, head_size)."""
    layout = "[num_blocks, block_size, num_kv_heads, head_size]"
    _check_ndim("key_cache", key_cache, 4, layout)
    _check_ndim("value_cache", value_cache, 4, layout)
    if key_cache.shape != value_cache.shape:
        raise ValueError(
            f"key_cache shape {tuple(key_cache.shape)} and value_cache shape "
            f"{tuple(value_cache.shape)} must match"
        )
    _, block_size, num_kv_heads, head_size = key_cache.shape
    if head_size not in SUPPORTED_HEAD_SIZES:
        raise ValueError(
            f"head_size (key_cache.shape[-1]) is {head_size}; accepted: "
            f"{SUPPORTED_HEAD_SIZES}"
        )
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(
            f"block_size (key_cache.shape[1]) is {block_size}; accepted: "
            f"{SUPPORTED_BLOCK_SIZES}"
        )
    _check_dtype("key_cache", key_cache, dtypes)
    if value_cache.dtype != key_cache.dtype:
        raise ValueError(
            f"value_cache dtype {value_cache.dtype} must equal key_cache dtype "
            f"{key_cache.dtype}"
        )
    return block_size, num_kv_heads, head_size


# ---------------------------------------------------------------------------
# rope_norm_store_kv: fused QK-RMSNorm + RoPE + KV-cache write (+ FP8 quant)
# ---------------------------------------------------------------------------


def _validate_rope_norm(
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
) -> None:
    for name, t in (
        ("qkv", qkv),
        ("positions", positions),
        ("slot_mapping", slot_mapping),
        ("cos_sin_cache", cos_sin_cache),
        ("key_cache", key_cache),
        ("value_cache", value_cache),
        ("q_out", q_out),
    ):
        _check_tensor(name, t)

    _check_ndim("qkv", qkv, 2, "[num_tokens, (Hq + 2 * Hkv) * head_size]")
    _check_dtype("qkv", qkv, _ACTIVATION_DTYPES)
    if qkv.stride(-1) != 1:
        raise ValueError(f"qkv must have a unit last-dim stride, got {qkv.stride()}")
    device = qkv.device
    num_tokens = qkv.shape[0]

    block_size, num_kv_heads, head_size = _check_cache_pair(
        key_cache, value_cache, (*_ACTIVATION_DTYPES, torch.float8_e4m3fn)
    )
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        _check_device(name, t, device)
        if t.stride(-1) != 1:
            raise ValueError(
                f"{name} must have a unit head_size stride, got strides {t.stride()}"
            )
        if any(s % 8 for s in t.stride()[:3]):
            raise ValueError(
                f"{name} strides {t.stride()} must be multiples of 8 elements "
                "(16-byte aligned rows)"
            )
    if key_cache.stride() != value_cache.stride():
        raise ValueError(
            f"value_cache strides {value_cache.stride()} must equal key_cache "
            f"strides {key_cache.stride()}"
        )
    cache_is_fp8 = key_cache.dtype == torch.float8_e4m3fn
    if cache_is_fp8:
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if scale is None:
                raise ValueError(f"{name} is required when the KV cache is FP8")
            _check_tensor(name, scale)
            if scale.numel() != 1 or scale.dtype != torch.float32:
                raise ValueError(
                    f"{name} must be a float32 tensor with one element, got "
                    f"shape {tuple(scale.shape)} dtype {scale.dtype}"
                )
            _check_device(name, scale, device)
    elif key_cache.dtype != qkv.dtype:
        raise ValueError(
            f"key_cache dtype {key_cache.dtype} must equal qkv dtype {qkv.dtype} "
            "or be float8_e4m3fn"
        )

    _check_ndim("q_out", q_out, 3, "[num_tokens, Hq, head_size]")
    num_q_heads = q_out.shape[1]
    if q_out.shape[0] != num_tokens or q_out.shape[2] != head_size:
        raise ValueError(
            f"q_out shape {tuple(q_out.shape)} must be [{num_tokens}, Hq, {head_size}]"
        )
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"Hq (q_out.shape[1]) = {num_q_heads} must be a multiple of Hkv "
            f"(key_cache.shape[2]) = {num_kv_heads}"
        )
    if num_q_heads // num_kv_heads > MAX_GQA_RATIO:
        raise ValueError(
            f"Hq / Hkv = {num_q_heads // num_kv_heads}; accepted: 1..{MAX_GQA_RATIO}"
        )
    expected_width = (num_q_heads + 2 * num_kv_heads) * head_size
    if qkv.shape[1] != expected_width:
        raise ValueError(
            f"qkv.shape[1] is {qkv.shape[1]}; expected (Hq + 2 * Hkv) * head_size "
            f"= ({num_q_heads} + 2 * {num_kv_heads}) * {head_size} = "
            f"{expected_width}"
        )
    if qkv.stride(0) % 8 != 0:
        raise ValueError(f"qkv row stride {qkv.stride(0)} must be a multiple of 8")
    _check_dtype("q_out", q_out, (qkv.dtype, torch.float8_e4m3fn))
    _check_device("q_out", q_out, device)
    _check_contiguous("q_out", q_out)
    if q_out.dtype == torch.float8_e4m3fn:
        if q_scale is None:
            raise ValueError("q_scale is required when q_out is float8_e4m3fn")
        _check_tensor("q_scale", q_scale)
        if (
            q_scale.dtype != torch.float32
            or q_scale.dim() != 2
            or q_scale.shape[0] < num_tokens
            or q_scale.shape[1] != num_q_heads
        ):
            raise ValueError(
                f"q_scale must be float32 [>= {num_tokens}, {num_q_heads}], got "
                f"shape {tuple(q_scale.shape)} dtype {q_scale.dtype}"
            )
        _check_device("q_scale", q_scale, device)
        _check_contiguous("q_scale", q_scale)
    elif q_scale is not None:
        raise ValueError("q_scale must be None unless q_out is float8_e4m3fn")

    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        _check_ndim(name, t, 1, "[num_tokens]")
        _check_dtype(name, t, _INDEX_DTYPES)
        _check_device(name, t, device)
        _check_contiguous(name, t)
        if t.shape[0] < num_tokens:
            raise ValueError(
                f"{name} has {t.shape[0]} entries; needs at least num_tokens = "
                f"{num_tokens}"
            )

    _check_ndim("cos_sin_cache", cos_sin_cache, 2, "[max_position, rotary_dim]")
    _check_dtype("cos_sin_cache", cos_sin_cache, (torch.float32, qkv.dtype))
    _check_device("cos_sin_cache", cos_sin_cache, device)
    _check_contiguous("cos_sin_cache", cos_sin_cache)
    rotary_dim = cos_sin_cache.shape[1]
    if rotary_dim % 16 != 0 or not 16 <= rotary_dim <= head_size:
        raise ValueError(
            f"rotary_dim (cos_sin_cache.shape[1]) is {rotary_dim}; accepted: a "
            f"multiple of 16 in [16, head_size = {head_size}]"
        )

    for name, t in (
        ("qkv", qkv),
        ("key_cache", key_cache),
        ("value_cache", value_cache),
        ("q_out", q_out),
        ("cos_sin_cache", cos_sin_cache),
    ):
        _check_aligned(name, t)

    try:
        policy = QkNormPolicy(norm_policy)
    except ValueError:
        raise ValueError(
            f"norm_policy is {norm_policy!r}; accepted: "
            f"{[int(p) for p in QkNormPolicy]} ({', '.join(QkNormPolicy.__members__)})"
        ) from None
    if policy != QkNormPolicy.NONE:
        for name, w in (
            ("q_norm_weight", q_norm_weight),
            ("k_norm_weight", k_norm_weight),
        ):
            if w is None:
                raise ValueError(
                    f"{name} is required when norm_policy is {policy.name}"
                )
            _check_tensor(name, w)
            if w.shape != (head_size,):
                raise ValueError(
                    f"{name} must have shape ({head_size},), got {tuple(w.shape)}"
                )
            _check_dtype(name, w, (torch.float32, qkv.dtype))
            _check_device(name, w, device)
            _check_contiguous(name, w)
            _check_aligned(name, w)
        assert q_norm_weight is not None and k_norm_weight is not None
        if q_norm_weight.dtype != k_norm_weight.dtype:
            raise ValueError(
                f"q_norm_weight dtype {q_norm_weight.dtype} must equal "
                f"k_norm_weight dtype {k_norm_weight.dtype}"
            )
        if not eps > 0.0:
            raise ValueError(f"eps must be positive, got {eps}")


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
    _validate_rope_norm(
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
        eps,
        int(norm_policy),
    )
    _require_library()
    rope_norm_store_kv_unchecked(
        qkv,
        positions,
        slot_mapping,
        cos_sin_cache,
        key_cache,
        value_cache,
        q_out,
        q_scale=q_scale,
        q_norm_weight=q_norm_weight,
        k_norm_weight=k_norm_weight,
        k_scale=k_scale,
        v_scale=v_scale,
        eps=eps,
        norm_policy=norm_policy,
        is_neox=is_neox,
    )


def rope_norm_store_kv_unchecked(
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
    """:func:`rope_norm_store_kv` without the input checks, for callers that
    validated their configuration once (the vLLM layers, on the hot path)."""
    if int(norm_policy) == QkNormPolicy.NONE:
        q_norm_weight = k_norm_weight = None
    torch.ops._hpc_C.rope_norm_store_kv(
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

DECODE_TILE_TOKENS = 64
# Query tokens per request (speculative decoding: up to 7 draft tokens), and
# rows of one KV head's decode tile: query tokens x GQA ratio.
MAX_DECODE_QUERY_TOKENS = 8
MAX_DECODE_ROWS = 64
_DECODE_KV_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
# Where the attention workspaces live, for the messages that name them.
_ATTN_WORKSPACES = "vllm/v1/attention/ops/hpc_attn_workspace.py"
_DECODE_WORKSPACE = f"DecodeWorkspace ({_ATTN_WORKSPACES})"


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


def decode_plan_size(max_units: int, num_ctas: int) -> int:
    """int32 elements of a plan for up to ``max_units`` (batch x KV heads)
    units and ``num_ctas`` CTA slots (decode_plan.h's PlanLayout, asked of
    C++: ``decode_plan_layout`` lists the arrays' offsets, then the size).
    """
    _require_library()
    return int(torch.ops._hpc_C.decode_plan_layout(max_units, num_ctas)[-1])


def _check_split_len(name: str, value: int) -> None:
    if value < 0 or value % DECODE_TILE_TOKENS:
        raise ValueError(
            f"{name} is {value}; accepted: a non-negative multiple of "
            f"{DECODE_TILE_TOKENS}"
        )


def _check_query_tokens(query_tokens: int, group: int | None = None) -> None:
    """1..MAX_DECODE_QUERY_TOKENS query tokens per request, and (with the
    GQA ratio ``group``) at most MAX_DECODE_ROWS rows per KV head."""
    if not 1 <= query_tokens <= MAX_DECODE_QUERY_TOKENS:
        raise ValueError(
            f"query_tokens is {query_tokens}; accepted: 1..{MAX_DECODE_QUERY_TOKENS}"
        )
    if group is not None and query_tokens * group > MAX_DECODE_ROWS:
        raise ValueError(
            f"query_tokens x GQA ratio is {query_tokens} x {group}; accepted: "
            f"at most {MAX_DECODE_ROWS} (1..{MAX_DECODE_ROWS // group} query "
            f"tokens at GQA ratio {group})"
        )


def _resolve_mode(mode: SplitMode | None, fixed_split_len: int) -> SplitMode:
    if mode is None:
        return SplitMode.BATCH_INVARIANT if fixed_split_len else SplitMode.BALANCED
    mode = SplitMode(mode)
    if mode == SplitMode.BATCH_INVARIANT and fixed_split_len == 0:
        raise ValueError(
            "fixed_split_len is 0; the BATCH_INVARIANT mode needs a positive "
            f"multiple of {DECODE_TILE_TOKENS}"
        )
    return mode


def _check_gqa(num_q_heads: int, num_kv_heads: int) -> None:
    if num_q_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a positive multiple of "
            f"num_kv_heads ({num_kv_heads})"
        )
    if num_q_heads // num_kv_heads > MAX_GQA_RATIO:
        raise ValueError(
            f"GQA ratio is {num_q_heads // num_kv_heads}; accepted: 1..{MAX_GQA_RATIO}"
        )


def _check_strides(name: str, t: torch.Tensor, dims: range, multiple: int) -> None:
    for d in dims:
        if t.stride(d) % multiple:
            raise ValueError(
                f"{name}.stride({d}) is {t.stride(d)}; accepted: a multiple of "
                f"{multiple} elements"
            )


def _check_on_device(device: torch.device, **tensors: torch.Tensor) -> None:
    """Each keyword's value is a tensor on the workspace's ``device``."""
    for name, t in tensors.items():
        _check_tensor(name, t)
        if t.device != device:
            raise ValueError(
                f"{name} is on {t.device}; expected the workspace's device {device}"
            )


def _check_paged_cache(
    key_cache: torch.Tensor, value_cache: torch.Tensor
) -> tuple[int, int, int, bool]:
    """A K/V cache pair as the attention kernels read it (strided views whose
    rows TMA copies: 16-byte strides and alignment); returns (block_size,
    num_kv_heads, head_size, whether it is FP8)."""
    block_size, num_kv_heads, head_size = _check_cache_pair(
        key_cache, value_cache, _DECODE_KV_DTYPES
    )
    kv_bytes = key_cache.element_size()
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.stride(3) != 1:
            raise ValueError(
                f"{name} must be contiguous in head_size, got strides {cache.stride()}"
            )
        _check_strides(name, cache, range(3), 16 // kv_bytes)
        _check_aligned(name, cache)
    return block_size, num_kv_heads, head_size, key_cache.dtype == torch.float8_e4m3fn


def _check_query(
    q: torch.Tensor,
    cache_dtype: torch.dtype,
    num_kv_heads: int,
    head_size: int,
    q_stride_multiple: int,
) -> tuple[int, int]:
    """Queries of the cache's 16-bit dtype, or bf16/fp16/FP8 over an FP8
    cache; returns (tokens, num_q_heads). ``q_stride_multiple``: what q's
    strides must be a multiple of, in elements."""
    _check_ndim("q", q, 3, "[tokens, num_q_heads, head_size]")
    q_dtypes = (
        (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
        if cache_dtype == torch.float8_e4m3fn
        else (cache_dtype,)
    )
    _check_dtype("q", q, q_dtypes)
    tokens, num_q_heads, q_head_size = q.shape
    if q_head_size != head_size:
        raise ValueError(
            f"q head size {q_head_size} must equal the cache's {head_size}"
        )
    _check_gqa(num_q_heads, num_kv_heads)
    if q.stride(2) != 1:
        raise ValueError(f"q must be contiguous in head_size, got strides {q.stride()}")
    _check_strides("q", q, range(2), q_stride_multiple)
    return tokens, num_q_heads


def _check_output(q: torch.Tensor, out: torch.Tensor) -> None:
    """A bf16/fp16 output of q's shape, 16-byte aligned rows."""
    if out.shape != q.shape:
        raise ValueError(
            f"out shape {tuple(out.shape)} must equal q's {tuple(q.shape)}"
        )
    _check_dtype("out", out, _ACTIVATION_DTYPES)
    if out.stride(2) != 1:
        raise ValueError(
            f"out must be contiguous in head_size, got strides {out.stride()}"
        )
    _check_strides("out", out, range(2), 8)
    _check_aligned("out", out)


def _check_scalar_scale(name: str, t: torch.Tensor, device: torch.device) -> None:
    _check_tensor(name, t)
    _check_dtype(name, t, (torch.float32,))
    if t.numel() != 1:
        raise ValueError(
            f"{name} must be a float32 tensor with one element, got shape "
            f"{tuple(t.shape)}"
        )
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}; expected {device}")


def _check_attention_scales(
    q: torch.Tensor,
    q_scale: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    fp8_kv: bool,
) -> None:
    """Per-token-per-head scales with FP8 queries (none otherwise), and the
    per-tensor K/V scales an FP8 cache needs."""
    tokens, num_q_heads = q.shape[0], q.shape[1]
    if q.dtype == torch.float8_e4m3fn:
        if q_scale is None:
            raise ValueError(
                "q_scale is required for FP8 queries: float32 [tokens, num_q_heads]"
            )
        _check_tensor("q_scale", q_scale)
        _check_dtype("q_scale", q_scale, (torch.float32,))
        if q_scale.shape != (tokens, num_q_heads) or q_scale.stride(1) != 1:
            raise ValueError(
                f"q_scale must be [tokens, num_q_heads] = {(tokens, num_q_heads)} "
                f"with unit stride in dim 1, got shape {tuple(q_scale.shape)} "
                f"strides {q_scale.stride()}"
            )
        if q_scale.device != q.device:
            raise ValueError(f"q_scale is on {q_scale.device}; expected {q.device}")
    elif q_scale is not None:
        raise ValueError("q_scale is only accepted with FP8 (float8_e4m3fn) queries")
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t is not None:
            _check_scalar_scale(name, t, q.device)
        elif fp8_kv:
            raise ValueError(
                f"{name} is required with an FP8 KV cache: a float32 tensor with "
                "one element"
            )


def _check_block_table(block_table: torch.Tensor, batch: int) -> None:
    _check_ndim("block_table", block_table, 2, "[batch, max_blocks]")
    _check_dtype("block_table", block_table, (torch.int32,))
    if block_table.shape[0] < batch or block_table.stride(1) != 1:
        raise ValueError(
            f"block_table must have >= {batch} rows and unit stride in dim 1, "
            f"got shape {tuple(block_table.shape)} strides {block_table.stride()}"
        )


def _check_softmax_args(scale: float, softcap: float) -> None:
    if not math.isfinite(scale) or not scale > 0.0:
        raise ValueError(f"scale is {scale}; accepted: a finite positive float")
    if not math.isfinite(softcap) or not softcap >= 0.0:
        raise ValueError(
            f"softcap is {softcap}; accepted: 0 (none) or a finite positive float"
        )


def _validate_decode(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_lens: torch.Tensor,
    out: torch.Tensor,
    workspace: DecodeWorkspace,
    query_tokens: int,
    q_scale: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    scale: float,
    softcap: float,
) -> None:
    device = _check_workspace(
        workspace,
        _DECODE_WORKSPACE,
        "decode_attention",
        plan_buffer=torch.int32,
        partial_out=torch.float32,
        partial_lse=torch.float32,
        piece_counters=torch.int32,
    )
    _check_on_device(
        device,
        q=q,
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=block_table,
        kv_lens=kv_lens,
        out=out,
    )
    _, num_kv_heads, head_size, fp8_kv = _check_paged_cache(key_cache, value_cache)
    tokens, num_q_heads = _check_query(q, key_cache.dtype, num_kv_heads, head_size, 4)
    _check_query_tokens(query_tokens, num_q_heads // num_kv_heads)
    batch = kv_lens.shape[0] if kv_lens.dim() == 1 else -1
    _check_ndim("kv_lens", kv_lens, 1, "[batch]")
    _check_dtype("kv_lens", kv_lens, (torch.int32,))
    _check_contiguous("kv_lens", kv_lens)
    if tokens != batch * query_tokens:
        raise ValueError(
            f"q has {tokens} tokens; expected batch ({batch}) x query_tokens "
            f"({query_tokens})"
        )
    if (
        batch > workspace.max_batch
        or num_kv_heads != workspace.num_kv_heads
        or num_q_heads != workspace.num_q_heads
        or head_size != workspace.head_size
        or query_tokens > workspace.max_query_tokens
    ):
        raise ValueError(
            f"workspace was sized for max_batch={workspace.max_batch}, "
            f"heads={workspace.num_q_heads}/{workspace.num_kv_heads}, "
            f"head_size={workspace.head_size}, max_query_tokens="
            f"{workspace.max_query_tokens}; got batch={batch}, heads="
            f"{num_q_heads}/{num_kv_heads}, head_size={head_size}, "
            f"query_tokens={query_tokens}"
        )
    _check_block_table(block_table, batch)
    _check_output(q, out)
    _check_attention_scales(q, q_scale, k_scale, v_scale, fp8_kv)
    _check_softmax_args(scale, softcap)


def decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_lens: torch.Tensor,
    out: torch.Tensor,
    workspace: DecodeWorkspace,
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
    _validate_decode(
        q,
        key_cache,
        value_cache,
        block_table,
        kv_lens,
        out,
        workspace,
        query_tokens,
        q_scale,
        k_scale,
        v_scale,
        scale,
        softcap,
    )
    _require_library()
    decode_attention_unchecked(
        q,
        key_cache,
        value_cache,
        block_table,
        kv_lens,
        out,
        workspace,
        scale=scale,
        query_tokens=query_tokens,
        q_scale=q_scale,
        k_scale=k_scale,
        v_scale=v_scale,
        softcap=softcap,
    )


def decode_attention_unchecked(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_lens: torch.Tensor,
    out: torch.Tensor,
    workspace: DecodeWorkspace,
    *,
    scale: float,
    query_tokens: int = 1,
    q_scale: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> None:
    """:func:`decode_attention` without argument validation, for callers
    that validated their configuration once (the attention backend's hot
    path). Same arguments and semantics; the C++ adapter still checks memory
    safety."""
    torch.ops._hpc_C.decode_attention(
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
        workspace.window,
        query_tokens,
        workspace.max_units,
        workspace.max_ctas,
    )


# ---------------------------------------------------------------------------
# Paged prefill: tile planner and prefill / chunked-prefill attention
# ---------------------------------------------------------------------------

_PREFILL_WORKSPACE = f"PrefillWorkspace ({_ATTN_WORKSPACES})"


def _check_lengths(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, device: torch.device
) -> int:
    """query_start_loc int32 [batch + 1] and seq_lens int32 [batch], 1-D and
    contiguous on `device`; returns batch."""
    for name, t, layout in (
        ("query_start_loc", query_start_loc, "[batch + 1]"),
        ("seq_lens", seq_lens, "[batch]"),
    ):
        _check_tensor(name, t)
        _check_ndim(name, t, 1, layout)
        _check_dtype(name, t, (torch.int32,))
        if t.device != device:
            raise ValueError(
                f"{name} is on {t.device}; expected the workspace's device {device}"
            )
        _check_contiguous(name, t)
    batch = seq_lens.shape[0]
    if query_start_loc.shape[0] != batch + 1:
        raise ValueError(
            f"query_start_loc has {query_start_loc.shape[0]} entries; expected "
            f"batch + 1 = {batch + 1} (seq_lens has {batch})"
        )
    return batch


def _validate_prefill(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    workspace: PrefillWorkspace,
    scale: float,
    q_scale: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    softcap: float,
    window: int,
) -> None:
    device = _check_workspace(
        workspace, _PREFILL_WORKSPACE, "prefill_attention", plan_buffer=torch.int32
    )
    _check_on_device(
        device,
        q=q,
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=block_table,
        out=out,
    )
    # The cache pair defines the heads, head size and block size.
    _, num_kv_heads, head_size, fp8_kv = _check_paged_cache(key_cache, value_cache)
    # Queries: read by TMA, so 16-byte aligned rows.
    tokens, num_q_heads = _check_query(
        q, key_cache.dtype, num_kv_heads, head_size, 16 // q.element_size()
    )
    _check_aligned("q", q)
    _check_output(q, out)
    _check_attention_scales(q, q_scale, k_scale, v_scale, fp8_kv)

    batch = _check_lengths(query_start_loc, seq_lens, device)
    _check_block_table(block_table, batch)

    if (
        tokens > workspace.max_tokens
        or batch > workspace.max_batch
        or num_q_heads != workspace.num_q_heads
        or num_kv_heads != workspace.num_kv_heads
    ):
        raise ValueError(
            f"workspace was sized for max_tokens={workspace.max_tokens}, "
            f"max_batch={workspace.max_batch}, heads={workspace.num_q_heads}/"
            f"{workspace.num_kv_heads}; got tokens={tokens}, batch={batch}, "
            f"heads={num_q_heads}/{num_kv_heads}"
        )

    _check_softmax_args(scale, softcap)
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window is {window!r}; accepted: 0 (none) or a positive int")


def prefill_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    workspace: PrefillWorkspace,
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
    _validate_prefill(
        q,
        key_cache,
        value_cache,
        block_table,
        query_start_loc,
        seq_lens,
        out,
        workspace,
        scale,
        q_scale,
        k_scale,
        v_scale,
        softcap,
        window,
    )
    _require_library()
    prefill_attention_unchecked(
        q,
        key_cache,
        value_cache,
        block_table,
        query_start_loc,
        seq_lens,
        out,
        workspace,
        scale=scale,
        q_scale=q_scale,
        k_scale=k_scale,
        v_scale=v_scale,
        softcap=softcap,
        window=window,
    )


def prefill_attention_unchecked(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    workspace: PrefillWorkspace,
    *,
    scale: float,
    q_scale: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    softcap: float = 0.0,
    window: int = 0,
) -> None:
    """:func:`prefill_attention` without argument validation, for callers
    that validated their configuration once (the attention backend's hot
    path). Same arguments and semantics; the C++ adapter still checks memory
    safety."""
    torch.ops._hpc_C.prefill_attention(
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

MOE_BLOCK_SHAPE = (128, 128)
MOE_MAX_TOPK = 16
# hidden_size must be a multiple of this; intermediate_size of
# _MOE_INTERMEDIATE_ALIGN (per-tensor) or of the block (block-wise).
_MOE_HIDDEN_ALIGN = 128
_MOE_INTERMEDIATE_ALIGN = 64
_MOE_FP8 = torch.float8_e4m3fn
_MOE_HIDDEN_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
_MOE_WORKSPACE = "MoeWorkspace (vllm/model_executor/layers/fused_moe/hpc_moe.py)"


def _check_moe_dims(hidden_size: int, intermediate_size: int, block_wise: bool) -> None:
    if hidden_size < 1 or hidden_size % _MOE_HIDDEN_ALIGN:
        raise ValueError(
            f"hidden_size is {hidden_size}; accepted: a positive multiple of "
            f"{_MOE_HIDDEN_ALIGN}"
        )
    align = MOE_BLOCK_SHAPE[0] if block_wise else _MOE_INTERMEDIATE_ALIGN
    if intermediate_size < 1 or intermediate_size % align:
        mode = "block-wise" if block_wise else "per-tensor"
        raise ValueError(
            f"intermediate_size is {intermediate_size}; accepted ({mode}): a "
            f"positive multiple of {align}"
        )


def _check_topk(topk: int, name: str = "topk") -> None:
    if not 1 <= topk <= MOE_MAX_TOPK:
        raise ValueError(f"{name} is {topk}; accepted: 1..{MOE_MAX_TOPK}")


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
    _check_positive(max_tokens=max_tokens, num_local_experts=num_local_experts)
    _check_topk(topk)
    # The per-tensor alignment is the weaker one; block-wise calls check
    # theirs when they run.
    _check_moe_dims(hidden_size, intermediate_size, block_wise=False)
    _require_library()
    return int(
        torch.ops._hpc_C.moe_workspace_bytes(
            max_tokens, topk, num_local_experts, hidden_size, intermediate_size
        )
    )


def _check_rows(name: str, t: torch.Tensor, shape: tuple[int, int]) -> None:
    """A [rows, cols] activation: unit column stride, rows that start on
    16-byte boundaries (a row stride of 16 bytes' worth of elements: 8 for
    16-bit, 16 for FP8) and do not overlap."""
    _check_ndim(name, t, 2, "[num_tokens, hidden_size]")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} shape {tuple(t.shape)} must be {shape}")
    rows, cols = shape
    if t.stride(1) != 1:
        raise ValueError(f"{name} must have a unit stride in dim 1, got {t.stride()}")
    multiple = 16 // t.element_size()
    if rows > 1 and (t.stride(0) % multiple or t.stride(0) < cols):
        raise ValueError(
            f"{name}.stride(0) is {t.stride(0)}; accepted: a multiple of "
            f"{multiple} elements (16 bytes), at least hidden_size = {cols}"
        )
    _check_aligned(name, t)


def _check_scale_scalar(name: str, t: torch.Tensor) -> None:
    _check_tensor(name, t)
    if t.dtype != torch.float32 or t.numel() != 1 or t.dim() > 1:
        raise ValueError(
            f"{name} must be a float32 tensor with one element (0-d or [1]), got "
            f"shape {tuple(t.shape)} dtype {t.dtype}"
        )


def _check_scale_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    _check_tensor(name, t)
    _check_dtype(name, t, (torch.float32,))
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} shape {tuple(t.shape)} must be {shape}")
    _check_contiguous(name, t)


def _validate_moe(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    out: torch.Tensor,
    workspace: MoeWorkspace,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    a1_scale: torch.Tensor | None,
    a2_scale: torch.Tensor | None,
    block_shape: tuple[int, int] | list[int] | None,
    expert_map: torch.Tensor | None,
    expert_offset: int,
    shared_output: torch.Tensor | None,
    apply_router_weight_on_input: bool,
) -> bool:
    """Checks every argument of :func:`fused_moe_fp8`; returns whether the
    call is block-wise."""
    device = _check_workspace(
        workspace, _MOE_WORKSPACE, "fused_moe_fp8", buffer=torch.uint8
    )
    _check_ndim("workspace.buffer", workspace.buffer, 1, "[bytes]")
    for name, t in (
        ("hidden_states", hidden_states),
        ("w13", w13),
        ("w2", w2),
        ("topk_weights", topk_weights),
        ("topk_ids", topk_ids),
        ("out", out),
        ("w13_scale", w13_scale),
        ("w2_scale", w2_scale),
    ):
        _check_tensor(name, t)

    if block_shape is None:
        block_wise = False
    else:
        try:
            shape = tuple(int(b) for b in block_shape)
        except (TypeError, ValueError):
            shape = None
        if shape != MOE_BLOCK_SHAPE:
            raise ValueError(
                f"block_shape is {block_shape!r}; accepted: None (per-tensor) or "
                f"{MOE_BLOCK_SHAPE} (block-wise)"
            )
        block_wise = True

    # Weights define E_local, H and I.
    _check_ndim("w13", w13, 3, "[num_local_experts, 2 * intermediate_size, hidden]")
    _check_ndim("w2", w2, 3, "[num_local_experts, hidden_size, intermediate_size]")
    _check_dtype("w13", w13, (_MOE_FP8,))
    _check_dtype("w2", w2, (_MOE_FP8,))
    num_experts, two_i, hidden_size = w13.shape
    if two_i % 2:
        raise ValueError(
            f"w13.shape[1] is {two_i}; expected 2 * intermediate_size (gate "
            "rows, then up rows)"
        )
    inter = two_i // 2
    if tuple(w2.shape) != (num_experts, hidden_size, inter):
        raise ValueError(
            f"w2 shape {tuple(w2.shape)} must be [num_local_experts, hidden_size, "
            f"intermediate_size] = {(num_experts, hidden_size, inter)} to match w13"
        )
    if num_experts < 1:
        raise ValueError("w13 has no experts; accepted: num_local_experts >= 1")
    _check_moe_dims(hidden_size, inter, block_wise)
    _check_contiguous("w13", w13)
    _check_contiguous("w2", w2)

    # Activations and routing.
    _check_ndim("hidden_states", hidden_states, 2, "[num_tokens, hidden_size]")
    _check_dtype("hidden_states", hidden_states, _MOE_HIDDEN_DTYPES)
    num_tokens = hidden_states.shape[0]
    _check_rows("hidden_states", hidden_states, (num_tokens, hidden_size))
    _check_dtype("out", out, _ACTIVATION_DTYPES)
    _check_rows("out", out, (num_tokens, hidden_size))
    _check_ndim("topk_ids", topk_ids, 2, "[num_tokens, topk]")
    _check_dtype("topk_ids", topk_ids, _INDEX_DTYPES)
    topk = topk_ids.shape[1]
    if topk_ids.shape[0] != num_tokens:
        raise ValueError(
            f"topk_ids shape {tuple(topk_ids.shape)} must be [num_tokens, topk] "
            f"with num_tokens = {num_tokens}"
        )
    _check_topk(topk, "topk (topk_ids.shape[1])")
    _check_contiguous("topk_ids", topk_ids)
    _check_ndim("topk_weights", topk_weights, 2, "[num_tokens, topk]")
    _check_dtype("topk_weights", topk_weights, (torch.float32,))
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights shape {tuple(topk_weights.shape)} must equal topk_ids "
            f"shape {tuple(topk_ids.shape)}"
        )
    _check_contiguous("topk_weights", topk_weights)
    if apply_router_weight_on_input and topk != 1:
        raise ValueError(
            f"apply_router_weight_on_input needs topk == 1, got topk = {topk}"
        )
    if shared_output is not None:
        _check_tensor("shared_output", shared_output)
        if shared_output.dtype != out.dtype:
            raise ValueError(
                f"shared_output dtype {shared_output.dtype} must equal out dtype "
                f"{out.dtype}"
            )
        _check_rows("shared_output", shared_output, (num_tokens, hidden_size))

    # Scales.
    fp8_input = hidden_states.dtype == _MOE_FP8
    h_blocks = hidden_size // MOE_BLOCK_SHAPE[1]
    if block_wise:
        i_blocks = inter // MOE_BLOCK_SHAPE[0]
        _check_scale_shape(
            "w13_scale", w13_scale, (num_experts, 2 * i_blocks, h_blocks)
        )
        _check_scale_shape("w2_scale", w2_scale, (num_experts, h_blocks, i_blocks))
        if fp8_input:
            if a1_scale is None:
                raise ValueError(
                    "a1_scale is required with float8_e4m3fn hidden_states: "
                    f"float32 [num_tokens, hidden_size / 128] = "
                    f"{(num_tokens, h_blocks)}"
                )
            _check_scale_shape("a1_scale", a1_scale, (num_tokens, h_blocks))
        elif a1_scale is not None:
            raise ValueError(
                "a1_scale must be None with 16-bit hidden_states in block-wise "
                "mode (they are quantized per 1x128 group inside)"
            )
        if a2_scale is not None:
            raise ValueError(
                "a2_scale must be None in block-wise mode (the intermediate is "
                "quantized per 1x128 group inside)"
            )
    else:
        _check_scale_shape("w13_scale", w13_scale, (num_experts,))
        _check_scale_shape("w2_scale", w2_scale, (num_experts,))
        if a1_scale is not None:
            _check_scale_scalar("a1_scale", a1_scale)
        elif fp8_input:
            raise ValueError(
                "a1_scale is required with float8_e4m3fn hidden_states: a float32 "
                "tensor with one element"
            )
        if a2_scale is None:
            raise ValueError(
                "a2_scale is required in per-tensor mode: a float32 tensor with "
                "one element (the static scale of the intermediate)"
            )
        _check_scale_scalar("a2_scale", a2_scale)

    # Expert placement.
    if expert_map is not None:
        _check_tensor("expert_map", expert_map)
        _check_ndim("expert_map", expert_map, 1, "[global_num_experts]")
        _check_dtype("expert_map", expert_map, (torch.int32,))
        _check_contiguous("expert_map", expert_map)
        if expert_offset != 0:
            raise ValueError(
                f"expert_offset is {expert_offset}; it must be 0 when expert_map "
                "is given (the map alone places the experts)"
            )
    elif expert_offset < 0:
        raise ValueError(f"expert_offset is {expert_offset}; accepted: >= 0")

    # The workspace.
    if (
        num_tokens > workspace.max_tokens
        or topk != workspace.topk
        or num_experts != workspace.num_local_experts
        or hidden_size != workspace.hidden_size
        or inter != workspace.intermediate_size
    ):
        raise ValueError(
            f"workspace was sized for max_tokens={workspace.max_tokens}, "
            f"topk={workspace.topk}, num_local_experts="
            f"{workspace.num_local_experts}, hidden_size={workspace.hidden_size}, "
            f"intermediate_size={workspace.intermediate_size}; got num_tokens="
            f"{num_tokens}, topk={topk}, num_local_experts={num_experts}, "
            f"hidden_size={hidden_size}, intermediate_size={inter}"
        )

    # One CUDA device (meta while tracing), the workspace's.
    on_device: tuple[tuple[str, torch.Tensor | None], ...] = (
        ("hidden_states", hidden_states),
        ("w13", w13),
        ("w2", w2),
        ("topk_weights", topk_weights),
        ("topk_ids", topk_ids),
        ("out", out),
        ("w13_scale", w13_scale),
        ("w2_scale", w2_scale),
        ("a1_scale", a1_scale),
        ("a2_scale", a2_scale),
        ("expert_map", expert_map),
        ("shared_output", shared_output),
    )
    for name, tensor in on_device:
        if tensor is not None and tensor.device != device:
            raise ValueError(
                f"{name} is on {tensor.device}; expected the workspace's device "
                f"{device}"
            )
    return block_wise


def fused_moe_fp8(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    out: torch.Tensor,
    workspace: MoeWorkspace,
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
    _validate_moe(
        hidden_states,
        w13,
        w2,
        topk_weights,
        topk_ids,
        out,
        workspace,
        w13_scale,
        w2_scale,
        a1_scale,
        a2_scale,
        block_shape,
        expert_map,
        int(expert_offset),
        shared_output,
        bool(apply_router_weight_on_input),
    )
    num_local_experts = w13.shape[0]
    total_experts = global_num_experts
    if total_experts is None:
        total_experts = (
            expert_map.shape[0] if expert_map is not None else num_local_experts
        )
    if total_experts < num_local_experts:
        raise ValueError(
            f"global_num_experts ({total_experts}) must be >= the local "
            f"expert count ({num_local_experts})"
        )
    _require_library()
    fused_moe_fp8_unchecked(
        hidden_states,
        w13,
        w2,
        topk_weights,
        topk_ids,
        out,
        workspace,
        w13_scale=w13_scale,
        w2_scale=w2_scale,
        a1_scale=a1_scale,
        a2_scale=a2_scale,
        block_shape=block_shape,
        expert_map=expert_map,
        expert_offset=expert_offset,
        shared_output=shared_output,
        apply_router_weight_on_input=apply_router_weight_on_input,
        global_num_experts=global_num_experts,
    )


def fused_moe_fp8_unchecked(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    out: torch.Tensor,
    workspace: MoeWorkspace,
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
    """:func:`fused_moe_fp8` without the input checks, for callers that
    validated their configuration once (the vLLM layer, on the hot path)."""
    if hidden_states.shape[0] == 0:
        return
    if global_num_experts is None:
        global_num_experts = (
            expert_map.shape[0] if expert_map is not None else w13.shape[0]
        )
    torch.ops._hpc_C.fused_moe_fp8(
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

    token_tile: int  # tokens per GEMM tile (the wgmma N side): 8..128
    max_tiles: int  # token tiles over all local experts, at most
    gate_up_blocks: int  # 128-column blocks of the intermediate
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
    _check_positive(
        num_tokens=num_tokens, num_local_experts=num_local_experts, num_sms=num_sms
    )
    _check_topk(topk)
    if num_experts < num_local_experts:
        raise ValueError(
            f"num_experts ({num_experts}) must be >= num_local_experts "
            f"({num_local_experts})"
        )
    _check_moe_dims(hidden_size, intermediate_size, block_wise=block_wise)
    _require_library()
    values = list(
        torch.ops._hpc_C.moe_tiling(
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
    fields = dict(zip(torch.ops._hpc_C.moe_tiling_fields(), values, strict=True))
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
        window: int,
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
