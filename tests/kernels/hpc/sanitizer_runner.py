# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the compute-sanitizer scripts ``sanitizer_<op>.py`` share.

Run a script from the repository root, with it on ``PYTHONPATH``, under each
tool its docstring names, for example::

    export PYTHONPATH=$PWD  # the helpers are imported as tests.kernels.hpc.*
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \\
        --error-exitcode 1 python tests/kernels/hpc/sanitizer_moe.py
    compute-sanitizer --tool racecheck --error-exitcode 1 \\
        python tests/kernels/hpc/sanitizer_moe.py
    compute-sanitizer --tool synccheck --error-exitcode 1 \\
        python tests/kernels/hpc/sanitizer_moe.py
    compute-sanitizer --tool initcheck --error-exitcode 1 \\
        python tests/kernels/hpc/sanitizer_moe.py

and likewise ``sanitizer_decode.py``, ``sanitizer_prefill.py`` and
``sanitizer_rope_norm.py``. Case names as arguments run only those cases
(racecheck is slow); ``--help`` lists them.

(Without the caching allocator every tensor is its own allocation, so
memcheck sees out-of-bounds accesses that would otherwise land in pooled
memory.) Every case is also checked against its float reference. A script
exits 1 when a check fails, when a case name is unknown, or when no sm90
GPU or no ``_hpc_C`` library (with the script's op) is present.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType

import torch

from tests.kernels.hpc.utils import import_hpc_ops

Case = Mapping[str, object]
Check = Callable[[str, Callable[[], str]], None]
RunCase = Callable[[ModuleType, Case, int, Check], None]


class Checks:
    """The ``check`` callback: runs ``verify``, prints ``ok`` with its
    summary or ``FAIL`` with the assertion's message, and counts."""

    def __init__(self) -> None:
        self.count = 0
        self.failures = 0

    def __call__(self, label: str, verify: Callable[[], str]) -> None:
        self.count += 1
        try:
            summary = verify()
        except AssertionError as err:
            self.failures += 1
            print(f"FAIL {label}: {err}")
        else:
            print(f"ok   {label}: {summary}")


def load_hpc_ops(required_op: str | None = None) -> tuple[ModuleType | None, str]:
    """``(vllm._hpc_ops, "")`` when the cases can run here, else
    ``(None, why not)``. ``required_op``: an op ``torch.ops._hpc_C`` must
    have."""
    if not torch.cuda.is_available():
        return None, "no CUDA GPU is available"
    if torch.cuda.get_device_capability() != (9, 0):
        return None, f"needs an sm90 GPU, not {torch.cuda.get_device_name()}"
    hpc_ops = import_hpc_ops()
    if not hpc_ops.hpc_ops_available():
        return None, "the _hpc_C library is not built or not loadable"
    if required_op is not None and not hasattr(torch.ops._hpc_C, required_op):
        return None, f"the _hpc_C library with {required_op} is not built"
    return hpc_ops, ""


def parse_case_names(
    script: str,
    description: str | None,
    names: Sequence[str],
    argv: Sequence[str] | None = None,
) -> list[str]:
    """The case names given on the command line (none: all cases)."""
    parser = argparse.ArgumentParser(
        prog=f"{script}.py",
        description=description,
        epilog=f"{__doc__}\ncases: {', '.join(names)}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "cases", nargs="*", metavar="case", help="run only these cases (default: all)"
    )
    return list(parser.parse_args(argv).cases)


def main(
    script: str,
    description: str | None,
    cases: Sequence[Case],
    run_case: RunCase,
    *,
    required_op: str | None = None,
    argv: Sequence[str] | None = None,
) -> int:
    """Runs the cases named on the command line (default: all) in list
    order and returns the exit status: 0 when every check passed, else 1.

    ``cases``: dicts with a ``"name"``. ``run_case(hpc_ops, case, seed,
    check)`` runs one case (``seed``: its index in ``cases``) and hands each
    result to ``check(label, verify)``, where ``verify()`` asserts and
    returns a one-line summary. ``description``: the script's docstring, for
    ``--help``.
    """
    names = [str(case["name"]) for case in cases]
    if len(set(names)) != len(names):
        raise ValueError(f"{script}: case names repeat: {names}")
    selected = set(parse_case_names(script, description, names, argv))
    unknown = selected - set(names)
    if unknown:
        print(f"{script}: unknown cases {sorted(unknown)}; known: {', '.join(names)}")
        return 1
    hpc_ops, problem = load_hpc_ops(required_op)
    if hpc_ops is None:
        print(f"{script}: {problem}")
        return 1

    checks = Checks()
    runs = 0
    for seed, case in enumerate(cases):
        if selected and case["name"] not in selected:
            continue
        runs += 1
        run_case(hpc_ops, case, seed, checks)
    if checks.failures:
        print(f"{script}: {checks.failures} of {checks.count} checks failed")
        return 1
    print(f"{script}: all {runs} cases passed")
    return 0
