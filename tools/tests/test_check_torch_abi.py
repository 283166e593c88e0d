# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""tools/check_torch_abi.py: the stable-ABI verdict on reports and on the
built library."""

from __future__ import annotations

from pathlib import Path

import pytest
from patchset_tool import load_tool

audit = pytest.importorskip("torch_abi_audit")
tool = load_tool("check_torch_abi")

STABLE = ["aoti_torch_get_sizes", "torch_library_impl", "cudaLaunchKernel"]
UNSTABLE = [*STABLE, *(f"c10::detail::f{i}()" for i in range(12))]


def _report(path: Path, symbols: list[str], error: str | None = None):
    return audit.ExtensionReport(
        path=path,
        cpython=audit.CPythonABIVerdict(intent=True, compliant=True),
        torch=audit.torch_abi.classify_symbols(symbols),
        error=error,
    )


@pytest.fixture
def library(tmp_path: Path) -> Path:
    path = tmp_path / "_hpc_C.abi3.so"
    path.write_bytes(b"")
    return path


def _audit_returns(monkeypatch, report) -> None:
    package = audit.PackageReport(
        name="x", root=report.path.parent, extensions=(report,)
    )
    monkeypatch.setattr(audit, "inspect_package", lambda _path: package)


def test_stable_library_passes(library, monkeypatch, capsys) -> None:
    _audit_returns(monkeypatch, _report(library, STABLE))
    assert tool.main([str(library)]) == 0
    out = capsys.readouterr().out
    assert "torch-stable (2 stable shim symbols)" in out
    assert "Torch stable ABI check passed." in out


def test_unstable_library_fails_naming_its_symbols(
    library, monkeypatch, capsys
) -> None:
    _audit_returns(monkeypatch, _report(library, UNSTABLE))
    assert tool.main([str(library)]) == 1
    err = capsys.readouterr().err
    assert "Not allowed:" in err
    assert "references 12 symbols outside torch's stable ABI" in err
    assert "c10::detail::f9()" in err
    assert "c10::detail::f10()" not in err
    assert "... and 2 more" in err


def test_library_without_torch_fails(library, monkeypatch, capsys) -> None:
    _audit_returns(monkeypatch, _report(library, ["cudaLaunchKernel"]))
    assert tool.main([str(library)]) == 1
    assert "uses no torch symbol" in capsys.readouterr().err


def test_uninspectable_library_cannot_be_checked(library, monkeypatch) -> None:
    _audit_returns(monkeypatch, _report(library, [], error="nm failed"))
    assert tool.main([str(library)]) == 2


def test_missing_library_cannot_be_checked(tmp_path, capsys) -> None:
    assert tool.main([str(tmp_path / "_hpc_C.abi3.so")]) == 2
    assert "not found" in capsys.readouterr().err


@pytest.mark.skipif(
    not tool.DEFAULT_LIBRARY.is_file(), reason="the _hpc_C library is not built"
)
def test_built_library_is_torch_stable(capsys) -> None:
    assert tool.main([]) == 0, capsys.readouterr().err
