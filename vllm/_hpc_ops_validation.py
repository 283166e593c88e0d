# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Argument validation of the ``_hpc_C`` ops (``vllm._hpc_ops``).

One ``validate_<op>`` per op of ``vllm._hpc_ops``, and one per workspace
method that sizes or plans: each checks every input (tensor type, device,
dtype, shape, strides, alignment, ranges, the workspace's sizes) and raises
``ValueError`` naming the argument and the accepted values. Tests, workspace
creation and direct callers of the ops run them; the vLLM layers check their
configuration once, at selection and construction, and call the ops
unchecked on the hot path.

A parameter list is written once. ``validate_<op>`` takes the op's
arguments, with the op's signature, and its checks read them by name
(``args.q``); the workspaces' ``create`` methods are decorated with their
validators (:func:`validated_by`), which read the method's arguments the
same way.

Imports torch and the op module only, so it works wherever the op layer
does.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, ParamSpec, TypeVar

import torch

from vllm import _hpc_ops as ops
from vllm._hpc_ops import (
    DECODE_TILE_TOKENS,
    MAX_DECODE_QUERY_TOKENS,
    MAX_DECODE_ROWS,
    MAX_GQA_RATIO,
    MOE_BLOCK_SHAPE,
    MOE_HIDDEN_ALIGN,
    MOE_INTERMEDIATE_ALIGN,
    MOE_MAX_TOPK,
    PREFILL_MAX_KV_HEADS,
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_HEAD_SIZES,
    DecodeWorkspaceLike,
    PrefillWorkspaceLike,
    QkNormPolicy,
    SplitMode,
)

__all__ = [
    "validate_decode_attention",
    "validate_decode_plan",
    "validate_decode_workspace",
    "validate_fused_moe_fp8",
    "validate_moe_tiling",
    "validate_moe_workspace",
    "validate_prefill_attention",
    "validate_prefill_plan",
    "validate_prefill_workspace",
    "validate_query_tokens",
    "validate_rope_norm_store_kv",
    "validate_split_mode",
    "validated_by",
]

_ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)
_INDEX_DTYPES = (torch.int32, torch.int64)
_DECODE_KV_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
_MOE_FP8 = torch.float8_e4m3fn
_MOE_HIDDEN_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
# Where the kernels' tensors may live: CUDA, or meta while tracing.
_KERNEL_DEVICES = ("cuda", "meta")
_INT32_MAX = 2**31 - 1
# Where the workspaces live, for the messages that name them.
_ATTN_WORKSPACES = "vllm/v1/attention/ops/hpc_attn_workspace.py"
_DECODE_WORKSPACE = f"DecodeWorkspace ({_ATTN_WORKSPACES})"
_PREFILL_WORKSPACE = f"PrefillWorkspace ({_ATTN_WORKSPACES})"
_MOE_WORKSPACE = "MoeWorkspace (vllm/model_executor/layers/fused_moe/hpc_moe.py)"


_P = ParamSpec("_P")
_R = TypeVar("_R")


# ---------------------------------------------------------------------------
# Arguments by name: a validator states no signature of its own
# ---------------------------------------------------------------------------


def _bind(
    signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> SimpleNamespace:
    """A call's arguments by name, defaults filled in (a call that does not
    fit the signature raises TypeError, as the function itself would)."""
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return SimpleNamespace(**bound.arguments)


def _validator_of(
    op: Callable[_P, Any],
) -> Callable[[Callable[[SimpleNamespace], None]], Callable[_P, None]]:
    """Makes the decorated check the validator of ``op``: it is called with
    ``op``'s arguments (``op``'s signature is its signature) and reads them
    by name, so the two never disagree."""
    signature = inspect.signature(op)

    def decorate(check: Callable[[SimpleNamespace], None]) -> Callable[_P, None]:
        def validate(*args: _P.args, **kwargs: _P.kwargs) -> None:
            check(_bind(signature, args, kwargs))

        functools.update_wrapper(validate, check)
        validate.__signature__ = signature  # type: ignore[attr-defined]
        return validate

    return decorate


def validated_by(
    check: Callable[[SimpleNamespace], object],
) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Decorates a function so that each call first hands its arguments, by
    name and with defaults filled in, to ``check`` (the workspaces' ``create``
    methods are decorated with their validators)."""

    def decorate(fn: Callable[_P, _R]) -> Callable[_P, _R]:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def checked(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            check(_bind(signature, args, kwargs))
            return fn(*args, **kwargs)

        return checked

    return decorate


# ---------------------------------------------------------------------------
# Shared checks: each raises ValueError naming the argument.
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
# rope_norm_store_kv
# ---------------------------------------------------------------------------


@_validator_of(ops.rope_norm_store_kv)
def validate_rope_norm_store_kv(args: SimpleNamespace) -> None:
    """Checks the arguments of ``vllm._hpc_ops.rope_norm_store_kv``."""
    for name in (
        "qkv",
        "positions",
        "slot_mapping",
        "cos_sin_cache",
        "key_cache",
        "value_cache",
        "q_out",
    ):
        t = getattr(args, name)
        _check_tensor(name, t)

    _check_ndim("qkv", args.qkv, 2, "[num_tokens, (Hq + 2 * Hkv) * head_size]")
    _check_dtype("qkv", args.qkv, _ACTIVATION_DTYPES)
    if args.qkv.stride(-1) != 1:
        raise ValueError(
            f"qkv must have a unit last-dim stride, got {args.qkv.stride()}"
        )
    device = args.qkv.device
    num_tokens = args.qkv.shape[0]

    block_size, num_kv_heads, head_size = _check_cache_pair(
        args.key_cache, args.value_cache, (*_ACTIVATION_DTYPES, torch.float8_e4m3fn)
    )
    for name, t in (("key_cache", args.key_cache), ("value_cache", args.value_cache)):
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
    if args.key_cache.stride() != args.value_cache.stride():
        raise ValueError(
            f"value_cache strides {args.value_cache.stride()} must equal key_cache "
            f"strides {args.key_cache.stride()}"
        )
    cache_is_fp8 = args.key_cache.dtype == torch.float8_e4m3fn
    if cache_is_fp8:
        for name, scale in (("k_scale", args.k_scale), ("v_scale", args.v_scale)):
            if scale is None:
                raise ValueError(f"{name} is required when the KV cache is FP8")
            _check_tensor(name, scale)
            if scale.numel() != 1 or scale.dtype != torch.float32:
                raise ValueError(
                    f"{name} must be a float32 tensor with one element, got "
                    f"shape {tuple(scale.shape)} dtype {scale.dtype}"
                )
            _check_device(name, scale, device)
    elif args.key_cache.dtype != args.qkv.dtype:
        raise ValueError(
            f"key_cache dtype {args.key_cache.dtype} must equal qkv dtype "
            f"{args.qkv.dtype} or be float8_e4m3fn"
        )

    _check_ndim("q_out", args.q_out, 3, "[num_tokens, Hq, head_size]")
    num_q_heads = args.q_out.shape[1]
    if args.q_out.shape[0] != num_tokens or args.q_out.shape[2] != head_size:
        raise ValueError(
            f"q_out shape {tuple(args.q_out.shape)} must be "
            f"[{num_tokens}, Hq, {head_size}]"
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
    if args.qkv.shape[1] != expected_width:
        raise ValueError(
            f"qkv.shape[1] is {args.qkv.shape[1]}; expected (Hq + 2 * Hkv) * head_size "
            f"= ({num_q_heads} + 2 * {num_kv_heads}) * {head_size} = "
            f"{expected_width}"
        )
    if args.qkv.stride(0) % 8 != 0:
        raise ValueError(f"qkv row stride {args.qkv.stride(0)} must be a multiple of 8")
    _check_dtype("q_out", args.q_out, (args.qkv.dtype, torch.float8_e4m3fn))
    _check_device("q_out", args.q_out, device)
    _check_contiguous("q_out", args.q_out)
    if args.q_out.dtype == torch.float8_e4m3fn:
        if args.q_scale is None:
            raise ValueError("q_scale is required when q_out is float8_e4m3fn")
        _check_tensor("q_scale", args.q_scale)
        if (
            args.q_scale.dtype != torch.float32
            or args.q_scale.dim() != 2
            or args.q_scale.shape[0] < num_tokens
            or args.q_scale.shape[1] != num_q_heads
        ):
            raise ValueError(
                f"q_scale must be float32 [>= {num_tokens}, {num_q_heads}], got "
                f"shape {tuple(args.q_scale.shape)} dtype {args.q_scale.dtype}"
            )
        _check_device("q_scale", args.q_scale, device)
        _check_contiguous("q_scale", args.q_scale)
    elif args.q_scale is not None:
        raise ValueError("q_scale must be None unless q_out is float8_e4m3fn")

    for name, t in (("positions", args.positions), ("slot_mapping", args.slot_mapping)):
        _check_ndim(name, t, 1, "[num_tokens]")
        _check_dtype(name, t, _INDEX_DTYPES)
        _check_device(name, t, device)
        _check_contiguous(name, t)
        if t.shape[0] < num_tokens:
            raise ValueError(
                f"{name} has {t.shape[0]} entries; needs at least num_tokens = "
                f"{num_tokens}"
            )

    _check_ndim("cos_sin_cache", args.cos_sin_cache, 2, "[max_position, rotary_dim]")
    _check_dtype("cos_sin_cache", args.cos_sin_cache, (torch.float32, args.qkv.dtype))
    _check_device("cos_sin_cache", args.cos_sin_cache, device)
    _check_contiguous("cos_sin_cache", args.cos_sin_cache)
    rotary_dim = args.cos_sin_cache.shape[1]
    if rotary_dim % 16 != 0 or not 16 <= rotary_dim <= head_size:
        raise ValueError(
            f"rotary_dim (cos_sin_cache.shape[1]) is {rotary_dim}; accepted: a "
            f"multiple of 16 in [16, head_size = {head_size}]"
        )

    for name in ("qkv", "key_cache", "value_cache", "q_out", "cos_sin_cache"):
        t = getattr(args, name)
        _check_aligned(name, t)

    try:
        policy = QkNormPolicy(args.norm_policy)
    except ValueError:
        raise ValueError(
            f"norm_policy is {args.norm_policy!r}; accepted: "
            f"{[int(p) for p in QkNormPolicy]} ({', '.join(QkNormPolicy.__members__)})"
        ) from None
    if policy != QkNormPolicy.NONE:
        for name in ("q_norm_weight", "k_norm_weight"):
            w = getattr(args, name)
            if w is None:
                raise ValueError(
                    f"{name} is required when norm_policy is {policy.name}"
                )
            _check_tensor(name, w)
            if w.shape != (head_size,):
                raise ValueError(
                    f"{name} must have shape ({head_size},), got {tuple(w.shape)}"
                )
            _check_dtype(name, w, (torch.float32, args.qkv.dtype))
            _check_device(name, w, device)
            _check_contiguous(name, w)
            _check_aligned(name, w)
        assert args.q_norm_weight is not None and args.k_norm_weight is not None
        if args.q_norm_weight.dtype != args.k_norm_weight.dtype:
            raise ValueError(
                f"q_norm_weight dtype {args.q_norm_weight.dtype} must equal "
                f"k_norm_weight dtype {args.k_norm_weight.dtype}"
            )
        if not args.eps > 0.0:
            raise ValueError(f"eps must be positive, got {args.eps}")


# ---------------------------------------------------------------------------
# Split-KV decode: the workspace, its plan and decode_attention
# ---------------------------------------------------------------------------


def _check_split_len(name: str, value: int) -> None:
    if value < 0 or value % DECODE_TILE_TOKENS:
        raise ValueError(
            f"{name} is {value}; accepted: a non-negative multiple of "
            f"{DECODE_TILE_TOKENS}"
        )


def validate_query_tokens(query_tokens: int, group: int | None = None) -> None:
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


# What each attention op reads of its workspace (fields and their dtypes),
# and which of its tensor arguments are checked to be on the workspace's
# device first (the lengths of prefill and the scales come later).
_DECODE_READS = {
    "plan_buffer": torch.int32,
    "partial_out": torch.float32,
    "partial_lse": torch.float32,
    "piece_counters": torch.int32,
}
_DECODE_TENSORS = ("q", "key_cache", "value_cache", "block_table", "kv_lens", "out")
_PREFILL_READS = {"plan_buffer": torch.int32}
_PREFILL_TENSORS = ("q", "key_cache", "value_cache", "block_table", "out")


def _check_attention_call(
    op: str,
    args: SimpleNamespace,
    kind: str,
    reads: dict[str, torch.dtype],
    tensors: tuple[str, ...],
) -> tuple[torch.device, int, int, bool]:
    """What the arguments of the attention ``op`` share: the workspace (a
    ``kind``) with the fields ``reads`` lists, the ``tensors`` on its
    device, and the paged K/V cache; returns (the device, num_kv_heads,
    head_size, whether the cache is FP8)."""
    device = _check_workspace(args.workspace, kind, op, **reads)
    _check_on_device(device, **{name: getattr(args, name) for name in tensors})
    _, num_kv_heads, head_size, fp8_kv = _check_paged_cache(
        args.key_cache, args.value_cache
    )
    return device, num_kv_heads, head_size, fp8_kv


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


def _check_plan_batch(batch: int, source: str, max_batch: int) -> None:
    """A step's ``batch`` (read from ``source``) within the workspace's."""
    if batch > max_batch:
        raise ValueError(
            f"batch {batch}{source} exceeds the workspace's max_batch {max_batch}"
        )


def validate_split_mode(
    mode: SplitMode | int | None, *, min_split_len: int, fixed_split_len: int
) -> SplitMode:
    """Checks a decode plan's split settings and returns the mode it plans
    with: ``mode``, or by default BATCH_INVARIANT when ``fixed_split_len``
    is given, else BALANCED. Split lengths are in tokens, multiples of
    ``DECODE_TILE_TOKENS``."""
    _check_split_len("min_split_len", min_split_len)
    _check_split_len("fixed_split_len", fixed_split_len)
    if mode is None:
        return SplitMode.BATCH_INVARIANT if fixed_split_len else SplitMode.BALANCED
    try:
        mode = SplitMode(mode)
    except ValueError:
        raise ValueError(
            f"mode is {mode!r}; accepted: None or one of "
            f"{', '.join(SplitMode.__members__)}"
        ) from None
    if mode == SplitMode.BATCH_INVARIANT and fixed_split_len == 0:
        raise ValueError(
            "fixed_split_len is 0; the BATCH_INVARIANT mode needs a positive "
            f"multiple of {DECODE_TILE_TOKENS}"
        )
    return mode


def _check_window(window: int) -> None:
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window is {window!r}; accepted: 0 (none) or a positive int")


def validate_decode_workspace(args: SimpleNamespace) -> None:
    """Checks the arguments of ``DecodeWorkspace.create`` (by name, as
    :func:`validated_by` hands them over) but its split settings, which
    ``create`` resolves through :func:`validate_split_mode`."""
    device = torch.device(args.device)
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {device}")
    _check_positive(
        max_batch=args.max_batch,
        num_kv_heads=args.num_kv_heads,
        max_kv_tokens=args.max_kv_tokens,
    )
    if args.head_size not in SUPPORTED_HEAD_SIZES:
        raise ValueError(
            f"head_size is {args.head_size}; accepted: {SUPPORTED_HEAD_SIZES}"
        )
    _check_gqa(args.num_q_heads, args.num_kv_heads)
    validate_query_tokens(args.max_query_tokens, args.num_q_heads // args.num_kv_heads)
    _check_window(args.window)
    if args.kv_cache_dtype not in _DECODE_KV_DTYPES:
        raise ValueError(
            f"kv_cache_dtype is {args.kv_cache_dtype}; accepted dtypes: "
            f"{_names(_DECODE_KV_DTYPES)}"
        )
    if args.num_ctas is not None:
        _check_positive(num_ctas=args.num_ctas)


def validate_decode_plan(
    workspace: DecodeWorkspaceLike, kv_lens: torch.Tensor, query_tokens: int = 1
) -> None:
    """Checks the arguments of ``DecodeWorkspace.plan``: ``kv_lens`` int32
    ``[batch]`` on the workspace's device, within its sizes."""
    _check_tensor("kv_lens", kv_lens)
    _check_ndim("kv_lens", kv_lens, 1, "[batch]")
    _check_dtype("kv_lens", kv_lens, (torch.int32,))
    device = workspace.plan_buffer.device
    if kv_lens.device != device:
        raise ValueError(f"kv_lens is on {kv_lens.device}; expected {device}")
    _check_contiguous("kv_lens", kv_lens)
    _check_plan_batch(kv_lens.shape[0], "", workspace.max_batch)
    validate_query_tokens(query_tokens)
    if query_tokens > workspace.max_query_tokens:
        raise ValueError(
            f"query_tokens is {query_tokens}; this workspace accepts "
            f"1..{workspace.max_query_tokens}"
        )


@_validator_of(ops.decode_attention)
def validate_decode_attention(args: SimpleNamespace) -> None:
    """Checks the arguments of ``vllm._hpc_ops.decode_attention``: the
    workspace's buffers and the batch, heads and query tokens it was sized
    for, the paged cache, the queries, ``kv_lens``, the block table, the
    output, the scales and the softmax settings."""
    workspace = args.workspace
    _, num_kv_heads, head_size, fp8_kv = _check_attention_call(
        "decode_attention", args, _DECODE_WORKSPACE, _DECODE_READS, _DECODE_TENSORS
    )
    tokens, num_q_heads = _check_query(
        args.q, args.key_cache.dtype, num_kv_heads, head_size, 4
    )
    validate_query_tokens(args.query_tokens, num_q_heads // num_kv_heads)
    batch = args.kv_lens.shape[0] if args.kv_lens.dim() == 1 else -1
    _check_ndim("kv_lens", args.kv_lens, 1, "[batch]")
    _check_dtype("kv_lens", args.kv_lens, (torch.int32,))
    _check_contiguous("kv_lens", args.kv_lens)
    if tokens != batch * args.query_tokens:
        raise ValueError(
            f"q has {tokens} tokens; expected batch ({batch}) x query_tokens "
            f"({args.query_tokens})"
        )
    if (
        batch > workspace.max_batch
        or num_kv_heads != workspace.num_kv_heads
        or num_q_heads != workspace.num_q_heads
        or head_size != workspace.head_size
        or args.query_tokens > workspace.max_query_tokens
    ):
        raise ValueError(
            f"workspace was sized for max_batch={workspace.max_batch}, "
            f"heads={workspace.num_q_heads}/{workspace.num_kv_heads}, "
            f"head_size={workspace.head_size}, max_query_tokens="
            f"{workspace.max_query_tokens}; got batch={batch}, heads="
            f"{num_q_heads}/{num_kv_heads}, head_size={head_size}, "
            f"query_tokens={args.query_tokens}"
        )
    _check_block_table(args.block_table, batch)
    _check_output(args.q, args.out)
    _check_attention_scales(args.q, args.q_scale, args.k_scale, args.v_scale, fp8_kv)
    _check_softmax_args(args.scale, args.softcap)


# ---------------------------------------------------------------------------
# Paged prefill: the workspace, its plan and prefill_attention
# ---------------------------------------------------------------------------


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


def validate_prefill_workspace(args: SimpleNamespace) -> None:
    """Checks the arguments of ``PrefillWorkspace.create`` (by name, as
    :func:`validated_by` hands them over)."""
    device = torch.device(args.device)
    if device.type not in ("cuda", "cpu"):
        raise ValueError(
            f"device must be a CUDA device (or the CPU for the host planner), "
            f"got {device}"
        )
    _check_positive(
        max_tokens=args.max_tokens,
        max_batch=args.max_batch,
        num_kv_heads=args.num_kv_heads,
    )
    for name, value in (("max_tokens", args.max_tokens), ("max_batch", args.max_batch)):
        if value >= _INT32_MAX:
            raise ValueError(f"{name} is {value}; accepted: below 2**31 - 1")
    if args.num_kv_heads > PREFILL_MAX_KV_HEADS:
        raise ValueError(
            f"num_kv_heads is {args.num_kv_heads}; accepted: 1..{PREFILL_MAX_KV_HEADS}"
        )
    _check_gqa(args.num_q_heads, args.num_kv_heads)


def validate_prefill_plan(
    workspace: PrefillWorkspaceLike,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """Checks the arguments of ``PrefillWorkspace.plan``: int32
    ``query_start_loc`` ``[batch + 1]`` and ``seq_lens`` ``[batch]`` on the
    workspace's device, within its batch size."""
    batch = _check_lengths(query_start_loc, seq_lens, workspace.plan_buffer.device)
    _check_plan_batch(batch, " (seq_lens.shape[0])", workspace.max_batch)


@_validator_of(ops.prefill_attention)
def validate_prefill_attention(args: SimpleNamespace) -> None:
    """Checks the arguments of ``vllm._hpc_ops.prefill_attention``: the
    plan and the tokens, batch and heads it was made for, the paged cache,
    the queries, the lengths, the block table, the output, the scales, the
    softmax settings and the window."""
    # The cache pair defines the heads, head size and block size.
    device, num_kv_heads, head_size, fp8_kv = _check_attention_call(
        "prefill_attention", args, _PREFILL_WORKSPACE, _PREFILL_READS, _PREFILL_TENSORS
    )
    workspace = args.workspace
    # Queries: read by TMA, so 16-byte aligned rows.
    tokens, num_q_heads = _check_query(
        args.q,
        args.key_cache.dtype,
        num_kv_heads,
        head_size,
        16 // args.q.element_size(),
    )
    _check_aligned("q", args.q)
    _check_output(args.q, args.out)
    _check_attention_scales(args.q, args.q_scale, args.k_scale, args.v_scale, fp8_kv)

    batch = _check_lengths(args.query_start_loc, args.seq_lens, device)
    _check_block_table(args.block_table, batch)

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

    _check_softmax_args(args.scale, args.softcap)
    _check_window(args.window)


# ---------------------------------------------------------------------------
# Fused FP8 MoE: the workspace, the tiling and fused_moe_fp8
# ---------------------------------------------------------------------------


def _check_moe_dims(hidden_size: int, intermediate_size: int, block_wise: bool) -> None:
    if hidden_size < 1 or hidden_size % MOE_HIDDEN_ALIGN:
        raise ValueError(
            f"hidden_size is {hidden_size}; accepted: a positive multiple of "
            f"{MOE_HIDDEN_ALIGN}"
        )
    align = MOE_BLOCK_SHAPE[0] if block_wise else MOE_INTERMEDIATE_ALIGN
    if intermediate_size < 1 or intermediate_size % align:
        mode = "block-wise" if block_wise else "per-tensor"
        raise ValueError(
            f"intermediate_size is {intermediate_size}; accepted ({mode}): a "
            f"positive multiple of {align}"
        )


def _check_topk(topk: int, name: str = "topk") -> None:
    if not 1 <= topk <= MOE_MAX_TOPK:
        raise ValueError(f"{name} is {topk}; accepted: 1..{MOE_MAX_TOPK}")


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


@_validator_of(ops.moe_workspace_bytes)
def validate_moe_workspace(args: SimpleNamespace) -> None:
    """Checks the sizes of a fused-MoE workspace: the arguments of
    ``vllm._hpc_ops.moe_workspace_bytes`` and of ``MoeWorkspace.create``."""
    _check_positive(
        max_tokens=args.max_tokens, num_local_experts=args.num_local_experts
    )
    _check_topk(args.topk)
    # The per-tensor alignment is the weaker one; block-wise calls check
    # theirs when they run.
    _check_moe_dims(args.hidden_size, args.intermediate_size, block_wise=False)


@_validator_of(ops.moe_tiling)
def validate_moe_tiling(args: SimpleNamespace) -> None:
    """Checks the arguments of ``vllm._hpc_ops.moe_tiling``."""
    _check_positive(
        num_tokens=args.num_tokens,
        num_local_experts=args.num_local_experts,
        num_sms=args.num_sms,
    )
    _check_topk(args.topk)
    if args.num_experts < args.num_local_experts:
        raise ValueError(
            f"num_experts ({args.num_experts}) must be >= num_local_experts "
            f"({args.num_local_experts})"
        )
    _check_moe_dims(
        args.hidden_size, args.intermediate_size, block_wise=args.block_wise
    )


@_validator_of(ops.fused_moe_fp8)
def validate_fused_moe_fp8(args: SimpleNamespace) -> None:
    """Checks the arguments of ``vllm._hpc_ops.fused_moe_fp8``, the
    workspace's fields and sizes included."""
    workspace = args.workspace
    device = _check_workspace(
        workspace, _MOE_WORKSPACE, "fused_moe_fp8", buffer=torch.uint8
    )
    _check_ndim("workspace.buffer", workspace.buffer, 1, "[bytes]")
    for name in (
        "hidden_states",
        "w13",
        "w2",
        "topk_weights",
        "topk_ids",
        "out",
        "w13_scale",
        "w2_scale",
    ):
        t = getattr(args, name)
        _check_tensor(name, t)

    if args.block_shape is None:
        block_wise = False
    else:
        try:
            shape = tuple(int(b) for b in args.block_shape)
        except (TypeError, ValueError):
            shape = None
        if shape != MOE_BLOCK_SHAPE:
            raise ValueError(
                f"block_shape is {args.block_shape!r}; accepted: None (per-tensor) or "
                f"{MOE_BLOCK_SHAPE} (block-wise)"
            )
        block_wise = True

    # Weights define E_local, H and I.
    _check_ndim(
        "w13", args.w13, 3, "[num_local_experts, 2 * intermediate_size, hidden]"
    )
    _check_ndim("w2", args.w2, 3, "[num_local_experts, hidden_size, intermediate_size]")
    _check_dtype("w13", args.w13, (_MOE_FP8,))
    _check_dtype("w2", args.w2, (_MOE_FP8,))
    num_experts, two_i, hidden_size = args.w13.shape
    if two_i % 2:
        raise ValueError(
            f"w13.shape[1] is {two_i}; expected 2 * intermediate_size (gate "
            "rows, then up rows)"
        )
    inter = two_i // 2
    if tuple(args.w2.shape) != (num_experts, hidden_size, inter):
        raise ValueError(
            f"w2 shape {tuple(args.w2.shape)} must be [num_local_experts, hidden_size, "
            f"intermediate_size] = {(num_experts, hidden_size, inter)} to match w13"
        )
    if num_experts < 1:
        raise ValueError("w13 has no experts; accepted: num_local_experts >= 1")
    _check_moe_dims(hidden_size, inter, block_wise)
    _check_contiguous("w13", args.w13)
    _check_contiguous("w2", args.w2)

    # Activations and routing.
    _check_ndim("hidden_states", args.hidden_states, 2, "[num_tokens, hidden_size]")
    _check_dtype("hidden_states", args.hidden_states, _MOE_HIDDEN_DTYPES)
    num_tokens = args.hidden_states.shape[0]
    _check_rows("hidden_states", args.hidden_states, (num_tokens, hidden_size))
    _check_dtype("out", args.out, _ACTIVATION_DTYPES)
    _check_rows("out", args.out, (num_tokens, hidden_size))
    _check_ndim("topk_ids", args.topk_ids, 2, "[num_tokens, topk]")
    _check_dtype("topk_ids", args.topk_ids, _INDEX_DTYPES)
    topk = args.topk_ids.shape[1]
    if args.topk_ids.shape[0] != num_tokens:
        raise ValueError(
            f"topk_ids shape {tuple(args.topk_ids.shape)} must be [num_tokens, topk] "
            f"with num_tokens = {num_tokens}"
        )
    _check_topk(topk, "topk (topk_ids.shape[1])")
    _check_contiguous("topk_ids", args.topk_ids)
    _check_ndim("topk_weights", args.topk_weights, 2, "[num_tokens, topk]")
    _check_dtype("topk_weights", args.topk_weights, (torch.float32,))
    if args.topk_weights.shape != args.topk_ids.shape:
        raise ValueError(
            f"topk_weights shape {tuple(args.topk_weights.shape)} must equal topk_ids "
            f"shape {tuple(args.topk_ids.shape)}"
        )
    _check_contiguous("topk_weights", args.topk_weights)
    if args.apply_router_weight_on_input and topk != 1:
        raise ValueError(
            f"apply_router_weight_on_input needs topk == 1, got topk = {topk}"
        )
    if args.shared_output is not None:
        _check_tensor("shared_output", args.shared_output)
        if args.shared_output.dtype != args.out.dtype:
            raise ValueError(
                f"shared_output dtype {args.shared_output.dtype} must equal out dtype "
                f"{args.out.dtype}"
            )
        _check_rows("shared_output", args.shared_output, (num_tokens, hidden_size))

    # Scales.
    fp8_input = args.hidden_states.dtype == _MOE_FP8
    h_blocks = hidden_size // MOE_BLOCK_SHAPE[1]
    if block_wise:
        i_blocks = inter // MOE_BLOCK_SHAPE[0]
        _check_scale_shape(
            "w13_scale", args.w13_scale, (num_experts, 2 * i_blocks, h_blocks)
        )
        _check_scale_shape("w2_scale", args.w2_scale, (num_experts, h_blocks, i_blocks))
        if fp8_input:
            if args.a1_scale is None:
                raise ValueError(
                    "a1_scale is required with float8_e4m3fn hidden_states: "
                    f"float32 [num_tokens, hidden_size / 128] = "
                    f"{(num_tokens, h_blocks)}"
                )
            _check_scale_shape("a1_scale", args.a1_scale, (num_tokens, h_blocks))
        elif args.a1_scale is not None:
            raise ValueError(
                "a1_scale must be None with 16-bit hidden_states in block-wise "
                "mode (they are quantized per 1x128 group inside)"
            )
        if args.a2_scale is not None:
            raise ValueError(
                "a2_scale must be None in block-wise mode (the intermediate is "
                "quantized per 1x128 group inside)"
            )
    else:
        _check_scale_shape("w13_scale", args.w13_scale, (num_experts,))
        _check_scale_shape("w2_scale", args.w2_scale, (num_experts,))
        if args.a1_scale is not None:
            _check_scale_scalar("a1_scale", args.a1_scale)
        elif fp8_input:
            raise ValueError(
                "a1_scale is required with float8_e4m3fn hidden_states: a float32 "
                "tensor with one element"
            )
        if args.a2_scale is None:
            raise ValueError(
                "a2_scale is required in per-tensor mode: a float32 tensor with "
                "one element (the static scale of the intermediate)"
            )
        _check_scale_scalar("a2_scale", args.a2_scale)

    # Expert placement.
    if args.expert_map is not None:
        _check_tensor("expert_map", args.expert_map)
        _check_ndim("expert_map", args.expert_map, 1, "[global_num_experts]")
        _check_dtype("expert_map", args.expert_map, (torch.int32,))
        _check_contiguous("expert_map", args.expert_map)
        if args.expert_offset != 0:
            raise ValueError(
                f"expert_offset is {args.expert_offset}; it must be 0 when expert_map "
                "is given (the map alone places the experts)"
            )
    elif args.expert_offset < 0:
        raise ValueError(f"expert_offset is {args.expert_offset}; accepted: >= 0")

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
    on_device = (
        "hidden_states w13 w2 topk_weights topk_ids out w13_scale w2_scale "
        "a1_scale a2_scale expert_map shared_output"
    )
    for name in on_device.split():
        tensor = getattr(args, name)
        if tensor is not None and tensor.device != device:
            raise ValueError(
                f"{name} is on {tensor.device}; expected the workspace's device "
                f"{device}"
            )

    total_experts = args.global_num_experts
    if total_experts is None:
        total_experts = (
            args.expert_map.shape[0] if args.expert_map is not None else num_experts
        )
    if total_experts < num_experts:
        raise ValueError(
            f"global_num_experts ({total_experts}) must be >= the local "
            f"expert count ({num_experts})"
        )
