# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fail when the built _hpc_C library is not on torch's stable C ABI.

The rule is the one vLLM 0.33.0's CI applies to its own extensions
(.buildkite/check-torch-abi.py): torch-abi-audit reads a library's undefined
dynamic symbols, and a library that uses torch is torch-unstable when any of
them names libtorch's C++ internals (``at::``, ``c10::``, ``torch::`` outside
``torch::stable`` and ``torch::headeronly``) instead of the stable C shims
alone. vLLM allows two ROCm libraries to be unstable; nothing is allowed
here. A library that cannot be inspected, or that uses no torch symbol at all
(its ops would not register), fails too.

    python tools/check_torch_abi.py              # vllm/_hpc_C.abi3.so
    python tools/check_torch_abi.py LIBRARY ...

Exit codes: 0 every library is torch-stable, 1 one is not, 2 one could not be
checked (missing, unreadable, or torch-abi-audit not installed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_LIBRARY = REPO_ROOT / "vllm" / "_hpc_C.abi3.so"
# Offending symbols printed per library; the rest are counted.
SHOWN_SYMBOLS = 10


def problem(lib: Any) -> str | None:
    """Why ``lib`` (a torch_abi_audit ExtensionReport) is not torch-stable,
    or None when it is."""
    if lib.error is not None:
        return f"could not be inspected: {lib.error}"
    if not lib.torch.uses_torch:
        return "uses no torch symbol, so it registers no op"
    if not lib.torch.stable:
        symbols = lib.torch.unstable_symbols
        shown = "".join(f"\n    {s}" for s in symbols[:SHOWN_SYMBOLS])
        more = len(symbols) - SHOWN_SYMBOLS
        tail = f"\n    ... and {more} more" if more > 0 else ""
        return (
            f"references {len(symbols)} symbols outside torch's stable ABI:"
            f"{shown}{tail}"
        )
    return None


def display(path: Path) -> str:
    try:
        return path.resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return str(path)


def check(paths: list[Path]) -> int:
    try:
        from torch_abi_audit import inspect_package
    except ImportError:
        print(
            "error: torch-abi-audit is not installed (pip install -r "
            "requirements/test.txt)",
            file=sys.stderr,
        )
        return 2

    status = 0
    for path in paths:
        name = display(path)
        if not path.is_file():
            print(f"error: {name} not found; build it first", file=sys.stderr)
            status = 2
            continue
        report = inspect_package(path)
        if report.error:
            print(f"error: failed to inspect {name}: {report.error}", file=sys.stderr)
            status = 2
            continue
        for lib in (*report.extensions, *report.bundled_libs):
            reason = problem(lib)
            if reason is None:
                print(
                    f"{name}: torch-stable "
                    f"({lib.torch.stable_shim_count} stable shim symbols)"
                )
                continue
            print(f"Not allowed: {name} {reason}", file=sys.stderr)
            status = max(status, 2 if lib.error is not None else 1)
    if status == 0:
        print("Torch stable ABI check passed.")
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "libraries",
        nargs="*",
        type=Path,
        default=[DEFAULT_LIBRARY],
        help=f"libraries to audit (default: {display(DEFAULT_LIBRARY)})",
    )
    return check(parser.parse_args(argv).libraries)


if __name__ == "__main__":
    sys.exit(main())
