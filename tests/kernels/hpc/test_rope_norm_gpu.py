# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GPU tests of ``rope_norm_store_kv`` against the float32 reference.

Each case draws fresh random inputs, NaN-poisons ``q_out``, ``q_scale`` and
the whole KV cache, runs the kernel and checks (see
``rope_norm_reference.check_outputs``): Q and K within 1e-2 relative
(per tensor; 2e-2 per head row) for bf16/fp16, FP8 within 3e-2 dequantized,
V bit-exact in a model-dtype cache, Q scales within 1e-2 of ``amax / 448``,
no NaN or Inf, and every cache element outside the valid slots untouched.

The parameter axes are combined in a few small grids rather than a full
cartesian product: features (dtype, RoPE style, norm policy and weight
dtype, partial rotary), shapes (head counts, head size, block size, layout),
token counts with and without padding, and FP8 cache / FP8 Q. Plus CUDA-graph
capture and replay, and ``torch.library.opcheck``.

Imports only torch, the reference and ``vllm._hpc_ops``.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from tests.kernels.hpc.rope_norm_reference import (
    FP8_DTYPE,
    NORM_NONE,
    NORM_NORM_THEN_ROPE,
    NORM_ROPE_THEN_NORM,
    KvLayout,
    PrologueInputs,
    check_outputs,
    kv_views,
    make_prologue_inputs,
)
from vllm._hpc_ops import rope_norm_store_kv
from vllm._hpc_ops_validation import validate_rope_norm_store_kv

pytestmark = pytest.mark.gpu

HEADS = ((8, 1), (64, 8), (32, 4), (16, 16), (40, 8))
HEAD_SIZES = (64, 128, 256)
BLOCK_SIZES = (16, 32, 64)
TOKENS = (1, 63, 64, 65, 1000)
LAYOUTS = (KvLayout.HPC, KvLayout.NHD)


@dataclasses.dataclass(frozen=True)
class Case:
    num_tokens: int = 65
    heads: tuple[int, int] = (32, 4)
    head_size: int = 128
    block_size: int = 64
    dtype: torch.dtype = torch.bfloat16
    is_neox: bool = True
    norm_policy: int = NORM_NORM_THEN_ROPE
    model_dtype_weights: bool = False
    half_rotary: bool = False
    layout: KvLayout = KvLayout.HPC
    num_padding: int = -1  # -1: about a tenth of the tokens
    fp8_cache: bool = False
    fp8_q: bool = False
    int32_indices: bool = False
    model_dtype_cos_sin: bool = False
    qkv_row_padding: int = 0

    @property
    def id(self) -> str:
        name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[self.dtype]
        parts = [
            f"t{self.num_tokens}",
            f"h{self.heads[0]}x{self.heads[1]}",
            f"d{self.head_size}",
            f"b{self.block_size}",
            name,
            "neox" if self.is_neox else "gptj",
            f"norm{self.norm_policy}",
            self.layout.value,
        ]
        if self.norm_policy and self.model_dtype_weights:
            parts.append("wmodel")
        if self.half_rotary:
            parts.append("rot-half")
        if self.num_padding >= 0:
            parts.append(f"pad{self.num_padding}")
        if self.fp8_cache:
            parts.append("kv-fp8")
        if self.fp8_q:
            parts.append("q-fp8")
        if self.int32_indices:
            parts.append("i32")
        if self.model_dtype_cos_sin:
            parts.append("cs-model")
        if self.qkv_row_padding:
            parts.append("qkv-strided")
        return "-".join(parts)

    def build(self, seed: int = 0, **overrides: object) -> PrologueInputs:
        num_padding = self.num_padding
        if num_padding < 0:
            num_padding = self.num_tokens // 10
        kwargs: dict[str, object] = dict(
            num_tokens=self.num_tokens,
            num_q_heads=self.heads[0],
            num_kv_heads=self.heads[1],
            head_size=self.head_size,
            block_size=self.block_size,
            dtype=self.dtype,
            cache_dtype=FP8_DTYPE if self.fp8_cache else self.dtype,
            q_out_dtype=FP8_DTYPE if self.fp8_q else self.dtype,
            rotary_dim=self.head_size // 2 if self.half_rotary else self.head_size,
            norm_policy=self.norm_policy,
            norm_weight_dtype=self.dtype if self.model_dtype_weights else torch.float32,
            is_neox=self.is_neox,
            layout=self.layout,
            num_padding=num_padding,
            cos_sin_dtype=self.dtype if self.model_dtype_cos_sin else torch.float32,
            index_dtype=torch.int32 if self.int32_indices else torch.int64,
            qkv_row_padding=self.qkv_row_padding,
            seed=seed,
            device="cuda",
        )
        kwargs.update(overrides)
        return make_prologue_inputs(**kwargs)  # type: ignore[arg-type]


def _feature_cases() -> list[Case]:
    """The dtype x RoPE style x norm policy/weight dtype x full/half rotary."""
    policies = (
        (NORM_NONE, False),
        (NORM_ROPE_THEN_NORM, False),
        (NORM_ROPE_THEN_NORM, True),
        (NORM_NORM_THEN_ROPE, False),
        (NORM_NORM_THEN_ROPE, True),
    )
    cases = []
    for i, (dtype, is_neox, (policy, model_w), half) in enumerate(
        itertools.product(
            (torch.bfloat16, torch.float16), (True, False), policies, (False, True)
        )
    ):
        cases.append(
            Case(
                dtype=dtype,
                is_neox=is_neox,
                norm_policy=policy,
                model_dtype_weights=model_w,
                half_rotary=half,
                layout=LAYOUTS[(is_neox + policy + half) % 2],
                int32_indices=i % 3 == 0,
                model_dtype_cos_sin=i % 4 == 1,
                qkv_row_padding=64 if i % 5 == 2 else 0,
            )
        )
    return cases


def _shape_cases() -> list[Case]:
    """Every head count x head size, in both layouts, cycling block sizes
    and token counts."""
    cases = []
    for i, ((heads, head_size), layout) in enumerate(
        itertools.product(itertools.product(HEADS, HEAD_SIZES), LAYOUTS)
    ):
        cases.append(
            Case(
                heads=heads,
                head_size=head_size,
                layout=layout,
                block_size=BLOCK_SIZES[i % 3],
                num_tokens=TOKENS[(i // 2) % 5],
                is_neox=i % 4 != 3,
            )
        )
    return cases


def _token_cases() -> list[Case]:
    """Token counts around a 64-token tile, with no padding and with a
    quarter of the tokens padded."""
    cases = []
    for i, (num_tokens, layout, padded) in enumerate(
        itertools.product(TOKENS, LAYOUTS, (False, True))
    ):
        cases.append(
            Case(
                num_tokens=num_tokens,
                heads=(64, 8),
                layout=layout,
                block_size=BLOCK_SIZES[i % 3],
                num_padding=(num_tokens + 3) // 4 if padded else 0,
            )
        )
    return cases


def _fp8_cases() -> list[Case]:
    """FP8 cache and/or FP8 Q over head counts and head sizes."""
    modes = ((True, True), (True, False), (False, True))
    heads = ((64, 8), (8, 1), (40, 8))
    policies = (NORM_NORM_THEN_ROPE, NORM_NONE, NORM_ROPE_THEN_NORM)
    cases = []
    for i, ((fp8_cache, fp8_q), h, head_size) in enumerate(
        itertools.product(modes, heads, HEAD_SIZES)
    ):
        cases.append(
            Case(
                fp8_cache=fp8_cache,
                fp8_q=fp8_q,
                heads=h,
                head_size=head_size,
                num_tokens=TOKENS[i % 5],
                block_size=BLOCK_SIZES[i % 3],
                layout=LAYOUTS[i % 2],
                norm_policy=policies[i % 3],
                is_neox=i % 4 != 1,
                dtype=torch.float16 if i % 7 == 3 else torch.bfloat16,
                half_rotary=i % 5 == 4,
            )
        )
    return cases


def _params(cases: list[Case]) -> list[object]:
    return [pytest.param(case, id=case.id) for case in cases]


def _run(inputs: PrologueInputs) -> None:
    """Validates the arguments, then calls the op."""
    validate_rope_norm_store_kv(*inputs.op_args(), **inputs.op_kwargs())
    rope_norm_store_kv(*inputs.op_args(), **inputs.op_kwargs())


def _run_and_check(case: Case) -> None:
    inputs = case.build()
    qkv_before = inputs.qkv.clone()
    _run(inputs)
    torch.accelerator.synchronize()
    stats = check_outputs(inputs, qkv_before, case.id)
    print(case.id, {name: str(s) for name, s in stats.items()})


@pytest.mark.parametrize("case", _params(_feature_cases()))
def test_features(case: Case) -> None:
    _run_and_check(case)


@pytest.mark.parametrize("case", _params(_shape_cases()))
def test_shapes(case: Case) -> None:
    _run_and_check(case)


@pytest.mark.parametrize("case", _params(_token_cases()))
def test_tokens_and_padding(case: Case) -> None:
    _run_and_check(case)


@pytest.mark.parametrize("case", _params(_fp8_cases()))
def test_fp8(case: Case) -> None:
    _run_and_check(case)


def test_case_ids_are_unique() -> None:
    cases = _feature_cases() + _shape_cases() + _token_cases() + _fp8_cases()
    ids = [case.id for case in cases]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize(
    "case",
    _params(
        [
            Case(num_tokens=64, heads=(64, 8), num_padding=6),
            Case(
                num_tokens=33,
                heads=(8, 1),
                layout=KvLayout.NHD,
                block_size=16,
                fp8_cache=True,
                fp8_q=True,
                num_padding=3,
                is_neox=False,
            ),
        ]
    ),
)
def test_cuda_graph_replay(case: Case) -> None:
    """Capture once, then replay with new qkv, positions and slots."""
    static = case.build(seed=0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _run(static)  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.accelerator.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _run(static)

    for seed in (1, 2, 3):
        fresh = case.build(seed=seed)
        static.qkv.copy_(fresh.qkv)
        static.positions.copy_(fresh.positions)
        static.slot_mapping.copy_(fresh.slot_mapping)
        static.poison_outputs()
        graph.replay()
        torch.accelerator.synchronize()
        check_outputs(static, fresh.qkv, f"{case.id} replay {seed}")


def _separate_caches(inputs: PrologueInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous, non-aliasing copies of the K and V views."""
    key_cache, value_cache = kv_views(inputs.kv_cache, inputs.layout, inputs.head_size)
    return key_cache.contiguous(), value_cache.contiguous()


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_opcheck(fp8: bool) -> None:
    case = Case(num_tokens=17, heads=(8, 2), block_size=16, fp8_cache=fp8, fp8_q=fp8)
    inputs = case.build()
    key_cache, value_cache = _separate_caches(inputs)
    args = (
        inputs.qkv,
        inputs.positions,
        inputs.slot_mapping,
        inputs.cos_sin_cache,
        key_cache,
        value_cache,
        inputs.q_out,
        inputs.q_scale,
        inputs.q_norm_weight,
        inputs.k_norm_weight,
        inputs.k_scale,
        inputs.v_scale,
        inputs.eps,
        inputs.norm_policy,
        inputs.is_neox,
    )
    test_utils: tuple[str, ...] = (
        "test_schema",
        "test_autograd_registration",
        "test_faketensor",
        "test_aot_dispatch_dynamic",
    )
    if fp8:
        # The schema check compares tensors with arithmetic that float8 lacks.
        test_utils = test_utils[1:]
    torch.library.opcheck(
        torch.ops._hpc_C.rope_norm_store_kv.default, args, test_utils=test_utils
    )


def test_interleaved_views_do_not_clobber_each_other() -> None:
    """In the HPC layout K and V share each row: writing one must leave the
    other half of the row alone, also for the last head and block."""
    case = Case(num_tokens=64, heads=(8, 8), block_size=16, num_padding=0)
    inputs = case.build(num_blocks=4)  # every slot of the cache is written
    qkv_before = inputs.qkv.clone()
    _run(inputs)
    torch.accelerator.synchronize()
    check_outputs(inputs, qkv_before, case.id)
    assert not torch.isnan(inputs.kv_cache.float()).any()
