# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Small ``rope_norm_store_kv`` runs for compute-sanitizer: memcheck and
racecheck.

Run from the repository root, with it on ``PYTHONPATH`` (case names as
arguments run only those), for example::

    export PYTHONPATH=$PWD  # the helpers are imported as tests.kernels.hpc.*
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \\
        --error-exitcode 1 python tests/kernels/hpc/sanitizer_rope_norm.py

and the same under racecheck (``sanitizer_runner.py`` has the command lines
and the exit status). Each case is checked against the float32 reference
too.
"""

from __future__ import annotations

import sys
from types import ModuleType

import torch

from tests.kernels.hpc import sanitizer_runner
from tests.kernels.hpc.rope_norm_reference import (
    FP8_DTYPE,
    NORM_NONE,
    NORM_NORM_THEN_ROPE,
    NORM_ROPE_THEN_NORM,
    KvLayout,
    check_outputs,
    make_prologue_inputs,
)
from tests.kernels.hpc.sanitizer_runner import Case, Check
from tests.kernels.hpc.utils import import_hpc_validation

# Small, but each exercises a different path: both layouts, both RoPE
# styles, partial rotary, every norm policy, FP8 cache and Q, padding,
# the smallest block and a token count that is not a multiple of any tile.
# "name" names a case; the other entries go to make_prologue_inputs.
CASES: list[dict[str, object]] = [
    dict(
        name="bf16-d128-gqa8-bs16-hpc-norm-rope",
        num_tokens=37,
        num_q_heads=16,
        num_kv_heads=2,
        head_size=128,
        block_size=16,
        norm_policy=NORM_NORM_THEN_ROPE,
        layout=KvLayout.HPC,
        num_padding=3,
    ),
    dict(
        name="fp16-d64-gqa1-bs32-nhd-gptj-partial",
        num_tokens=37,
        num_q_heads=8,
        num_kv_heads=8,
        head_size=64,
        block_size=32,
        norm_policy=NORM_ROPE_THEN_NORM,
        layout=KvLayout.NHD,
        num_padding=5,
        is_neox=False,
        rotary_dim=32,
        dtype=torch.float16,
        norm_weight_dtype=torch.float16,
    ),
    dict(
        name="fp8-d256-gqa5-bs64-hpc-no-norm",
        num_tokens=37,
        num_q_heads=40,
        num_kv_heads=8,
        head_size=256,
        block_size=64,
        norm_policy=NORM_NONE,
        layout=KvLayout.HPC,
        num_padding=0,
        cache_dtype=FP8_DTYPE,
        q_out_dtype=FP8_DTYPE,
        index_dtype=torch.int32,
    ),
    dict(
        name="fp8-d128-gqa8-bs64-nhd-5-tokens",
        num_tokens=5,
        num_q_heads=64,
        num_kv_heads=8,
        head_size=128,
        block_size=64,
        norm_policy=NORM_NORM_THEN_ROPE,
        layout=KvLayout.NHD,
        num_padding=2,
        cache_dtype=FP8_DTYPE,
        q_out_dtype=FP8_DTYPE,
    ),
    # More tiles than two CTAs per SM on any Hopper part: every CTA cycles
    # through its ring of shared-memory stages more than once.
    dict(
        name="bf16-600-tokens-stage-ring",
        num_tokens=600,
        num_q_heads=64,
        num_kv_heads=8,
        head_size=128,
        block_size=64,
        norm_policy=NORM_NORM_THEN_ROPE,
        layout=KvLayout.HPC,
        num_padding=7,
    ),
]


def run_case(hpc_ops: ModuleType, case: Case, seed: int, check: Check) -> None:
    name = str(case["name"])
    kwargs = {key: value for key, value in case.items() if key != "name"}
    inputs = make_prologue_inputs(**kwargs, seed=seed, device="cuda")  # type: ignore[arg-type]
    qkv_before = inputs.qkv.clone()
    validation = import_hpc_validation()
    validation.validate_rope_norm_store_kv(*inputs.op_args(), **inputs.op_kwargs())
    hpc_ops.rope_norm_store_kv(*inputs.op_args(), **inputs.op_kwargs())
    torch.accelerator.synchronize()

    def verify() -> str:
        stats = check_outputs(inputs, qkv_before, name)
        return ", ".join(f"{what} {s}" for what, s in stats.items())

    check(name, verify)


if __name__ == "__main__":
    sys.exit(sanitizer_runner.main("sanitizer_rope_norm", __doc__, CASES, run_case))
