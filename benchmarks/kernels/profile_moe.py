# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One W3 case of ``benchmark_hpc_moe`` run a few times, for a profiler.

The case is built exactly as the benchmark builds it (routing, activations,
one weight set and the workspace); ``fused_moe_fp8`` then runs ``--runs``
times with nothing else on the stream, so a profiler can pick the launches
of one call, e.g. the second call's two grouped GEMMs (gate-up, then down;
calls of up to 16 tokens may take the decode kernels instead)::

    ncu --clock-control none --kernel-name regex:moe_gemm_kernel \\
        --launch-skip 2 --launch-count 2 --set full -o moe \\
        python benchmarks/kernels/profile_moe.py --case tp8-pertensor-t4096

Without a profiler it prints each call's time (CUDA events, L2 warm after
the first: a quick look, not the benchmark's protocol).
"""

from __future__ import annotations

import argparse
import sys

import torch
from bench_utils import import_hpc_ops, profiled_calls
from benchmark_hpc_moe import InputSet, WeightCache, all_cases, make_hpc, make_problem


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", default="tp8-pertensor-t4096", help="a W3 case name")
    parser.add_argument("--runs", type=int, default=3, help="calls of the op")
    args = parser.parse_args(argv)
    cases = {c.name: c for c in all_cases()}
    if args.case not in cases:
        parser.error(f"--case {args.case!r}: one of {', '.join(cases)}")
    case = cases[args.case]
    problem = make_problem(case)
    weights = WeightCache().get(case, 1)[0]
    inputs = InputSet(weights=weights, out=torch.empty_like(problem.hidden))
    run = make_hpc(case, problem, import_hpc_ops())
    profiled_calls("profile_moe", case.name, lambda: run(inputs), args.runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
