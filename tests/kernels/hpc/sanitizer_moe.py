# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Small fused FP8 MoE runs (routing, input quantization, both grouped
GEMMs, the top-k reduction, and the decode path) for compute-sanitizer:
memcheck, racecheck, synccheck and initcheck.

Run from the repository root, with it on ``PYTHONPATH`` (case names as
arguments run only those), for example::

    export PYTHONPATH=$PWD  # the helpers are imported as tests.kernels.hpc.*
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \\
        --error-exitcode 1 python tests/kernels/hpc/sanitizer_moe.py

and the same under the other tools (``sanitizer_runner.py`` has their
command lines and the exit status). ``out`` holds NaN before each run, and
each case is checked against the float64 reference; the ``_hpc_C`` library
must have the MoE op.
"""

from __future__ import annotations

import functools
import sys
from types import ModuleType

import torch

from tests.kernels.hpc import sanitizer_runner
from tests.kernels.hpc.moe_reference import (
    FP8_DTYPE,
    make_moe_inputs,
    make_moe_weights,
    moe_workspace,
)
from tests.kernels.hpc.sanitizer_runner import Case, Check
from tests.kernels.hpc.utils import import_hpc_validation

# Small, but each exercises a different path. "weights" go to
# make_moe_weights, "inputs" to make_moe_inputs; "spare" extra workspace
# rows past the call's tokens.
CASES: list[dict[str, object]] = [
    # Per-tensor static scales, bf16 input quantized inside; I = 192 is not
    # a multiple of 128 (a partial 128-column tile of GEMM 2's K); a
    # scattered expert map and a shared output.
    dict(
        name="tensor-static-map-shared",
        weights=dict(
            num_experts=8, hidden_size=256, intermediate_size=192, block_wise=False
        ),
        inputs=dict(num_tokens=37, topk=2, ep="map", ep_size=2, shared_output=True),
        spare=5,
    ),
    # Block-wise with FP8 input and [M, H/128] scales; a local range through
    # expert_offset, int64 ids, rows padded past H.
    dict(
        name="block-fp8-range-padded",
        weights=dict(
            num_experts=4, hidden_size=512, intermediate_size=256, block_wise=True
        ),
        inputs=dict(
            num_tokens=70,
            topk=3,
            hidden_dtype=FP8_DTYPE,
            ep="range",
            ep_size=2,
            ep_rank=1,
            ids_dtype=torch.int64,
            row_pad=16,
            shared_output=True,
        ),
        spare=0,
    ),
    # Per-token dynamic quantization of fp16 input, one expert per token
    # with the router weight already applied, skewed routing (5 tokens: the
    # decode path).
    dict(
        name="tensor-dynamic-fp16-weight-on-input",
        weights=dict(
            num_experts=16, hidden_size=384, intermediate_size=128, block_wise=False
        ),
        inputs=dict(
            num_tokens=5,
            topk=1,
            hidden_dtype=torch.float16,
            static_a1=False,
            routing="skewed",
            apply_router_weight_on_input=True,
        ),
        spare=11,
    ),
    # 24 tokens on 8 experts, one each: the gate-up GEMM splits its K over
    # CTAs (8-token tiles, split partials and the last-CTA merge), block-wise.
    dict(
        name="block-split-k",
        weights=dict(
            num_experts=8, hidden_size=2048, intermediate_size=256, block_wise=True
        ),
        inputs=dict(num_tokens=24, topk=1),
        spare=3,
    ),
    # The decode path (up to 16 tokens): every token on the same two
    # experts, so an owner CTA takes 16 columns (two MMA tiles); FP8 input
    # with 1x128 scales, a scattered map, a shared output.
    dict(
        name="decode-block-fp8-single",
        weights=dict(
            num_experts=8, hidden_size=512, intermediate_size=256, block_wise=True
        ),
        inputs=dict(
            num_tokens=16,
            topk=2,
            hidden_dtype=FP8_DTYPE,
            routing="single",
            ep="map",
            ep_size=2,
            shared_output=True,
        ),
        spare=2,
    ),
    # The decode path with a bf16 input, block-wise: the gate-up CTAs
    # quantize their token columns in 1x128 groups themselves, and the last
    # CTA of each 128-column group quantizes the intermediate.
    dict(
        name="decode-block-bf16",
        weights=dict(
            num_experts=8, hidden_size=512, intermediate_size=256, block_wise=True
        ),
        inputs=dict(num_tokens=3, topk=2),
        spare=1,
    ),
    # Many tiles and a short K (I = 128): a down CTA takes all four row
    # blocks of its tile, the stage ring running on across them, each
    # block's epilogue beside the next one's loads.
    dict(
        name="tensor-static-down-groups",
        weights=dict(
            num_experts=192, hidden_size=1024, intermediate_size=128, block_wise=False
        ),
        inputs=dict(num_tokens=512, topk=8),
        spare=0,
    ),
    # ~2.7 rows on each of 192 experts: 8-token tiles, more of them than
    # two CTAs per SM hold, so both GEMMs run three CTAs per SM with two
    # stages each; block-wise.
    dict(
        name="block-three-ctas-per-sm",
        weights=dict(
            num_experts=192, hidden_size=1024, intermediate_size=256, block_wise=True
        ),
        inputs=dict(num_tokens=64, topk=8),
        spare=0,
    ),
    # The same tiles per-tensor: accumulated in place, each k-block's
    # wgmma waited for and its stage released at once (two stages).
    dict(
        name="tensor-three-ctas-per-sm",
        weights=dict(
            num_experts=192, hidden_size=1024, intermediate_size=256, block_wise=False
        ),
        inputs=dict(num_tokens=64, topk=8),
        spare=0,
    ),
    # ~25 rows per expert, per-tensor: 32-token tiles, two CTAs per SM
    # with two stages each in both GEMMs.
    dict(
        name="tensor-paired-32-token-tiles",
        weights=dict(
            num_experts=8, hidden_size=512, intermediate_size=256, block_wise=False
        ),
        inputs=dict(num_tokens=100, topk=2),
        spare=0,
    ),
    # The same tiles block-wise: one CTA per SM, an instantiation that holds
    # the block-wise fold alone.
    dict(
        name="block-32-token-tiles",
        weights=dict(
            num_experts=8, hidden_size=512, intermediate_size=256, block_wise=True
        ),
        inputs=dict(num_tokens=100, topk=2),
        spare=0,
    ),
    # ~50 rows per expert, block-wise: 64-token tiles, each k-block's
    # product into one of two block accumulators while the other is folded
    # with the token scales the producer copied into its stage.
    dict(
        name="block-64-token-tiles",
        weights=dict(
            num_experts=8, hidden_size=512, intermediate_size=256, block_wise=True
        ),
        inputs=dict(num_tokens=200, topk=2),
        spare=0,
    ),
    # ~50 rows per expert, per-tensor: 64-token tiles, the gate-up GEMM's
    # CTAs two per SM with one column block each, staging their epilogue in
    # their stage buffers.
    dict(
        name="tensor-paired-64-token-tiles",
        weights=dict(
            num_experts=8, hidden_size=512, intermediate_size=256, block_wise=False
        ),
        inputs=dict(num_tokens=200, topk=2),
        spare=0,
    ),
    # ~75 rows per expert, per-tensor: 96-token tiles (scaled once after
    # the mainloop), the last tile of each expert partial.
    dict(
        name="tensor-dynamic-wide-tiles",
        weights=dict(
            num_experts=4, hidden_size=512, intermediate_size=256, block_wise=False
        ),
        inputs=dict(num_tokens=150, topk=2, static_a1=False),
        spare=0,
    ),
    # H % 256 == 128 on the grouped path: each down tile's last row block
    # ends half past H (its second warpgroup's rows are not stored); ~60
    # rows per expert, 64-token tiles.
    dict(
        name="tensor-static-half-row-block",
        weights=dict(
            num_experts=8, hidden_size=640, intermediate_size=256, block_wise=False
        ),
        inputs=dict(num_tokens=240, topk=2),
        spare=0,
    ),
    # The same block-wise, with 64-token tiles (the overlapped fold) and with
    # 16-token ones (slot tiles): the second warpgroup of a last row block
    # has no rows and no weight scale block.
    dict(
        name="block-half-row-block",
        weights=dict(
            num_experts=8, hidden_size=640, intermediate_size=256, block_wise=True
        ),
        inputs=dict(num_tokens=240, topk=2),
        spare=0,
    ),
    dict(
        name="block-half-row-block-narrow",
        weights=dict(
            num_experts=8, hidden_size=640, intermediate_size=256, block_wise=True
        ),
        inputs=dict(num_tokens=40, topk=2),
        spare=0,
    ),
    # ~75 rows on each of 96 experts and I = 576: 96-token tiles with
    # 192-row gate-up warpgroups (three column blocks, 288 CTAs: two waves
    # on an H200), the epilogue staged in the stages.
    dict(
        name="tensor-wide-warpgroups",
        weights=dict(
            num_experts=96, hidden_size=512, intermediate_size=576, block_wise=False
        ),
        inputs=dict(num_tokens=900, topk=8),
        spare=0,
    ),
    # ~120 rows per expert: 128-token tiles, the widest.
    dict(
        name="tensor-static-widest-tiles",
        weights=dict(
            num_experts=4, hidden_size=512, intermediate_size=256, block_wise=False
        ),
        inputs=dict(num_tokens=240, topk=2),
        spare=0,
    ),
]


def run_case(hpc_ops: ModuleType, case: Case, seed: int, check: Check) -> None:
    name = str(case["name"])
    weights = make_moe_weights(
        **case["weights"],  # type: ignore[arg-type]
        seed=seed,
        device="cuda",
    )
    inputs_kwargs = dict(case["inputs"])  # type: ignore[call-overload]
    num_tokens = inputs_kwargs.pop("num_tokens")
    topk = inputs_kwargs.pop("topk")
    inputs = make_moe_inputs(weights, num_tokens, topk, seed=seed, **inputs_kwargs)
    max_tokens = num_tokens + int(case["spare"])  # type: ignore[call-overload]
    ws = moe_workspace(**inputs.workspace_kwargs(max_tokens))
    tiling = hpc_ops.moe_tiling(
        num_tokens,
        topk,
        weights.w13.shape[0],
        inputs.num_global_experts,
        weights.w13.shape[2],
        weights.w2.shape[2],
        torch.cuda.get_device_properties(0).multi_processor_count,
        weights.block_wise,
    )

    def verify(label: str) -> str:
        stats = inputs.check(label)
        idle = int(inputs.unrouted().sum())
        return f"{stats} (tokens with no local expert: {idle}; {tiling})"

    # Twice on one workspace: the second run finds the split-K counters the
    # first one left behind.
    args = (*inputs.op_args(), ws)
    kwargs = {**inputs.op_kwargs(), "global_num_experts": inputs.num_global_experts}
    import_hpc_validation().validate_fused_moe_fp8(*args, **kwargs)
    for run in range(2):
        inputs.poison_out()
        hpc_ops.fused_moe_fp8(*args, **kwargs)
        torch.accelerator.synchronize()
        label = f"{name} run {run}"
        check(label, functools.partial(verify, label))


if __name__ == "__main__":
    sys.exit(
        sanitizer_runner.main(
            "sanitizer_moe", __doc__, CASES, run_case, required_op="fused_moe_fp8"
        )
    )
