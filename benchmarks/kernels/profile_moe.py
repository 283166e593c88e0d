# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""W3 cases of ``benchmark_hpc_moe`` run a few times each, for a profiler.

Each case is built exactly as the benchmark builds it (routing, activations,
one weight set and the workspace); ``fused_moe_fp8`` then runs ``--runs``
times with nothing else on the stream, so a profiler can pick the launches
of one call, e.g. the second call's two grouped GEMMs (gate-up, then down;
calls of up to 16 tokens may take the decode kernels instead)::

    ncu --clock-control none --kernel-name regex:moe_gemm_kernel \\
        --launch-skip 2 --launch-count 2 --set full -o moe \\
        python benchmarks/kernels/profile_moe.py --case tp8-pertensor-t4096

Without a profiler it prints each call's time (CUDA events, L2 warm after
the first: a quick look, not the benchmark's protocol); ``--kernels``
prints each stage's kernel time per call instead (torch profiler), for
several cases in one process with ``--case a,b``.
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch
from bench_utils import import_hpc_ops, kernel_times, profiled_calls
from benchmark_hpc_moe import InputSet, WeightCache, all_cases, make_hpc, make_problem


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--case", default="tp8-pertensor-t4096", help="W3 case names, comma-separated"
    )
    parser.add_argument("--runs", type=int, default=3, help="calls of the op")
    parser.add_argument(
        "--kernels",
        action="store_true",
        help="each kernel's device time per call (torch profiler)",
    )
    args = parser.parse_args(argv)
    cases = {c.name: c for c in all_cases()}
    names = args.case.split(",")
    unknown = [n for n in names if n not in cases]
    if unknown:
        parser.error(f"--case {','.join(unknown)!r}: one of {', '.join(cases)}")
    hpc_ops = import_hpc_ops()
    for name in names:
        case = cases[name]
        problem = make_problem(case)
        weights = WeightCache().get(case, 1)[0]
        inputs = InputSet(weights=weights, out=torch.empty_like(problem.hidden))
        run = make_hpc(case, problem, hpc_ops)
        measure = kernel_times if args.kernels else profiled_calls
        measure("profile_moe", case.name, functools.partial(run, inputs), args.runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
