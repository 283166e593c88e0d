# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One W1 or W2 case of ``benchmark_hpc_decode`` run a few times, for a
profiler.

The case is built exactly as the benchmark builds it (cache layout, input
set, workspace and balanced plan); ``decode_attention`` then runs ``--runs``
times with nothing else on the stream, so a profiler can pick one launch of
the decode kernel (the plan is made once, before the runs; the name's
anchor leaves out the planner's ``plan_decode_kernel``), e.g.::

    ncu --clock-control none --kernel-name regex:^decode_kernel \\
        --launch-skip 1 --launch-count 1 --set full -o decode \\
        python benchmarks/kernels/profile_decode.py --case tp8-bf16

Without a profiler it prints each launch's time (CUDA events, L2 warm
after the first: a quick look, not the benchmark's protocol).
"""

from __future__ import annotations

import argparse
import sys

from bench_utils import import_hpc_ops, profiled_calls
from benchmark_hpc_decode import HpcDecode, all_cases, make_input_set, make_layout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", default="tp8-bf16", help="a W1 or W2 case name")
    parser.add_argument("--runs", type=int, default=3, help="kernel launches")
    args = parser.parse_args(argv)
    cases = {c.name: c for c in all_cases(False, True, {"W1", "W2"})}
    if args.case not in cases:
        parser.error(f"--case {args.case!r}: one of {', '.join(cases)}")
    case = cases[args.case]
    hpc_ops = import_hpc_ops()
    layout = make_layout(case)
    inputs = make_input_set(case, seed=0)
    run = HpcDecode(case, layout, hpc_ops, hpc_ops.SplitMode.BALANCED)
    profiled_calls("profile_decode", case.name, lambda: run(inputs), args.runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
