# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Small ``rope_norm_store_kv`` runs for compute-sanitizer.

Run from the repository root, for example::

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \\
        --error-exitcode 1 python tests/kernels/sanitizer_rope_norm.py
    compute-sanitizer --tool racecheck --error-exitcode 1 \\
        python tests/kernels/sanitizer_rope_norm.py

(Without the caching allocator every tensor is its own allocation, so
memcheck sees out-of-bounds accesses that would otherwise land in pooled
memory.) Each case is checked against the float32 reference too; the script
exits 1 on a mismatch, or when no sm90 GPU or no ``_hpc_C`` library is
present.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from rope_norm_reference import (
    FP8_DTYPE,
    NORM_NONE,
    NORM_NORM_THEN_ROPE,
    NORM_ROPE_THEN_NORM,
    KvLayout,
    check_outputs,
    import_hpc_ops,
    make_prologue_inputs,
)

REPO_ROOT = Path(__file__).resolve().parents[2]

# Small, but each exercises a different path: both layouts, both RoPE
# styles, partial rotary, every norm policy, FP8 cache and Q, padding,
# the smallest block and a token count that is not a multiple of any tile.
CASES: list[dict[str, object]] = [
    dict(
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


def main() -> int:
    if not torch.cuda.is_available():
        print("sanitizer_rope_norm: no CUDA GPU is available")
        return 1
    if torch.cuda.get_device_capability() != (9, 0):
        name = torch.cuda.get_device_name()
        print(f"sanitizer_rope_norm: needs an sm90 GPU, not {name}")
        return 1
    hpc_ops = import_hpc_ops(REPO_ROOT)
    if not hpc_ops.hpc_ops_available():
        print("sanitizer_rope_norm: the _hpc_C library is not built or not loadable")
        return 1

    failures = 0
    for i, case in enumerate(CASES):
        inputs = make_prologue_inputs(**case, seed=i, device="cuda")  # type: ignore[arg-type]
        qkv_before = inputs.qkv.clone()
        hpc_ops.rope_norm_store_kv(*inputs.op_args(), **inputs.op_kwargs())
        torch.cuda.synchronize()
        try:
            stats = check_outputs(inputs, qkv_before, f"case {i}")
        except AssertionError as err:
            failures += 1
            print(f"FAIL case {i}: {err}")
        else:
            summary = ", ".join(f"{name} {s}" for name, s in stats.items())
            print(f"ok   case {i}: {summary}")
    if failures:
        print(f"sanitizer_rope_norm: {failures} of {len(CASES)} cases failed")
        return 1
    print(f"sanitizer_rope_norm: all {len(CASES)} cases passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
