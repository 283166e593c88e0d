# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Small paged prefill runs (GPU planner and prefill kernel) for
compute-sanitizer: memcheck, racecheck, synccheck and initcheck.

Run from the repository root, with it on ``PYTHONPATH`` (case names as
arguments run only those), for example::

    export PYTHONPATH=$PWD  # the helpers are imported as tests.kernels.hpc.*
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \\
        --error-exitcode 1 python tests/kernels/hpc/sanitizer_prefill.py

and the same under the other tools (``sanitizer_runner.py`` has their
command lines and the exit status). Spare cache blocks and the slots past
each request's KV length hold NaN, ``out`` holds NaN before the run, and
each case is checked against the float64 reference too; the ``_hpc_C``
library must have the prefill op.
"""

from __future__ import annotations

import sys
from types import ModuleType

import torch

from tests.kernels.hpc import sanitizer_runner
from tests.kernels.hpc.prefill_reference import make_prefill_inputs
from tests.kernels.hpc.sanitizer_runner import Case, Check
from tests.kernels.hpc.utils import (
    FP8_DTYPE,
    CacheLayout,
    import_attn_workspace,
    import_hpc_validation,
)


def _case(
    name: str,
    lens: list[tuple[int, int]],
    heads: tuple[int, int],
    head_size: int,
    block_size: int,
    **options: object,
) -> dict[str, object]:
    """A case whose ``inputs`` go to make_prefill_inputs: ``lens`` are
    (q_len, kv_len) pairs, the first kv_len - q_len keys being cached
    context; ``heads`` is (Hq, Hkv)."""
    return dict(
        name=name,
        inputs=dict(
            lens=lens,
            num_q_heads=heads[0],
            num_kv_heads=heads[1],
            head_size=head_size,
            block_size=block_size,
            **options,
        ),
    )


# Small, but each exercises a different path.
CASES: list[dict[str, object]] = [
    # bf16, D=128, GQA 8 (16-token tiles), the smallest block; 1, 65 and 300
    # query tokens after contexts.
    _case("bf16-d128-gqa8-bs16", [(1, 100), (65, 65), (300, 700)], (16, 2), 128, 16),
    # fp16, D=64, GQA 1, the largest block, HPC layout; sliding window and
    # soft-cap: the first key tiles of the long rows are skipped.
    _case(
        "fp16-d64-gqa1-bs64-window-softcap",
        [(1, 150), (100, 600), (64, 64)],
        (4, 4),
        64,
        64,
        kv_dtype=torch.float16,
        layout=CacheLayout.HPC,
        window=100,
        softcap=30.0,
        scale=0.5,
    ),
    # FP8 cache and FP8 queries (per-token-per-head scales) into an fp16
    # output, D=256, GQA 5 (25 tokens in 125 rows), stacked K/V tensor.
    _case(
        "fp8-kv-fp8-q-d256-gqa5-bs32",
        [(70, 70), (129, 200), (5, 300)],
        (10, 2),
        256,
        32,
        kv_dtype=FP8_DTYPE,
        q_dtype=FP8_DTYPE,
        out_dtype=torch.float16,
        layout=CacheLayout.STACKED,
    ),
    # FP8 cache with bf16 queries off the FP8 grid (quantized per row in the
    # kernel), D=128, GQA 8, HPC layout: V^T from the raw ring, partial last
    # key tiles.
    _case(
        "fp8-kv-bf16-q-d128-gqa8-bs64",
        [(1, 200), (130, 130), (64, 1000)],
        (16, 2),
        128,
        64,
        kv_dtype=FP8_DTYPE,
        layout=CacheLayout.HPC,
        q_on_fp8_grid=False,
    ),
    # FP8 cache with fp16 queries, D=64 (64-byte rows), GQA 4, soft-cap.
    _case(
        "fp8-kv-fp16-q-d64-gqa4-bs16-softcap",
        [(33, 33), (200, 500)],
        (8, 2),
        64,
        16,
        kv_dtype=FP8_DTYPE,
        q_dtype=torch.float16,
        softcap=30.0,
    ),
]


def run_case(hpc_ops: ModuleType, case: Case, seed: int, check: Check) -> None:
    name = str(case["name"])
    inputs = make_prefill_inputs(**case["inputs"], seed=seed, device="cuda")  # type: ignore[arg-type]
    workspaces = import_attn_workspace()
    ws = workspaces.PrefillWorkspace.create(**inputs.workspace_kwargs())
    inputs.poison_out()
    ws.plan(inputs.query_start_loc, inputs.seq_lens)
    validation = import_hpc_validation()
    validation.validate_prefill_attention(*inputs.op_args(), ws, **inputs.op_kwargs())
    hpc_ops.prefill_attention(*inputs.op_args(), ws, **inputs.op_kwargs())
    torch.accelerator.synchronize()

    def verify() -> str:
        return str(inputs.check(name))

    check(name, verify)


if __name__ == "__main__":
    sys.exit(
        sanitizer_runner.main(
            "sanitizer_prefill",
            __doc__,
            CASES,
            run_case,
            required_op="prefill_attention",
        )
    )
