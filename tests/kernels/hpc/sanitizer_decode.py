# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Small split-KV decode runs (GPU planner, decode kernel, combine) for
compute-sanitizer: memcheck, racecheck and synccheck.

Run from the repository root, with it on ``PYTHONPATH`` (case names as
arguments run only those), for example::

    export PYTHONPATH=$PWD  # the helpers are imported as tests.kernels.hpc.*
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \\
        --error-exitcode 1 python tests/kernels/hpc/sanitizer_decode.py

and the same under the other tools (``sanitizer_runner.py`` has their
command lines and the exit status). Unused cache blocks and the slots past
each sequence hold NaN, and each case is checked against the float64
reference too.
"""

from __future__ import annotations

import sys
from types import ModuleType

import torch

from tests.kernels.hpc import sanitizer_runner
from tests.kernels.hpc.decode_reference import make_decode_inputs, read_decode_plan
from tests.kernels.hpc.sanitizer_runner import Case, Check
from tests.kernels.hpc.utils import (
    FP8_DTYPE,
    CacheLayout,
    import_attn_workspace,
    import_hpc_validation,
)

# Small, but each exercises a different path. "inputs" go to
# make_decode_inputs, "workspace" to DecodeWorkspace.create; "split" says
# whether the plan must split some sequence (so the partial buffers and the
# combine run).
CASES: list[dict[str, object]] = [
    # bf16, D=128, GQA 8, the smallest block; tile-edge lengths.
    dict(
        name="bf16-d128-gqa8-bs16",
        inputs=dict(
            lens=[1, 65, 300],
            num_q_heads=16,
            num_kv_heads=2,
            head_size=128,
            block_size=16,
        ),
        workspace=dict(),
        split=False,
    ),
    # FP8 cache and FP8 queries into an fp16 output, in the HPC layout.
    dict(
        name="fp8-kv-fp8-q",
        inputs=dict(
            lens=[70, 129, 5],
            num_q_heads=16,
            num_kv_heads=2,
            head_size=128,
            block_size=32,
            kv_dtype=FP8_DTYPE,
            q_dtype=FP8_DTYPE,
            out_dtype=torch.float16,
            layout=CacheLayout.HPC,
        ),
        workspace=dict(),
        split=False,
    ),
    # FP8 cache, bf16 queries (quantized by the kernel into two E4M3 terms):
    # 4 query tokens x GQA 8 = 32 rows, the warpgroups splitting them.
    dict(
        name="fp8-kv-bf16-q-rows32",
        inputs=dict(
            lens=[4, 129, 300],
            num_q_heads=16,
            num_kv_heads=2,
            head_size=128,
            block_size=32,
            kv_dtype=FP8_DTYPE,
            query_tokens=4,
            layout=CacheLayout.HPC,
        ),
        workspace=dict(),
        split=False,
    ),
    # The same with 4 query tokens x GQA 16 = 64 rows, D=64.
    dict(
        name="fp8-kv-fp16-q-rows64",
        inputs=dict(
            lens=[70, 5],
            num_q_heads=16,
            num_kv_heads=1,
            head_size=64,
            block_size=16,
            kv_dtype=FP8_DTYPE,
            q_dtype=torch.float16,
            out_dtype=torch.float16,
            query_tokens=4,
        ),
        workspace=dict(),
        split=False,
    ),
    # Four query tokens x GQA 4, fp16, stacked K/V tensor.
    dict(
        name="q4-gqa4-fp16",
        inputs=dict(
            lens=[4, 100, 257],
            num_q_heads=8,
            num_kv_heads=2,
            head_size=128,
            block_size=64,
            kv_dtype=torch.float16,
            query_tokens=4,
            layout=CacheLayout.STACKED,
        ),
        workspace=dict(),
        split=False,
    ),
    # Sliding window and soft-cap, D=64: the first tiles are skipped.
    dict(
        name="window-softcap-d64",
        inputs=dict(
            lens=[1, 150, 600],
            num_q_heads=8,
            num_kv_heads=2,
            head_size=64,
            block_size=16,
            window=100,
            softcap=30.0,
            scale=0.5,
            layout=CacheLayout.HPC,
        ),
        workspace=dict(),
        split=False,
    ),
    # Three CTAs over 38 tiles: sequences split across CTAs, partials and
    # the combine; an empty sequence gets zeros.
    dict(
        name="balanced-3-ctas",
        inputs=dict(
            lens=[700, 65, 0, 300, 1],
            num_q_heads=8,
            num_kv_heads=2,
            head_size=128,
            block_size=32,
        ),
        workspace=dict(num_ctas=3, min_split_len=64),
        split=True,
    ),
    # One unit in 20 pieces (more than the element-parallel merge takes):
    # the warp-per-row merge; 4 query tokens x GQA 8 = 32 rows.
    dict(
        name="many-pieces-q4",
        inputs=dict(
            lens=[2600],
            num_q_heads=8,
            num_kv_heads=1,
            head_size=128,
            block_size=16,
            query_tokens=4,
        ),
        workspace=dict(num_ctas=20, min_split_len=64),
        split=True,
    ),
    # Sixteen units over 20 CTAs in the HPC layout: CTAs walk several items
    # and merge several units; 32 rows, so the warpgroups take turns.
    dict(
        name="many-items-q4",
        inputs=dict(
            lens=[1300, 1300, 1300, 1300],
            num_q_heads=32,
            num_kv_heads=4,
            head_size=128,
            block_size=64,
            query_tokens=4,
            layout=CacheLayout.HPC,
        ),
        workspace=dict(num_ctas=20, min_split_len=64),
        split=True,
    ),
    # The static schedule: ceil(1200 / 512) = 3 pieces, one CTA each.
    dict(
        name="static-d256",
        inputs=dict(
            lens=[1200, 40],
            num_q_heads=8,
            num_kv_heads=1,
            head_size=256,
            block_size=16,
        ),
        workspace=dict(mode="STATIC"),
        split=True,
    ),
]


def run_case(hpc_ops: ModuleType, case: Case, seed: int, check: Check) -> None:
    name = str(case["name"])
    inputs = make_decode_inputs(**case["inputs"], seed=seed, device="cuda")  # type: ignore[arg-type]
    ws_kwargs = dict(case["workspace"])  # type: ignore[call-overload]
    if "mode" in ws_kwargs:
        ws_kwargs["mode"] = hpc_ops.SplitMode[ws_kwargs["mode"]]
    workspaces = import_attn_workspace()
    ws = workspaces.DecodeWorkspace.create(**inputs.workspace_kwargs(), **ws_kwargs)
    ws.plan(inputs.kv_lens, inputs.query_tokens)
    validation = import_hpc_validation()
    validation.validate_decode_attention(*inputs.op_args(), ws, **inputs.op_kwargs())
    hpc_ops.decode_attention(*inputs.op_args(), ws, **inputs.op_kwargs())
    torch.accelerator.synchronize()
    plan = read_decode_plan(ws)

    def verify() -> str:
        stats = inputs.check(name)
        if case["split"]:
            assert plan.num_partials > 0, f"{name}: the plan split nothing"
        return f"{stats} (CTAs {plan.num_ctas}, partial rows {plan.num_partials})"

    check(name, verify)


if __name__ == "__main__":
    sys.exit(sanitizer_runner.main("sanitizer_decode", __doc__, CASES, run_case))
