# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GPU tests of the fused FP8 MoE against the float64 reference.

Each case draws fresh random FP8 weights (per-expert or per-128x128-block
scales) and activations from seeded generators, NaN-poisons ``out``, runs
``fused_moe_fp8`` and checks (``moe_reference.check_moe``): no NaN or Inf,
||out - ref|| / ||ref|| <= 3e-2 over the whole output and, on every
token's row, <= 6e-2 or twice what rounding the intermediate to FP8 changes
in that row of the reference (where larger), tokens with no local expert
exactly zero (or exactly ``shared_output``), and the inputs unchanged.
The reference dequantizes the same FP8 values the kernel must use (it
quantizes 16-bit inputs and the intermediate by the contract's rules).

The axes are combined in grids rather than a full product: token counts {1,
3, 16, 64, 257, 4096} (up to 16: the decode path) x six (experts, top-k,
hidden, intermediate) shapes from E {8, 192}, k {1, 8}, H {2048, 4096}, I
{192, 768, 1536}, each with a per-tensor mode (static, per-token dynamic,
or FP8 input) and a block-wise one (16-bit or FP8 input) where I allows,
cycling routing (uniform, skewed), expert parallelism (none, a local range
through ``expert_offset``, a scattered ``expert_map``), ``shared_output``,
fp16 output, int64 ids and spare workspace rows. Then every quantization
mode x both EP kinds, ``apply_router_weight_on_input``, all tokens on the
same experts, padded rows, [1]-shaped scales; W3's Hy3 shapes (one rank of
tp8 and of ep8, and tp1) at prefill sizes {512, 1024, 2048, 4096} tokens,
uniform and skewed, per-tensor and block-wise; CUDA-graph capture and
replay (one graph per token count, one shared workspace; from 1 to 257
tokens, and from 64 to 4096 on W3's shapes), one workspace serving both
modes, writes staying inside ``out``, alignment errors, zero tokens, and
``torch.library.opcheck``.

Imports only torch, the references and ``vllm._hpc_ops``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from types import SimpleNamespace

import pytest
import torch

from tests.kernels.hpc.moe_reference import (
    EP_MODES,
    FP8_DTYPE,
    QUANT_MODES,
    MoeInputs,
    MoeWeights,
    make_moe_inputs,
    make_moe_weights,
    moe_workspace,
)
from tests.kernels.hpc.utils import bitwise_equal
from vllm._hpc_ops import fused_moe_fp8, moe_tiling
from vllm._hpc_ops_validation import validate_fused_moe_fp8

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
FP16 = torch.float16
TOKENS = (1, 3, 16, 64, 257, 4096)
PER_TENSOR = ("tensor-static", "tensor-dynamic", "tensor-fp8")
BLOCK_WISE = ("block", "block-fp8")


@dataclasses.dataclass(frozen=True)
class Shape:
    experts: int  # local
    topk: int
    hidden: int
    inter: int

    @property
    def id(self) -> str:
        return f"E{self.experts}k{self.topk}-H{self.hidden}-I{self.inter}"


SHAPES = (
    Shape(8, 1, 2048, 192),
    Shape(8, 8, 4096, 768),
    Shape(192, 8, 2048, 768),
    Shape(192, 1, 4096, 192),
    Shape(8, 8, 2048, 1536),
    Shape(192, 8, 4096, 1536),
)


@functools.lru_cache(maxsize=4)
def _weights(shape: Shape, block_wise: bool) -> MoeWeights:
    return make_moe_weights(
        shape.experts,
        shape.hidden,
        shape.inter,
        block_wise=block_wise,
        seed=shape.experts + shape.inter + block_wise,
        device="cuda",
    )


@dataclasses.dataclass(frozen=True)
class Case:
    tokens: int
    shape: Shape
    quant: str = "tensor-static"
    routing: str = "uniform"
    ep: str = "none"
    shared: bool = False
    dtype: torch.dtype = BF16  # 16-bit input and output dtype
    ids_dtype: torch.dtype = torch.int32
    ep_size: int = 4  # global experts = ep_size x local, with ``ep``
    weight_on_input: bool = False
    row_pad: int = 0
    scalar_shape: tuple[int, ...] = ()
    spare_tokens: int = 0

    @property
    def id(self) -> str:
        parts = [f"M{self.tokens}", self.shape.id, self.quant, self.routing]
        if self.ep != "none":
            size = "" if self.ep_size == 4 else str(self.ep_size)
            parts.append(f"ep{size}-{self.ep}")
        if self.shared:
            parts.append("shared")
        if self.dtype == FP16:
            parts.append("fp16")
        if self.ids_dtype == torch.int64:
            parts.append("i64")
        if self.weight_on_input:
            parts.append("w-on-input")
        if self.row_pad:
            parts.append(f"pad{self.row_pad}")
        if self.scalar_shape:
            parts.append("scale1")
        if self.spare_tokens:
            parts.append(f"spare{self.spare_tokens}")
        return "-".join(parts)

    @property
    def block_wise(self) -> bool:
        return QUANT_MODES[self.quant][0]

    def weights(self) -> MoeWeights:
        return _weights(self.shape, self.block_wise)

    def build(self, seed: int = 0, **overrides: object) -> MoeInputs:
        _, fp8_input, static_a1 = QUANT_MODES[self.quant]
        kwargs: dict[str, object] = dict(
            hidden_dtype=FP8_DTYPE if fp8_input else self.dtype,
            out_dtype=self.dtype,
            static_a1=static_a1,
            routing=self.routing,
            ep=self.ep,
            ep_size=self.ep_size,
            ids_dtype=self.ids_dtype,
            shared_output=self.shared,
            apply_router_weight_on_input=self.weight_on_input,
            scalar_shape=self.scalar_shape,
            row_pad=self.row_pad,
            seed=seed,
        )
        kwargs.update(overrides)
        tokens = kwargs.pop("tokens", self.tokens)
        return make_moe_inputs(
            self.weights(),
            tokens,  # type: ignore[arg-type]
            self.shape.topk,
            **kwargs,  # type: ignore[arg-type]
        )

    def workspace(self, max_tokens: int | None = None) -> SimpleNamespace:
        return moe_workspace(
            max_tokens=max_tokens or self.tokens + self.spare_tokens,
            topk=self.shape.topk,
            num_local_experts=self.shape.experts,
            hidden_size=self.shape.hidden,
            intermediate_size=self.shape.inter,
            device="cuda",
        )


def _run(inputs: MoeInputs, ws: SimpleNamespace) -> None:
    """Validates the arguments, then calls the op."""
    args = (*inputs.op_args(), ws)
    kwargs = {**inputs.op_kwargs(), "global_num_experts": inputs.num_global_experts}
    validate_fused_moe_fp8(*args, **kwargs)
    fused_moe_fp8(*args, **kwargs)


def _check(inputs: MoeInputs, what: str) -> None:
    print(what, inputs.check(what))


def _run_and_check(case: Case, seed: int = 0) -> MoeInputs:
    inputs = case.build(seed=seed)
    ws = case.workspace()
    before = {k: v.clone() for k, v in inputs.input_tensors().items()}
    inputs.poison_out()
    _run(inputs, ws)
    torch.accelerator.synchronize()
    for name, value in inputs.input_tensors().items():
        assert bitwise_equal(value, before[name]), f"{case.id}: {name} changed"
    _check(inputs, case.id)
    return inputs


# ---------------------------------------------------------------------------
# Case grids
# ---------------------------------------------------------------------------


def _grid_cases() -> list[Case]:
    """Every token count x every shape, each with a per-tensor mode and a
    block-wise one (a second per-tensor mode where I % 128 != 0), the other
    axes cycling."""
    cases = []
    for i, (shape, tokens) in enumerate(itertools.product(SHAPES, TOKENS)):
        block_ok = shape.inter % 128 == 0
        quants = (
            PER_TENSOR[i % 3],
            BLOCK_WISE[i % 2] if block_ok else PER_TENSOR[(i + 1) % 3],
        )
        for m, quant in enumerate(quants):
            j = 2 * i + m
            cases.append(
                Case(
                    tokens=tokens,
                    shape=shape,
                    quant=quant,
                    routing=("uniform", "skewed")[(j // 3) % 2],
                    ep=EP_MODES[(j + i // 3) % 3],
                    shared=j % 4 == 1,
                    dtype=FP16 if j % 7 == 3 else BF16,
                    ids_dtype=torch.int64 if j % 5 == 2 else torch.int32,
                    spare_tokens=29 if j % 6 == 5 else 0,
                )
            )
    return cases


EP_SHAPE = Shape(8, 8, 4096, 768)


def _ep_cases() -> list[Case]:
    """Every quantization mode with a local range and a scattered map."""
    cases = []
    for i, (quant, ep) in enumerate(itertools.product(QUANT_MODES, ("range", "map"))):
        cases.append(
            Case(
                tokens=257,
                shape=EP_SHAPE if i % 3 else Shape(192, 8, 2048, 768),
                quant=quant,
                ep=ep,
                routing=("skewed", "uniform")[i % 2],
                shared=i % 2 == 0,
                spare_tokens=3,
            )
        )
    return cases


def _feature_cases() -> list[Case]:
    k1 = Shape(8, 1, 2048, 768)
    wide = Shape(192, 8, 2048, 768)
    decode = Shape(8, 2, 2048, 256)
    return [
        # The router weight was applied to the input: the kernel uses 1.
        Case(tokens=64, shape=k1, quant="tensor-static", weight_on_input=True),
        Case(
            tokens=257,
            shape=k1,
            quant="tensor-dynamic",
            weight_on_input=True,
            ep="map",
            shared=True,
        ),
        Case(tokens=257, shape=k1, quant="block", weight_on_input=True),
        Case(
            tokens=3,
            shape=k1,
            quant="block-fp8",
            weight_on_input=True,
            ids_dtype=torch.int64,
        ),
        # The decode path (few experts x few 8-column chunks): every token on
        # the same experts, so an expert has 16 columns (two MMA tiles);
        # block-wise (a 1x128 group quantized by the last of its 16 CTAs)
        # with 16-bit and FP8 input; fp16 with a map and a shared output.
        Case(tokens=16, shape=decode, quant="tensor-dynamic", routing="single"),
        Case(tokens=16, shape=decode, quant="block-fp8", routing="single"),
        Case(tokens=5, shape=decode, quant="block", ep="map", shared=True),
        Case(tokens=1, shape=decode, quant="block", dtype=FP16),
        Case(tokens=2, shape=decode, quant="tensor-static", ep="range"),
        # 17 tokens, all on the same experts: the grouped path.
        Case(tokens=17, shape=EP_SHAPE, quant="block", routing="single"),
        Case(tokens=4096, shape=wide, quant="block", routing="single"),
        Case(tokens=4096, shape=wide, quant="tensor-fp8", routing="single"),
        Case(tokens=257, shape=EP_SHAPE, quant="block-fp8", routing="single", ep="map"),
        # Rows longer than H (views of wider buffers).
        Case(
            tokens=257, shape=EP_SHAPE, quant="tensor-static", row_pad=64, shared=True
        ),
        Case(tokens=64, shape=EP_SHAPE, quant="tensor-fp8", row_pad=16),
        Case(
            tokens=257,
            shape=EP_SHAPE,
            quant="block-fp8",
            row_pad=128,
            shared=True,
            ep="range",
        ),
        # H % 256 == 128: the down GEMM's last row block ends half past H, so
        # its second warpgroup's rows are stored nowhere; slot tiles, narrow
        # routed tiles and wide ones.
        Case(tokens=16, shape=Shape(192, 8, 1152, 256), quant="tensor-static"),
        Case(tokens=300, shape=Shape(192, 8, 1152, 256), quant="block", shared=True),
        Case(tokens=300, shape=Shape(8, 8, 1152, 256), quant="tensor-dynamic"),
        # One-element scales shaped [1].
        Case(tokens=64, shape=EP_SHAPE, quant="tensor-fp8", scalar_shape=(1,)),
        Case(tokens=257, shape=EP_SHAPE, quant="tensor-static", scalar_shape=(1,)),
        # fp16 inputs and outputs.
        Case(tokens=257, shape=wide, quant="tensor-dynamic", dtype=FP16, shared=True),
        Case(tokens=64, shape=wide, quant="block", dtype=FP16, ep="map"),
    ]


# W3's Hy3 experts (H 4096, 192 experts, top-8, expert intermediate 1536):
# one rank of tp8 (I 192; block-wise, vLLM loads whole 128-row checkpoint
# blocks, so I 256 as in the benchmark), one rank of ep8 (24 of the 192
# experts, I 1536) and tp1 (all 192, I 1536).
W3_SHAPES = {
    "tp8": (Shape(192, 8, 4096, 192), Shape(192, 8, 4096, 256)),
    "ep8": (Shape(24, 8, 4096, 1536),) * 2,
    "tp1": (Shape(192, 8, 4096, 1536),) * 2,
}
LARGE_TOKENS = (512, 1024, 2048, 4096)
# W3's two modes: static per-tensor, and block-wise with 1x128 input groups.
W3_QUANTS = ("tensor-static", "block")


def _w3_case(tp: str, tokens: int, quant: str, **fields: object) -> Case:
    """A W3 shape; ep8 as 24 local experts of 192 global ones."""
    shape = W3_SHAPES[tp][QUANT_MODES[quant][0]]
    if tp == "ep8":
        fields = {"ep": "range", "ep_size": 8, **fields}
    return Case(tokens=tokens, shape=shape, quant=quant, **fields)  # type: ignore[arg-type]


def _large_cases() -> list[Case]:
    """W3's shapes at prefill sizes, uniform and skewed, in both W3 modes;
    ep8 alternates the local range and a scattered map so that each token
    count, routing and mode meets both. The float64 reference of the whole
    output stays affordable even at 4096 tokens x tp1: about 1.2 TFLOP of
    float64 GEMMs per pass (two passes per check), a fraction of a second
    on the H200's FP64 tensor cores, with about 1 GB of float64
    temporaries at most (one expert's dequantized weights and, skewed, the
    hot expert's 4096 rows)."""
    cases = []
    for tp in W3_SHAPES:
        for t, tokens in enumerate(LARGE_TOKENS):
            for r, routing in enumerate(("uniform", "skewed")):
                for q, quant in enumerate(W3_QUANTS):
                    ep = ("range", "map")[(t + r + q) % 2]
                    extra = {"ep": ep} if tp == "ep8" else {}
                    cases.append(_w3_case(tp, tokens, quant, routing=routing, **extra))
    return cases


def _sorted(cases: list[Case]) -> list[Case]:
    """Cases sharing weights run together (the weight cache holds four)."""
    return sorted(cases, key=lambda c: (c.shape.experts, c.shape.hidden, c.shape.inter))


def _params(cases: list[Case]) -> list[object]:
    return [pytest.param(case, id=case.id) for case in _sorted(cases)]


@pytest.mark.parametrize("case", _params(_grid_cases()))
def test_grid(case: Case) -> None:
    _run_and_check(case)


@pytest.mark.parametrize("case", _params(_ep_cases()))
def test_expert_parallel(case: Case) -> None:
    _run_and_check(case)


@pytest.mark.parametrize("case", _params(_feature_cases()))
def test_features(case: Case) -> None:
    _run_and_check(case)


@pytest.mark.parametrize("case", _params(_large_cases()))
def test_large_batch(case: Case) -> None:
    _run_and_check(case)


def test_case_ids_are_unique() -> None:
    cases = _grid_cases() + _ep_cases() + _feature_cases() + _large_cases()
    ids = [case.id for case in cases]
    assert len(ids) == len(set(ids))
    assert len(_large_cases()) == len(W3_SHAPES) * len(LARGE_TOKENS) * 2 * 2
    assert 100 <= len(ids) <= 160


def test_cases_cover_every_tiling() -> None:
    """The cases reach every token tile of the grouped GEMMs, 8-token tiles
    with and without split K and at two and three CTAs per SM, gate-up and
    down-GEMM CTAs of one and of several blocks, and the decode path (the
    tiling of this GPU)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tilings = [
        moe_tiling(
            c.tokens,
            c.shape.topk,
            c.shape.experts,
            c.shape.experts,
            c.shape.hidden,
            c.shape.inter,
            sms,
            c.block_wise,
        )
        for c in _grid_cases() + _ep_cases() + _feature_cases() + _large_cases()
    ]
    assert {t.token_tile for t in tilings} == {8, 16, 32, 64, 96, 128}
    assert any(t.gate_up_split > 1 for t in tilings)
    assert any(t.token_tile == 8 and t.gate_up_split == 1 for t in tilings)
    assert {t.down_group == 1 for t in tilings} == {True, False}
    assert {t.gate_up_group == 1 for t in tilings} == {True, False}
    # 8-token tiles at two and at three CTAs per SM, in both GEMMs.
    grouped_8 = [t for t in tilings if t.token_tile == 8 and not t.decode]
    assert {t.gate_up_ctas_per_sm for t in grouped_8} == {2, 3}
    assert {t.down_ctas_per_sm for t in grouped_8} == {2, 3}
    assert {t.decode for t in tilings} == {True, False}
    assert {t.gate_up_rows for t in tilings} == {128, 192}
    # The grouped path with and without the route stage.
    assert {t.slot_tiles for t in tilings if not t.decode} == {True, False}


# ---------------------------------------------------------------------------
# Workspace, bounds, alignment
# ---------------------------------------------------------------------------


def test_workspace_serves_every_mode() -> None:
    """One workspace (sized for the largest call) serves per-tensor and
    block-wise calls of several token counts, one after another."""
    shape = Shape(8, 8, 2048, 768)
    ws = Case(tokens=300, shape=shape).workspace()
    for seed, (tokens, quant) in enumerate(
        ((257, "tensor-fp8"), (64, "block"), (3, "tensor-dynamic"), (300, "block-fp8"))
    ):
        case = Case(tokens=tokens, shape=shape, quant=quant, ep="map")
        inputs = case.build(seed=seed)
        _run(inputs, ws)
        torch.accelerator.synchronize()
        _check(inputs, f"shared workspace {case.id}")


@pytest.mark.parametrize("quant", ["tensor-static", "block-fp8"])
def test_writes_stay_inside_out(quant: str) -> None:
    """``out`` is a view inside a NaN buffer with a guard row above and
    below and 64 spare columns: only the view is written."""
    case = Case(tokens=64, shape=Shape(8, 8, 2048, 768), quant=quant, shared=True)
    inputs = case.build()
    m, h = inputs.out.shape
    big = torch.full((m + 2, h + 64), float("nan"), dtype=BF16, device="cuda")
    inputs.out = big[1 : m + 1, :h]
    _run(inputs, case.workspace())
    torch.accelerator.synchronize()
    _check(inputs, case.id)
    assert bool(big[0].isnan().all()) and bool(big[m + 1].isnan().all())
    assert bool(big[:, h:].isnan().all())


def test_zero_tokens() -> None:
    case = Case(tokens=0, shape=Shape(8, 8, 2048, 768), quant="block")
    inputs = case.build()
    _run(inputs, case.workspace(max_tokens=8))
    torch.accelerator.synchronize()
    assert inputs.out.shape == (0, 2048)


@pytest.mark.parametrize("name", ["hidden_states", "out", "shared_output"])
def test_misaligned_rows_are_rejected(name: str) -> None:
    """A view starting 2 bytes into its buffer is refused by name."""
    case = Case(tokens=8, shape=Shape(8, 8, 2048, 768), shared=True)
    inputs = case.build()
    t = getattr(inputs, name)
    m, h = t.shape
    buf = torch.zeros(m * h + 8, dtype=t.dtype, device="cuda")
    setattr(inputs, name, buf[1 : 1 + m * h].view(m, h))
    with pytest.raises(ValueError, match=f"{name} must start on a 16-byte"):
        _run(inputs, case.workspace())


def test_wrong_device_is_rejected() -> None:
    case = Case(tokens=8, shape=Shape(8, 8, 2048, 768))
    inputs = case.build()
    inputs.topk_ids = inputs.topk_ids.cpu()
    with pytest.raises(ValueError, match="topk_ids is on cpu"):
        _run(inputs, case.workspace())


# ---------------------------------------------------------------------------
# CUDA graphs
# ---------------------------------------------------------------------------

GRAPH_TOKENS = (1, 3, 16, 64, 257)
# From a mid-size tiling across the prefill sizes, on W3's shapes.
LARGE_GRAPH_TOKENS = (64, *LARGE_TOKENS)
_GRAPH_CASES = [
    (Case(tokens=257, shape=Shape(8, 8, 2048, 768), quant="block"), GRAPH_TOKENS),
    (
        Case(
            tokens=257,
            shape=Shape(192, 8, 2048, 768),
            quant="tensor-static",
            ep="map",
            shared=True,
        ),
        GRAPH_TOKENS,
    ),
    (
        Case(
            tokens=257,
            shape=Shape(8, 8, 4096, 768),
            quant="block-fp8",
            ep="range",
            ids_dtype=torch.int64,
        ),
        GRAPH_TOKENS,
    ),
    (
        Case(tokens=257, shape=Shape(8, 1, 2048, 192), quant="tensor-dynamic"),
        GRAPH_TOKENS,
    ),
    (_w3_case("tp8", 4096, "tensor-static"), LARGE_GRAPH_TOKENS),
    (_w3_case("tp8", 4096, "block"), LARGE_GRAPH_TOKENS),
    (_w3_case("ep8", 4096, "block", ep="map"), LARGE_GRAPH_TOKENS),
    (_w3_case("tp1", 4096, "tensor-static"), LARGE_GRAPH_TOKENS),
]


@pytest.mark.parametrize(
    "case, graph_tokens",
    [pytest.param(c, tokens, id=c.id) for c, tokens in _GRAPH_CASES],
)
def test_cuda_graph_replay(case: Case, graph_tokens: tuple[int, ...]) -> None:
    """One graph per token count, all sharing one workspace sized for the
    largest; each replayed twice (in two interleaved rounds) with new
    activations, routing, scales and expert map."""
    ws = case.workspace(max_tokens=max(graph_tokens))
    graphs = []
    for tokens in graph_tokens:
        static = case.build(seed=tokens, tokens=tokens)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            _run(static, ws)  # warm up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        torch.accelerator.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _run(static, ws)
        graphs.append((tokens, static, graph))

    for replay, routing in enumerate(("skewed", "uniform")):
        for tokens, static, graph in graphs:
            fresh = case.build(
                seed=1000 * (replay + 1) + tokens, tokens=tokens, routing=routing
            )
            fresh.copy_into(static)
            static.poison_out()
            graph.replay()
            torch.accelerator.synchronize()
            _check(static, f"{case.id} graph M={tokens} replay {replay}")


# ---------------------------------------------------------------------------
# opcheck
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("quant", ["tensor-static", "block-fp8"])
def test_opcheck(quant: str) -> None:
    case = Case(tokens=17, shape=Shape(8, 8, 2048, 768), quant=quant, ep="map")
    inputs = case.build()
    ws = case.workspace()
    kw = inputs.op_kwargs()
    args = (
        inputs.hidden_states,
        inputs.a1_scale,
        inputs.weights.w13,
        inputs.weights.w13_scale,
        inputs.weights.w2,
        inputs.weights.w2_scale,
        inputs.a2_scale,
        inputs.topk_weights,
        inputs.topk_ids,
        inputs.expert_map,
        inputs.shared_output,
        inputs.out,
        ws.buffer,
        kw["expert_offset"],
        inputs.num_global_experts,
        case.block_wise,
        False,
    )
    # The schema check compares tensors with arithmetic that float8 lacks.
    torch.library.opcheck(
        torch.ops._hpc_C.fused_moe_fp8.default,
        args,
        test_utils=(
            "test_autograd_registration",
            "test_faketensor",
            "test_aot_dispatch_dynamic",
        ),
    )
