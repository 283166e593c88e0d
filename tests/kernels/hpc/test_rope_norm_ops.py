# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU tests of ``vllm._hpc_ops.rope_norm_store_kv`` and its reference.

* Input validation: every rejected input raises ``ValueError`` naming the
  argument. Validation runs before the library is needed, so this runs on
  any machine.
* A valid call on CPU tensors gets past validation and then fails for want
  of the library or of a CPU kernel.
* The fake (meta) implementation traces under ``FakeTensorMode`` and
  ``make_fx`` (needs the library, not a GPU).
* Sanity of the float32 reference itself.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import pytest
import regex as re
import torch

from tests.kernels.hpc.rope_norm_reference import (
    FP8_DTYPE,
    FP8_MAX,
    NORM_NONE,
    NORM_NORM_THEN_ROPE,
    NORM_ROPE_THEN_NORM,
    KvLayout,
    apply_rope,
    dequantize_fp8,
    expected_cache,
    is_poison,
    kv_views,
    make_cos_sin_cache,
    make_prologue_inputs,
    quantize_fp8,
    quantize_fp8_per_row,
    read_slots,
    reference_prologue,
    rms_norm,
    written_mask,
)
from tests.kernels.hpc.utils import error_stats
from vllm._hpc_ops import (
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_HEAD_SIZES,
    QkNormPolicy,
    hpc_ops_available,
    rope_norm_store_kv,
)
from vllm._hpc_ops_validation import validate_rope_norm_store_kv

T, HQ, HKV, D, BS = 5, 8, 2, 64, 16


def checked_rope_norm_store_kv(**kwargs: Any) -> None:
    """Validates the arguments, then calls the op."""
    validate_rope_norm_store_kv(**kwargs)
    rope_norm_store_kv(**kwargs)


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------


def _valid_call(
    *,
    cache_dtype: torch.dtype = torch.bfloat16,
    q_out_dtype: torch.dtype = torch.bfloat16,
    norm_policy: int = NORM_NORM_THEN_ROPE,
    layout: KvLayout = KvLayout.HPC,
) -> dict[str, Any]:
    """Keyword arguments of a valid call, on CPU."""
    inputs = make_prologue_inputs(
        num_tokens=T,
        num_q_heads=HQ,
        num_kv_heads=HKV,
        head_size=D,
        block_size=BS,
        cache_dtype=cache_dtype,
        q_out_dtype=q_out_dtype,
        norm_policy=norm_policy,
        layout=layout,
        num_padding=1,
        max_position=64,
    )
    # The op's positional parameters, by name.
    positional = [
        p.name
        for p in inspect.signature(rope_norm_store_kv).parameters.values()
        if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD
    ]
    kwargs = dict(zip(positional, inputs.op_args(), strict=True))
    kwargs.update(inputs.op_kwargs())
    return kwargs


def _caches(
    *,
    num_blocks: int = 4,
    block_size: int = BS,
    heads: int = HKV,
    head_size: int = D,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
) -> dict[str, torch.Tensor]:
    kv = torch.zeros(
        num_blocks, heads, block_size, 2 * head_size, dtype=dtype, device=device
    )
    key_cache, value_cache = kv_views(kv, KvLayout.HPC, head_size)
    return {"key_cache": key_cache, "value_cache": value_cache}


def _qkv(hq: int, hkv: int, head_size: int, num_tokens: int = T) -> torch.Tensor:
    return torch.zeros(num_tokens, (hq + 2 * hkv) * head_size, dtype=torch.bfloat16)


def _geometry(hq: int, hkv: int, head_size: int = D) -> dict[str, torch.Tensor]:
    """A consistent qkv / q_out / caches / weights for other head counts."""
    return {
        "qkv": _qkv(hq, hkv, head_size),
        "q_out": torch.empty(T, hq, head_size, dtype=torch.bfloat16),
        "cos_sin_cache": make_cos_sin_cache(head_size, 64),
        "q_norm_weight": torch.ones(head_size),
        "k_norm_weight": torch.ones(head_size),
        **_caches(heads=hkv, head_size=head_size),
    }


def _fp8_cache() -> dict[str, torch.Tensor]:
    return _caches(dtype=FP8_DTYPE)


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t, device="meta")


def _padded_caches(
    row: int, step: int = 1, value_offset: int = 0
) -> dict[str, torch.Tensor]:
    """[4, BS, HKV, D] caches cut from rows of ``row`` elements, taking every
    ``step``-th element; V starts ``value_offset`` elements into its rows."""
    key, value = torch.zeros(2, 4, BS, HKV, row, dtype=torch.bfloat16)
    end = step * D
    return {
        "key_cache": key[..., :end:step],
        "value_cache": value[..., value_offset : value_offset + end : step],
    }


Mutation = Callable[[dict[str, Any]], dict[str, Any]]

# (id, changes to a valid call, regex that the message must match)
INVALID: list[tuple[str, Mutation, str]] = [
    # qkv
    ("qkv-not-tensor", lambda kw: {"qkv": kw["qkv"].tolist()}, r"^qkv must be a torch"),
    ("qkv-float32", lambda kw: {"qkv": kw["qkv"].float()}, r"^qkv has dtype"),
    ("qkv-3d", lambda kw: {"qkv": kw["qkv"].unsqueeze(0)}, r"^qkv must be 2-D"),
    (
        "qkv-last-stride",
        lambda kw: {"qkv": kw["qkv"].repeat_interleave(2, dim=1)[:, ::2]},
        r"^qkv must have a unit last-dim stride",
    ),
    ("qkv-width", lambda kw: {"qkv": kw["qkv"][:, :-D]}, r"^qkv\.shape\[1\]"),
    (
        "qkv-row-stride",
        lambda kw: {
            "qkv": torch.zeros(T, kw["qkv"].shape[1] + 4).bfloat16()[
                :, : kw["qkv"].shape[1]
            ]
        },
        r"^qkv row stride",
    ),
    # caches
    (
        "key-cache-3d",
        lambda kw: {"key_cache": kw["key_cache"][0]},
        r"^key_cache must be 4-D",
    ),
    (
        "value-cache-3d",
        lambda kw: {"value_cache": kw["value_cache"][0]},
        r"^value_cache must be 4-D",
    ),
    (
        "cache-shape-mismatch",
        lambda kw: {"value_cache": kw["value_cache"][:2]},
        r"^key_cache shape .* value_cache shape",
    ),
    (
        "head-size-96",
        lambda kw: {**_geometry(HQ, HKV, head_size=96)},
        r"^head_size \(key_cache\.shape\[-1\]\) is 96; accepted: \(64, 128, 256\)",
    ),
    (
        "block-size-8",
        lambda kw: _caches(block_size=8),
        r"^block_size \(key_cache\.shape\[1\]\) is 8; accepted: \(16, 32, 64\)",
    ),
    (
        "key-cache-float32",
        lambda kw: _caches(dtype=torch.float32),
        r"^key_cache has dtype torch\.float32",
    ),
    (
        "value-cache-dtype",
        lambda kw: {"value_cache": kw["value_cache"].half()},
        r"^value_cache dtype",
    ),
    (
        "cache-dtype-vs-qkv",
        lambda kw: _caches(dtype=torch.float16),
        r"^key_cache dtype torch\.float16 must equal qkv dtype",
    ),
    (
        "key-cache-last-stride",
        lambda kw: _padded_caches(2 * D, step=2),
        r"^key_cache must have a unit head_size stride",
    ),
    (
        "key-cache-row-alignment",
        lambda kw: _padded_caches(D + 4),
        r"^key_cache strides .* multiples of 8",
    ),
    (
        "key-cache-device",
        lambda kw: {
            "key_cache": _meta(kw["key_cache"]),
            "value_cache": _meta(kw["value_cache"]),
        },
        r"^key_cache is on meta",
    ),
    # FP8 cache scales
    (
        "fp8-cache-no-k-scale",
        lambda kw: {**_fp8_cache(), "k_scale": None, "v_scale": torch.ones(1)},
        r"^k_scale is required",
    ),
    (
        "fp8-cache-no-v-scale",
        lambda kw: {**_fp8_cache(), "k_scale": torch.ones(1), "v_scale": None},
        r"^v_scale is required",
    ),
    (
        "k-scale-two-elements",
        lambda kw: {**_fp8_cache(), "k_scale": torch.ones(2), "v_scale": torch.ones(1)},
        r"^k_scale must be a float32 tensor with one element",
    ),
    (
        "v-scale-float16",
        lambda kw: {
            **_fp8_cache(),
            "k_scale": torch.ones(1),
            "v_scale": torch.ones(1, dtype=torch.float16),
        },
        r"^v_scale must be a float32 tensor with one element",
    ),
    (
        "k-scale-device",
        lambda kw: {
            **_fp8_cache(),
            "k_scale": torch.ones(1, device="meta"),
            "v_scale": torch.ones(1),
        },
        r"^k_scale is on meta",
    ),
    # q_out and q_scale
    ("q-out-2d", lambda kw: {"q_out": kw["q_out"].flatten(1)}, r"^q_out must be 3-D"),
    ("q-out-tokens", lambda kw: {"q_out": kw["q_out"][:-1]}, r"^q_out shape"),
    (
        "q-out-head-size",
        lambda kw: {"q_out": torch.empty(T, HQ, 2 * D, dtype=torch.bfloat16)},
        r"^q_out shape",
    ),
    ("q-out-float32", lambda kw: {"q_out": kw["q_out"].float()}, r"^q_out has dtype"),
    (
        "q-out-noncontiguous",
        lambda kw: {"q_out": kw["q_out"].transpose(0, 1).contiguous().transpose(0, 1)},
        r"^q_out must be contiguous",
    ),
    ("q-out-device", lambda kw: {"q_out": _meta(kw["q_out"])}, r"^q_out is on meta"),
    (
        "fp8-q-out-no-q-scale",
        lambda kw: {"q_out": kw["q_out"].to(FP8_DTYPE), "q_scale": None},
        r"^q_scale is required when q_out is float8_e4m3fn",
    ),
    (
        "q-scale-shape",
        lambda kw: {
            "q_out": kw["q_out"].to(FP8_DTYPE),
            "q_scale": torch.ones(T, HQ - 1),
        },
        r"^q_scale must be float32",
    ),
    (
        "q-scale-too-few-tokens",
        lambda kw: {
            "q_out": kw["q_out"].to(FP8_DTYPE),
            "q_scale": torch.ones(T - 1, HQ),
        },
        r"^q_scale must be float32",
    ),
    (
        "q-scale-dtype",
        lambda kw: {
            "q_out": kw["q_out"].to(FP8_DTYPE),
            "q_scale": torch.ones(T, HQ, dtype=torch.bfloat16),
        },
        r"^q_scale must be float32",
    ),
    (
        "q-scale-noncontiguous",
        lambda kw: {
            "q_out": kw["q_out"].to(FP8_DTYPE),
            "q_scale": torch.ones(HQ, T).t(),
        },
        r"^q_scale must be contiguous",
    ),
    (
        "q-scale-for-bf16-out",
        lambda kw: {"q_scale": torch.ones(T, HQ)},
        r"^q_scale must be None unless q_out is float8_e4m3fn",
    ),
    # head counts
    (
        "hq-not-multiple-of-hkv",
        lambda kw: {**_geometry(6, 4)},
        r"^Hq \(q_out\.shape\[1\]\) = 6 must be a multiple of Hkv",
    ),
    (
        "gqa-ratio-32",
        lambda kw: {**_geometry(64, 2)},
        r"^Hq / Hkv = 32; accepted: 1\.\.16",
    ),
    # positions and slot_mapping
    (
        "positions-2d",
        lambda kw: {"positions": kw["positions"].unsqueeze(0)},
        r"^positions must be 1-D",
    ),
    (
        "positions-float",
        lambda kw: {"positions": kw["positions"].float()},
        r"^positions has dtype",
    ),
    (
        "positions-int16",
        lambda kw: {"positions": kw["positions"].short()},
        r"^positions has dtype",
    ),
    (
        "positions-short",
        lambda kw: {"positions": kw["positions"][:-1]},
        r"^positions has 4 entries",
    ),
    (
        "positions-noncontiguous",
        lambda kw: {"positions": kw["positions"].repeat_interleave(2)[::2]},
        r"^positions must be contiguous",
    ),
    (
        "positions-device",
        lambda kw: {"positions": _meta(kw["positions"])},
        r"^positions is on meta",
    ),
    (
        "slot-mapping-2d",
        lambda kw: {"slot_mapping": kw["slot_mapping"].unsqueeze(1)},
        r"^slot_mapping must be 1-D",
    ),
    (
        "slot-mapping-float",
        lambda kw: {"slot_mapping": kw["slot_mapping"].double()},
        r"^slot_mapping has dtype",
    ),
    (
        "slot-mapping-short",
        lambda kw: {"slot_mapping": kw["slot_mapping"][:2]},
        r"^slot_mapping has 2 entries",
    ),
    (
        "slot-mapping-device",
        lambda kw: {"slot_mapping": _meta(kw["slot_mapping"])},
        r"^slot_mapping is on meta",
    ),
    # cos_sin_cache and rotary_dim
    (
        "cos-sin-1d",
        lambda kw: {"cos_sin_cache": kw["cos_sin_cache"].flatten()},
        r"^cos_sin_cache must be 2-D",
    ),
    (
        "cos-sin-float64",
        lambda kw: {"cos_sin_cache": kw["cos_sin_cache"].double()},
        r"^cos_sin_cache has dtype",
    ),
    (
        "cos-sin-noncontiguous",
        lambda kw: {"cos_sin_cache": make_cos_sin_cache(D, 64).t().contiguous().t()},
        r"^cos_sin_cache must be contiguous",
    ),
    (
        "cos-sin-device",
        lambda kw: {"cos_sin_cache": _meta(kw["cos_sin_cache"])},
        r"^cos_sin_cache is on meta",
    ),
    (
        "rotary-dim-40",
        lambda kw: {"cos_sin_cache": make_cos_sin_cache(40, 64)},
        r"^rotary_dim \(cos_sin_cache\.shape\[1\]\) is 40",
    ),
    (
        "rotary-dim-8",
        lambda kw: {"cos_sin_cache": make_cos_sin_cache(8, 64)},
        r"^rotary_dim \(cos_sin_cache\.shape\[1\]\) is 8",
    ),
    (
        "rotary-dim-above-head-size",
        lambda kw: {"cos_sin_cache": make_cos_sin_cache(2 * D, 64)},
        r"^rotary_dim \(cos_sin_cache\.shape\[1\]\) is 128",
    ),
    # norm policy and weights
    (
        "norm-policy-3",
        lambda kw: {"norm_policy": 3},
        r"^norm_policy is 3; accepted: \[0, 1, 2\]",
    ),
    ("norm-policy-negative", lambda kw: {"norm_policy": -1}, r"^norm_policy is -1"),
    (
        "no-q-norm-weight",
        lambda kw: {"q_norm_weight": None},
        r"^q_norm_weight is required when norm_policy is NORM_THEN_ROPE",
    ),
    (
        "no-k-norm-weight",
        lambda kw: {"k_norm_weight": None, "norm_policy": NORM_ROPE_THEN_NORM},
        r"^k_norm_weight is required when norm_policy is ROPE_THEN_NORM",
    ),
    (
        "q-norm-weight-not-tensor",
        lambda kw: {"q_norm_weight": [1.0] * D},
        r"^q_norm_weight must be a torch\.Tensor",
    ),
    (
        "q-norm-weight-shape",
        lambda kw: {"q_norm_weight": torch.ones(D + 1)},
        r"^q_norm_weight must have shape \(64,\)",
    ),
    (
        "k-norm-weight-2d",
        lambda kw: {"k_norm_weight": torch.ones(1, D)},
        r"^k_norm_weight must have shape \(64,\)",
    ),
    (
        "q-norm-weight-float16",
        lambda kw: {"q_norm_weight": torch.ones(D, dtype=torch.float16)},
        r"^q_norm_weight has dtype torch\.float16",
    ),
    (
        "norm-weight-dtypes-differ",
        lambda kw: {
            "q_norm_weight": torch.ones(D),
            "k_norm_weight": torch.ones(D, dtype=torch.bfloat16),
        },
        r"^q_norm_weight dtype torch\.float32 must equal k_norm_weight dtype",
    ),
    (
        "q-norm-weight-noncontiguous",
        lambda kw: {"q_norm_weight": torch.ones(2 * D)[::2]},
        r"^q_norm_weight must be contiguous",
    ),
    (
        "k-norm-weight-device",
        lambda kw: {"k_norm_weight": torch.ones(D, device="meta")},
        r"^k_norm_weight is on meta",
    ),
    # 16-byte aligned base pointers (each of these starts 8 bytes in)
    (
        "qkv-misaligned",
        lambda kw: {
            "qkv": torch.zeros(T, kw["qkv"].shape[1] + 8, dtype=torch.bfloat16)[
                :, 4 : 4 + kw["qkv"].shape[1]
            ]
        },
        r"^qkv must start on a 16-byte boundary",
    ),
    (
        "value-cache-misaligned",
        lambda kw: _padded_caches(D + 8, value_offset=4),
        r"^value_cache must start on a 16-byte boundary",
    ),
    (
        "cos-sin-misaligned",
        lambda kw: {"cos_sin_cache": torch.zeros(64 * D + 2)[2:].view(64, D)},
        r"^cos_sin_cache must start on a 16-byte boundary",
    ),
    (
        "q-norm-weight-misaligned",
        lambda kw: {"q_norm_weight": torch.ones(D + 2)[2:]},
        r"^q_norm_weight must start on a 16-byte boundary",
    ),
    ("eps-zero", lambda kw: {"eps": 0.0}, r"^eps must be positive"),
    ("eps-nan", lambda kw: {"eps": math.nan}, r"^eps must be positive"),
    (
        # The kernel reads a non-fp32 cache as the model dtype.
        "cos-sin-float16-with-bf16-qkv",
        lambda kw: {"cos_sin_cache": kw["cos_sin_cache"].half()},
        r"cos_sin_cache",
    ),
    (
        # The kernel takes one set of strides for both caches.
        "cache-strides-differ",
        lambda kw: {"value_cache": kw["value_cache"].contiguous()},
        r"value_cache",
    ),
]


@pytest.mark.parametrize(
    ("change", "message"),
    [pytest.param(change, message, id=name) for name, change, message in INVALID],
)
def test_rejects_invalid_input(change: Mutation, message: str) -> None:
    kwargs = _valid_call()
    kwargs.update(change(kwargs))
    with pytest.raises(ValueError, match=message):
        checked_rope_norm_store_kv(**kwargs)


def test_invalid_ids_are_unique() -> None:
    names = [name for name, _, _ in INVALID]
    assert len(names) == len(set(names))


def test_messages_list_accepted_values() -> None:
    assert SUPPORTED_HEAD_SIZES == (64, 128, 256)
    assert SUPPORTED_BLOCK_SIZES == (16, 32, 64)
    kwargs = _valid_call()
    kwargs.update(_caches(block_size=128))
    with pytest.raises(ValueError, match=re.escape(str(SUPPORTED_BLOCK_SIZES))):
        checked_rope_norm_store_kv(**kwargs)


def _call_past_validation(**kwargs: Any) -> None:
    """A valid CPU call: fails after validation, never with ValueError."""
    if hpc_ops_available():
        # The library has CUDA kernels only: the dispatcher refuses CPU.
        with pytest.raises((NotImplementedError, RuntimeError)):
            checked_rope_norm_store_kv(**kwargs)
    else:
        with pytest.raises(RuntimeError, match="_hpc_C is not built"):
            checked_rope_norm_store_kv(**kwargs)


@pytest.mark.parametrize(
    ("cache_dtype", "q_out_dtype", "norm_policy", "layout"),
    [
        (torch.bfloat16, torch.bfloat16, NORM_NONE, KvLayout.HPC),
        (torch.bfloat16, torch.bfloat16, NORM_ROPE_THEN_NORM, KvLayout.NHD),
        (FP8_DTYPE, torch.bfloat16, NORM_NORM_THEN_ROPE, KvLayout.HPC),
        (FP8_DTYPE, FP8_DTYPE, NORM_NORM_THEN_ROPE, KvLayout.NHD),
        (torch.bfloat16, FP8_DTYPE, NORM_NONE, KvLayout.HPC),
    ],
)
def test_valid_input_passes_validation(
    cache_dtype: torch.dtype,
    q_out_dtype: torch.dtype,
    norm_policy: int,
    layout: KvLayout,
) -> None:
    _call_past_validation(
        **_valid_call(
            cache_dtype=cache_dtype,
            q_out_dtype=q_out_dtype,
            norm_policy=norm_policy,
            layout=layout,
        )
    )


def test_valid_edge_inputs_pass_validation() -> None:
    # The widest GQA ratio, partial rotary, model-dtype weights, int32
    # indices, extra positions/slots, a strided qkv row and a q_scale with
    # spare rows are all accepted.
    hq, hkv = 32, 2
    wide = torch.zeros(T, (hq + 2 * hkv) * D + 64, dtype=torch.bfloat16)
    kwargs = {
        **_geometry(hq, hkv),
        "qkv": wide[:, : (hq + 2 * hkv) * D],
        "q_out": torch.empty(T, hq, D, dtype=FP8_DTYPE),
        "q_scale": torch.empty(T + 3, hq),
        "positions": torch.zeros(T + 2, dtype=torch.int32),
        "slot_mapping": torch.full((T + 2,), -1, dtype=torch.int32),
        "cos_sin_cache": make_cos_sin_cache(D // 2, 64, dtype=torch.bfloat16),
        "q_norm_weight": torch.ones(D, dtype=torch.bfloat16),
        "k_norm_weight": torch.ones(D, dtype=torch.bfloat16),
        "norm_policy": QkNormPolicy.ROPE_THEN_NORM,
        "is_neox": False,
    }
    _call_past_validation(**kwargs)


def test_norm_weights_ignored_without_norm() -> None:
    # With no norm, absent or odd weights are not looked at.
    kwargs = _valid_call(norm_policy=NORM_NONE)
    kwargs.update(q_norm_weight=None, k_norm_weight=torch.ones(3), eps=0.0)
    _call_past_validation(**kwargs)


def test_zero_tokens_passes_validation() -> None:
    kwargs = _valid_call()
    kwargs.update(
        qkv=kwargs["qkv"][:0],
        q_out=kwargs["q_out"][:0],
        positions=kwargs["positions"][:0],
        slot_mapping=kwargs["slot_mapping"][:0],
    )
    _call_past_validation(**kwargs)


# ---------------------------------------------------------------------------
# Fake implementation (needs the library; no GPU)
# ---------------------------------------------------------------------------

needs_library = pytest.mark.skipif(
    not hpc_ops_available(),
    reason="the _hpc_C library is not built or could not be loaded",
)


def _op_args(kwargs: dict[str, Any]) -> tuple[Any, ...]:
    return (
        kwargs["qkv"],
        kwargs["positions"],
        kwargs["slot_mapping"],
        kwargs["cos_sin_cache"],
        kwargs["key_cache"],
        kwargs["value_cache"],
        kwargs["q_out"],
        kwargs["q_scale"],
        kwargs["q_norm_weight"],
        kwargs["k_norm_weight"],
        kwargs["k_scale"],
        kwargs["v_scale"],
        float(kwargs["eps"]),
        int(kwargs["norm_policy"]),
        bool(kwargs["is_neox"]),
    )


@needs_library
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_fake_impl_traces(fp8: bool) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    dtype = FP8_DTYPE if fp8 else torch.bfloat16
    real = _valid_call(cache_dtype=dtype, q_out_dtype=dtype)
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = {
            k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v
            for k, v in real.items()
        }
        assert torch.ops._hpc_C.rope_norm_store_kv(*_op_args(fake)) is None
        # The validation takes fake tensors just like real ones.
        checked_rope_norm_store_kv(**fake)
    assert fake["q_out"].shape == real["q_out"].shape


@needs_library
def test_fake_impl_under_make_fx() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    kwargs = _valid_call(cache_dtype=FP8_DTYPE, q_out_dtype=FP8_DTYPE)
    names = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]

    def fn(*tensors: torch.Tensor) -> None:
        checked_rope_norm_store_kv(
            **{**kwargs, **dict(zip(names, tensors, strict=True))}
        )

    graph = make_fx(fn, tracing_mode="fake")(*(kwargs[n] for n in names))
    targets = [str(node.target) for node in graph.graph.nodes]
    assert any("rope_norm_store_kv" in t for t in targets), targets


@needs_library
def test_schema_marks_mutated_arguments() -> None:
    schema = torch.ops._hpc_C.rope_norm_store_kv.default._schema
    mutated = {
        a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write
    }
    assert {"key_cache", "value_cache", "q_out"} <= mutated, schema
    assert "qkv" not in mutated, schema


# ---------------------------------------------------------------------------
# The reference itself
# ---------------------------------------------------------------------------


def test_rope_at_position_zero_is_identity() -> None:
    x = torch.randn(7, 3, 128)
    cache = make_cos_sin_cache(128, 16)
    for is_neox in (True, False):
        out = apply_rope(x, torch.zeros(7, dtype=torch.long), cache, is_neox)
        torch.testing.assert_close(out, x, rtol=0, atol=0)


def test_rope_four_channel_example() -> None:
    # rotary_dim 4: frequencies f0, f1. Row 1 has cos = (0, 1), sin = (1, 0):
    # f0 turns by 90 degrees, f1 does not turn.
    cache = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0]])
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])
    pos = torch.tensor([1])
    # NeoX pairs (x0, x2) with f0 and (x1, x3) with f1.
    neox = apply_rope(x, pos, cache, is_neox=True)
    assert neox.flatten().tolist() == [-3.0, 2.0, 1.0, 4.0]
    # GPT-J pairs (x0, x1) with f0 and (x2, x3) with f1.
    gptj = apply_rope(x, pos, cache, is_neox=False)
    assert gptj.flatten().tolist() == [-2.0, 1.0, 3.0, 4.0]


def test_neox_and_gptj_differ() -> None:
    x = torch.randn(5, 2, 64)
    pos = torch.arange(1, 6)
    cache = make_cos_sin_cache(64, 8)
    assert not torch.allclose(
        apply_rope(x, pos, cache, True), apply_rope(x, pos, cache, False)
    )


def test_partial_rotary_passes_tail_through() -> None:
    x = torch.randn(4, 2, 128)
    pos = torch.arange(4) + 3
    out = apply_rope(x, pos, make_cos_sin_cache(64, 8), True)
    torch.testing.assert_close(out[..., 64:], x[..., 64:], rtol=0, atol=0)
    assert not torch.allclose(out[..., :64], x[..., :64])


def test_rope_preserves_pair_norms() -> None:
    x = torch.randn(6, 4, 64, dtype=torch.float64)
    pos = torch.randint(0, 100, (6,))
    out = apply_rope(x, pos, make_cos_sin_cache(64, 100).double(), True)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))


def test_cos_sin_cache_matches_formula() -> None:
    cache = make_cos_sin_cache(8, 5, base=100.0)
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, 8, 2).double() / 8))
    angles = torch.arange(5).double()[:, None] * inv_freq
    expect = torch.cat((angles.cos(), angles.sin()), dim=-1)
    torch.testing.assert_close(cache.double(), expect, rtol=1e-6, atol=1e-6)


def test_rope_matches_vllm() -> None:
    common = pytest.importorskip("vllm.model_executor.layers.rotary_embedding.common")
    x = torch.randn(9, 3, 64)
    pos = torch.randint(0, 32, (9,))
    cache = make_cos_sin_cache(64, 32)
    cos, sin = cache[pos].chunk(2, dim=-1)
    for is_neox in (True, False):
        theirs = common.ApplyRotaryEmb.forward_static(x, cos, sin, is_neox)
        torch.testing.assert_close(apply_rope(x, pos, cache, is_neox), theirs)


def test_rms_norm() -> None:
    x = torch.randn(3, 4, 64) * 5
    w = torch.rand(64) + 0.5
    out = rms_norm(x, w, 1e-6)
    rms = (out / w).pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms), rtol=1e-5, atol=1e-5)
    assert rms_norm(x.bfloat16(), w, 1e-6).dtype == torch.float32


def test_norm_order_matters() -> None:
    inputs = make_prologue_inputs(
        num_tokens=6,
        num_q_heads=4,
        num_kv_heads=2,
        head_size=64,
        block_size=16,
        norm_policy=NORM_NORM_THEN_ROPE,
    )
    args = (
        inputs.qkv,
        inputs.positions,
        inputs.cos_sin_cache,
        4,
        2,
        64,
    )
    kw = {"q_norm_weight": inputs.q_norm_weight, "k_norm_weight": inputs.k_norm_weight}
    before = reference_prologue(*args, norm_policy=NORM_NORM_THEN_ROPE, **kw)
    after = reference_prologue(*args, norm_policy=NORM_ROPE_THEN_NORM, **kw)
    assert error_stats(before.q, after.q).rel > 1e-2
    assert error_stats(before.k, after.k).rel > 1e-2
    torch.testing.assert_close(before.v, after.v, rtol=0, atol=0)
    # With unit weights and full rotary, RoPE keeps the RMS, so the order
    # does not matter.
    ones = {"q_norm_weight": torch.ones(64), "k_norm_weight": torch.ones(64)}
    before = reference_prologue(*args, norm_policy=NORM_NORM_THEN_ROPE, **ones)
    after = reference_prologue(*args, norm_policy=NORM_ROPE_THEN_NORM, **ones)
    torch.testing.assert_close(before.q, after.q, rtol=1e-5, atol=1e-5)


def test_reference_splits_qkv_heads() -> None:
    inputs = make_prologue_inputs(
        num_tokens=3,
        num_q_heads=4,
        num_kv_heads=2,
        head_size=64,
        block_size=16,
    )
    ref = inputs.reference()
    x = inputs.qkv.float()
    assert ref.q.shape == (3, 4, 64) and ref.k.shape == ref.v.shape == (3, 2, 64)
    pos, cache = inputs.positions, inputs.cos_sin_cache
    q = apply_rope(x[:, : 4 * 64].reshape(3, 4, 64), pos, cache, True)
    k = apply_rope(x[:, 4 * 64 : 6 * 64].reshape(3, 2, 64), pos, cache, True)
    torch.testing.assert_close(ref.q, q, rtol=0, atol=0)
    torch.testing.assert_close(ref.k, k, rtol=0, atol=0)
    torch.testing.assert_close(ref.v.flatten(1), x[:, 6 * 64 :], rtol=0, atol=0)


def test_fp8_round_trip() -> None:
    x = torch.randn(64, 128) * 3
    scale = x.abs().amax() / FP8_MAX
    back = dequantize_fp8(quantize_fp8(x, scale), scale)
    # E4M3 keeps 3 mantissa bits: at most 2^-4 relative error per normal value.
    assert error_stats(back, x).rel < 3e-2
    tiny = 2.0**-9 * scale  # below the smallest subnormal step
    assert torch.all((back - x).abs() <= x.abs() * 2.0**-4 + tiny)
    # Saturation instead of Inf.
    assert quantize_fp8(torch.tensor([1e6, -1e6]), 1.0).float().tolist() == [
        FP8_MAX,
        -FP8_MAX,
    ]


def test_fp8_per_row_scales() -> None:
    q = torch.randn(5, 8, 128)
    q[2, 3] = 0.0
    q_fp8, scale = quantize_fp8_per_row(q)
    assert q_fp8.dtype == FP8_DTYPE and scale.shape == (5, 8)
    torch.testing.assert_close(scale, q.abs().amax(-1) / FP8_MAX)
    amax = q_fp8.float().abs().amax(-1)
    assert amax[2, 3] == 0 and scale[2, 3] == 0
    amax[2, 3] = FP8_MAX
    assert torch.all(amax == FP8_MAX)
    back = q_fp8.float() * scale.unsqueeze(-1)
    assert error_stats(back, q).rel < 3e-2


@pytest.mark.parametrize("layout", list(KvLayout))
@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8_DTYPE])
def test_cache_layouts_and_slot_writes(layout: KvLayout, dtype: torch.dtype) -> None:
    inputs = make_prologue_inputs(
        num_tokens=20,
        num_q_heads=4,
        num_kv_heads=2,
        head_size=64,
        block_size=16,
        cache_dtype=dtype,
        layout=layout,
        num_padding=4,
        num_blocks=3,
    )
    key_cache, value_cache = inputs.key_cache, inputs.value_cache
    assert key_cache.shape == value_cache.shape == (3, 16, 2, 64)
    assert key_cache.stride(-1) == 1
    if layout == KvLayout.HPC:
        assert inputs.kv_cache.shape == (3, 2, 16, 128)
        assert key_cache.stride(1) == 128  # K and V interleave per token
        assert value_cache.data_ptr() == key_cache.data_ptr() + 64 * dtype.itemsize
    else:
        assert inputs.kv_cache.shape == (2, 3, 16, 2, 64)
        assert value_cache.is_contiguous() and key_cache.is_contiguous()

    ref = inputs.reference()
    expect = expected_cache(inputs, ref)
    mask = written_mask(expect, layout, 64, inputs.slot_mapping, 20)
    assert int(mask.sum()) == 2 * 16 * 2 * 64  # 16 valid tokens, K and V
    assert torch.all(is_poison(expect) == ~mask)
    slots = inputs.slot_mapping[inputs.slot_mapping >= 0]
    keys, values = kv_views(expect, layout, 64)
    valid = inputs.slot_mapping >= 0
    if dtype == FP8_DTYPE:
        k = dequantize_fp8(read_slots(keys, slots), inputs.k_scale)
        v = dequantize_fp8(read_slots(values, slots), inputs.v_scale)
        assert error_stats(k, ref.k[valid]).rel < 3e-2
        assert error_stats(v, ref.v[valid]).rel < 3e-2
    else:
        k = read_slots(keys, slots).float()
        assert error_stats(k, ref.k[valid]).rel < 1e-2
        torch.testing.assert_close(
            read_slots(values, slots), ref.v[valid].bfloat16(), rtol=0, atol=0
        )


def test_outputs_start_poisoned() -> None:
    inputs = make_prologue_inputs(
        num_tokens=4,
        num_q_heads=4,
        num_kv_heads=1,
        head_size=64,
        block_size=16,
        cache_dtype=FP8_DTYPE,
        q_out_dtype=FP8_DTYPE,
    )
    assert inputs.q_scale is not None
    for t in (inputs.q_out, inputs.kv_cache, inputs.q_scale):
        assert torch.isnan(t.float()).all()
        assert is_poison(t).all()
