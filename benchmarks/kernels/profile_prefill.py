# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One W5 case of ``benchmark_hpc_prefill`` run a few times, for a profiler.

The case is built exactly as the benchmark builds it (cache layout, input
set, workspace and plan); the prefill kernel then runs ``--runs`` times with
nothing else on the stream, so a profiler can pick one launch, e.g.::

    ncu --clock-control none --kernel-name regex:prefill_kernel \\
        --launch-skip 1 --launch-count 1 --set full -o prefill \\
        python benchmarks/kernels/profile_prefill.py --case tp1-fp8-c8192
"""

from __future__ import annotations

import argparse
import sys

import torch
from bench_utils import import_hpc_ops
from benchmark_hpc_prefill import (
    BLOCK_SIZE,
    all_cases,
    make_hpc,
    make_input_set,
    make_layout,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", default="tp1-fp8-c8192", help="a W5 case name")
    parser.add_argument("--runs", type=int, default=3, help="kernel launches")
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    args = parser.parse_args(argv)
    cases = {c.name: c for c in all_cases(args.block_size)}
    if args.case not in cases:
        parser.error(f"--case {args.case!r}: one of {', '.join(cases)}")
    case = cases[args.case]
    layout = make_layout(case)
    inputs = make_input_set(case, seed=0)
    run = make_hpc(case, layout, import_hpc_ops(), inputs)
    for _ in range(args.runs):
        run(inputs)
    torch.accelerator.synchronize()
    print(f"profile_prefill: {case.name}, {args.runs} launches")
    return 0


if __name__ == "__main__":
    sys.exit(main())
