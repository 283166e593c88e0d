# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tests for tools/apply_patchset.py, on small copies of the installed vLLM."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
TOOL_PATH = REPO_ROOT / "tools" / "apply_patchset.py"


def _load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("apply_patchset", TOOL_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


tool = _load_tool()

# Upstream files the relied-on checks read, relative to the vllm package.
CHECKED = [rel for rel, _, _ in tool.UPSTREAM_CHECKS]
REGISTRY, ATTENTION, FP8_ORACLE = CHECKED

FAKE_SETUP = """\
import os


class CMakeExtension:
    def __init__(self, name, **kwargs):
        self.name = name


def _is_cuda():
    return os.environ.get("FAKE_DEVICE") == "cuda"


def _is_hip():
    return os.environ.get("FAKE_DEVICE") == "rocm"


def _build_custom_ops():
    return _is_cuda() or _is_hip()


ext_modules = []

if _is_cuda():
    ext_modules.append(CMakeExtension(name="vllm.vllm_flash_attn._vllm_fa2_C"))

if _build_custom_ops():
    if _is_hip():
        ext_modules.append(CMakeExtension(name="vllm._C"))
    if _is_cuda() or _is_hip():
        ext_modules.append(CMakeExtension(name="vllm._C_stable_libtorch"))
        ext_modules.append(CMakeExtension(name="vllm._moe_C_stable_libtorch"))

package_data = {"vllm": ["py.typed"]}
"""

FAKE_CMAKE = """\
cmake_minimum_required(VERSION 3.26)
project(vllm_extensions LANGUAGES CXX)

if(VLLM_GPU_LANG STREQUAL "CUDA")
  message(STATUS "building _C")
endif()

# For CUDA we also build and ship some external projects.
if (VLLM_GPU_LANG STREQUAL "CUDA")
    include(cmake/external_projects/flashmla.cmake)

    # vllm-flash-attn should be last as it overwrites some CMake functions
    include(cmake/external_projects/vllm_flash_attn.cmake)
endif ()
"""


FAKE_TEMPLATE = """\
# the _hpc_C target
set(SRCS
@HPC_SOURCES@)
define_extension_target(_hpc_C SOURCES ${SRCS})
"""


@pytest.fixture(scope="session")
def installed() -> Path:
    try:
        return tool.find_installed_vllm()
    except tool.PatchSetError as e:
        pytest.skip(f"needs an installed vLLM: {e}")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A small patch-set tree: new files, replaced files, a library, kernels."""
    root = tmp_path / "tree"
    files = {
        "vllm/_hpc_ops.py": "NEW_OPS = 1\n",
        "vllm/utils/hpc.py": "PATCHED = True\n",
        "vllm/model_executor/layers/hpc/rope_norm.py": "ROPE = 'patched'",
        "vllm/hpc_extra/__init__.py": "",
        "vllm/hpc_extra/kernels.py": "K = 1\n",
        "csrc/hpc/ops.cu": "// kernels\n",
        "csrc/hpc/common/vec.cuh": "#pragma once\n",
        "csrc/hpc/common/host.cpp": "// host code\n",
        "cmake/hpc_extension.cmake": "add_library(_hpc_C MODULE)\n",
        "cmake/hpc_extension.vllm.cmake.in": FAKE_TEMPLATE,
        "tests/conftest.py": "# shared setup\n",
        "tests/kernels/test_ops.py": "def test_ops(): pass\n",
        "tests/vllm_integration/test_hpc_moe_layer.py": "MOE = 1\n",
        "tests/vllm_integration/test_hpc_attn_backend.py": "ATTN = 1\n",
        "tests/tools/test_apply_patchset.py": "TOOL = 1\n",
        "benchmarks/kernels/benchmark_ops.py": "BENCH = 1\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "vllm/_hpc_C.abi3.so").write_bytes(b"\x7fELF\0\0binary")
    (root / "vllm/__pycache__").mkdir()
    (root / "vllm/__pycache__/_hpc_ops.cpython-311.pyc").write_bytes(b"\0")
    return root


def _copy_upstream(installed: Path, package: Path, rels: list[str]) -> None:
    """Copies the upstream state of `rels`, also when the set is applied.

    When the installed vLLM carries the patch set (as in CI, which applies it
    before testing), replaced files come from the backup and new files are
    left out, so every test starts from pristine upstream files.
    """
    manifest = tool.load_manifest(installed) or {"files": {}}
    for rel in rels:
        entry = manifest["files"].get(rel)
        if entry is None:
            source = installed / rel
        elif entry["kind"] == "replaced":
            source = installed / tool.STATE_DIR / rel
        else:
            continue
        if source.is_file():
            (package / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, package / rel)


def _needed(installed: Path, tree: Path) -> list[str]:
    return ["_version.py", *CHECKED, *tool.tree_files(tree / "vllm")]


@pytest.fixture
def target(tmp_path: Path, installed: Path, tree: Path) -> Path:
    """The few files of the installed vLLM that the tool reads or replaces."""
    package = tmp_path / "site" / "vllm"
    package.mkdir(parents=True)
    _copy_upstream(installed, package, _needed(installed, tree))
    return package


@pytest.fixture
def src(tmp_path: Path, installed: Path, tree: Path) -> Path:
    """A tiny vLLM source checkout with vLLM-shaped CMakeLists.txt and setup.py."""
    root = tmp_path / "vllm-src"
    (root / "vllm").mkdir(parents=True)
    (root / "cmake").mkdir()
    (root / "cmake" / "utils.cmake").write_text("# helpers\n")
    _copy_upstream(installed, root / "vllm", _needed(installed, tree))
    (root / "setup.py").write_text(FAKE_SETUP)
    (root / "CMakeLists.txt").write_text(FAKE_CMAKE)
    return root


def snapshot(root: Path) -> dict[str, object]:
    """Every directory, file (bytes, mode) and link (target) under root."""
    found: dict[str, object] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            rel = path.relative_to(root).as_posix()
            if path.is_symlink():
                found[rel] = ("link", os.readlink(path))
            elif path.is_dir():
                found[rel] = "dir"
            else:
                found[rel] = (path.read_bytes(), path.stat().st_mode)
    return found


def run(*args: object) -> int:
    return tool.main([str(a) for a in args])


def apply_args(tree: Path, target: Path, *extra: str) -> list[object]:
    return ["--tree", tree, "--target", target, *extra]


def manifest(root: Path) -> dict:
    return json.loads((root / tool.STATE_DIR / tool.MANIFEST).read_text())


def test_finds_installed_vllm_without_the_tree(installed: Path) -> None:
    assert (installed / "__init__.py").is_file()
    assert installed.resolve() != (REPO_ROOT / "vllm").resolve()
    assert tool.read_version(installed) == tool.BASE_VERSION


def test_walk_skips_bytecode(tree: Path) -> None:
    files = tool.tree_files(tree / "vllm")
    assert "_hpc_C.abi3.so" in files
    assert "hpc_extra/kernels.py" in files
    assert not any("__pycache__" in rel for rel in files)


def test_link_apply_check_revert(tree: Path, target: Path, capsys) -> None:
    before = snapshot(target)
    assert run(*apply_args(tree, target)) == 0
    for rel, path in tool.tree_files(tree / "vllm").items():
        assert (target / rel).is_symlink()
        assert Path(os.readlink(target / rel)) == path.resolve()
    kinds = {rel: e["kind"] for rel, e in manifest(target)["files"].items()}
    assert kinds["utils/hpc.py"] == "replaced"
    assert kinds["_hpc_ops.py"] == kinds["_hpc_C.abi3.so"] == "new"
    backup = target / tool.STATE_DIR / "utils/hpc.py"
    assert backup.read_bytes() == before["utils/hpc.py"][0]

    capsys.readouterr()
    assert run(*apply_args(tree, target, "--check")) == 0
    out = capsys.readouterr().out
    assert "applied as link  vllm/_hpc_C.abi3.so" in out
    assert "missing" not in out

    # a byte-compiled new module must not keep its directory alive
    pycache = target / "hpc_extra" / "__pycache__"
    pycache.mkdir()
    (pycache / "kernels.cpython-311.pyc").write_bytes(b"\0")
    assert run(*apply_args(tree, target, "--revert")) == 0
    assert snapshot(target) == before
    assert run(*apply_args(tree, target, "--revert")) == 0
    assert "nothing to revert" in capsys.readouterr().out


def test_copy_reapply_and_mode_switch(tree: Path, target: Path, capsys) -> None:
    before = snapshot(target)
    assert run(*apply_args(tree, target, "--copy")) == 0
    first = manifest(target)
    backups = snapshot(target / tool.STATE_DIR)
    for rel, path in tool.tree_files(tree / "vllm").items():
        assert not (target / rel).is_symlink()
        assert (target / rel).read_bytes() == path.read_bytes()

    capsys.readouterr()
    assert run(*apply_args(tree, target, "--copy")) == 0
    assert "(0 of 6 files updated)" in capsys.readouterr().out
    assert manifest(target) == first

    # our own copies and links are never taken for upstream files
    assert run(*apply_args(tree, target, "--link")) == 0
    assert (target / "utils/hpc.py").is_symlink()
    assert run(*apply_args(tree, target, "--copy")) == 0
    assert manifest(target)["files"] == first["files"]
    assert snapshot(target / tool.STATE_DIR) == backups
    assert run(*apply_args(tree, target, "--check")) == 0

    assert run(*apply_args(tree, target, "--revert")) == 0
    assert snapshot(target) == before


def test_check_fails_before_apply(tree: Path, target: Path, capsys) -> None:
    before = snapshot(target)
    assert run(*apply_args(tree, target, "--check")) == 1
    out = capsys.readouterr().out
    assert "not applied      vllm/_hpc_ops.py" in out
    assert "upstream         vllm/utils/hpc.py" in out
    assert snapshot(target) == before


def test_check_reports_stale_and_missing_library(
    tree: Path, target: Path, capsys
) -> None:
    assert run(*apply_args(tree, target, "--copy")) == 0
    (tree / "vllm/utils/hpc.py").write_text("PATCHED = 2\n")
    (target / "_hpc_C.abi3.so").unlink()
    capsys.readouterr()
    assert run(*apply_args(tree, target, "--check")) == 1
    out = capsys.readouterr().out
    assert "stale copy       vllm/utils/hpc.py" in out
    assert "not applied      vllm/_hpc_C.abi3.so" in out
    assert run(*apply_args(tree, target, "--copy")) == 0
    assert run(*apply_args(tree, target, "--check")) == 0


@pytest.mark.parametrize(
    "rel, old, new, what",
    [
        (REGISTRY, "HPC_ATTN =", "HPC_ATTN_GONE =", "HPC_ATTN"),
        (ATTENTION, "output_dtype: torch.dtype", "out_dtype: torch.dtype", "output"),
        (FP8_ORACLE, '"hpc": Fp8MoeBackend.HPC', '"hpc": None', "Fp8MoeBackend.HPC"),
    ],
)
def test_check_fails_without_upstream_piece(
    tree: Path, target: Path, capsys, rel: str, old: str, new: str, what: str
) -> None:
    assert run(*apply_args(tree, target)) == 0
    path = target / rel
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))
    capsys.readouterr()
    assert run(*apply_args(tree, target, "--check")) == 1
    missing = [
        line for line in capsys.readouterr().out.splitlines() if "missing" in line
    ]
    assert len(missing) == 1
    assert what in missing[0] and rel in missing[0]


def test_diff_headers_applied_or_not(tree: Path, target: Path, capsys) -> None:
    assert run(*apply_args(tree, target, "--diff")) == 0
    unapplied = capsys.readouterr().out
    assert "--- a/vllm/utils/hpc.py\n+++ b/vllm/utils/hpc.py\n" in unapplied
    assert "--- /dev/null\n+++ b/vllm/_hpc_ops.py\n" in unapplied
    assert "+++ b/vllm/hpc_extra/__init__.py" not in unapplied  # empty file
    assert "new file mode 100644" in unapplied
    assert "\\ No newline at end of file" in unapplied
    assert ".so" not in unapplied
    assert "csrc" not in unapplied
    for mode in ("--link", "--copy"):
        assert run(*apply_args(tree, target, mode)) == 0
        capsys.readouterr()
        assert run(*apply_args(tree, target, "--diff")) == 0
        assert capsys.readouterr().out == unapplied


def test_wrong_version_is_refused(tree: Path, target: Path, capsys) -> None:
    version_py = target / "_version.py"
    version_py.write_text(version_py.read_text().replace("0.33.0", "0.34.1"))
    before = snapshot(target)
    for extra in ([], ["--check"], ["--diff"], ["--revert"]):
        assert run(*apply_args(tree, target, *extra)) == 2
        err = capsys.readouterr().err
        assert "this patch set is for vLLM 0.33.0, found 0.34.1" in err
        assert err.count("\n") == 1
    assert snapshot(target) == before


def test_version_from_dist_info_or_refused(tree: Path, target: Path, capsys) -> None:
    (target / "_version.py").unlink()
    assert run(*apply_args(tree, target, "--check")) == 2
    assert "cannot determine the vLLM version" in capsys.readouterr().err
    dist_info = target.parent / "vllm-0.33.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Name: vllm\nVersion: 0.34.1\n")
    assert run(*apply_args(tree, target, "--check")) == 2
    (dist_info / "METADATA").write_text("Name: vllm\nVersion: 0.33.0\n")
    assert run(*apply_args(tree, target)) == 0


def test_revert_refuses_altered_backup(tree: Path, target: Path, capsys) -> None:
    assert run(*apply_args(tree, target)) == 0
    (target / tool.STATE_DIR / "utils/hpc.py").write_text("tampered\n")
    applied = snapshot(target)
    assert run(*apply_args(tree, target, "--revert")) == 1
    assert "altered" in capsys.readouterr().err
    assert snapshot(target) == applied


def test_file_dropped_from_tree_is_restored(tree: Path, target: Path) -> None:
    upstream = (target / "utils/hpc.py").read_bytes()
    assert run(*apply_args(tree, target)) == 0
    (tree / "vllm/utils/hpc.py").unlink()
    (tree / "vllm/_hpc_C.abi3.so").unlink()
    assert run(*apply_args(tree, target)) == 0
    assert not (target / "utils/hpc.py").is_symlink()
    assert (target / "utils/hpc.py").read_bytes() == upstream
    assert not (target / "_hpc_C.abi3.so").exists()
    assert "utils/hpc.py" not in manifest(target)["files"]
    assert run(*apply_args(tree, target, "--check")) == 0


def test_unrecorded_link_is_not_backed_up(tree: Path, target: Path, capsys) -> None:
    assert run(*apply_args(tree, target)) == 0
    shutil.rmtree(target / tool.STATE_DIR)
    assert run(*apply_args(tree, target)) == 1
    assert "no backup record" in capsys.readouterr().err


def _extensions(setup_py: Path, device: str, monkeypatch) -> list[str]:
    monkeypatch.setenv("FAKE_DEVICE", device)
    namespace: dict = {}
    exec(compile(setup_py.read_text(), str(setup_py), "exec"), namespace)
    return [ext.name for ext in namespace["ext_modules"]]


def test_vllm_src_apply_and_revert(tree: Path, src: Path, capsys, monkeypatch) -> None:
    before = snapshot(src)
    args = ["--tree", tree, "--vllm-src", src]
    assert run(*args) == 0
    vllm_files = tool.tree_files(tree / "vllm")
    for rel, path in vllm_files.items():
        if rel.endswith(".so"):
            assert not (src / "vllm" / rel).exists()
        else:
            assert not (src / "vllm" / rel).is_symlink()
            assert (src / "vllm" / rel).read_bytes() == path.read_bytes()
    assert (src / "csrc/hpc/common/vec.cuh").read_text() == "#pragma once\n"
    assert (src / "cmake/hpc_extension.cmake").read_text() == (
        '# the _hpc_C target\nset(SRCS\n  "csrc/hpc/common/host.cpp"\n'
        '  "csrc/hpc/ops.cu")\ndefine_extension_target(_hpc_C SOURCES ${SRCS})\n'
    )
    assert (src / "tests/kernels/hpc/conftest.py").read_text() == "# shared setup\n"
    assert (src / "tests/kernels/hpc/test_ops.py").is_file()
    assert (src / "tests/kernels/moe/test_hpc_moe_layer.py").is_file()
    assert (src / "tests/v1/attention/test_hpc_attn_backend.py").is_file()
    assert (src / "benchmarks/kernels/benchmark_ops.py").is_file()
    assert not (src / "tests/tools").exists()

    cmake = (src / "CMakeLists.txt").read_text()
    block = cmake.index(tool.CMAKE_BLOCK)
    assert (
        block
        < cmake.index("# For CUDA we also build")
        < cmake.index("vllm_flash_attn.cmake")
    )
    assert "include(${CMAKE_CURRENT_LIST_DIR}/cmake/hpc_extension.cmake)" in cmake
    assert 'if(VLLM_GPU_LANG STREQUAL "CUDA")' in tool.CMAKE_BLOCK
    registry = (src / "vllm" / REGISTRY).read_text()
    assert tool.REGISTRY_COMMENT + "    HPC_ATTN = " in registry
    assert "hpc-ops" not in registry
    setup_py = src / "setup.py"
    assert "vllm._hpc_C" in _extensions(setup_py, "cuda", monkeypatch)
    assert "vllm._hpc_C" not in _extensions(setup_py, "rocm", monkeypatch)

    wired = snapshot(src)
    assert run(*args) == 0
    assert snapshot(src) == wired
    capsys.readouterr()
    assert run(*args, "--check") == 0
    assert "applied as edit  setup.py" in capsys.readouterr().out

    assert run(*args, "--diff") == 0
    out = capsys.readouterr().out
    for header in (
        "--- a/setup.py\n+++ b/setup.py\n",
        "--- a/CMakeLists.txt\n+++ b/CMakeLists.txt\n",
        "--- /dev/null\n+++ b/csrc/hpc/ops.cu\n",
        "--- /dev/null\n+++ b/cmake/hpc_extension.cmake\n",
        "--- a/vllm/utils/hpc.py\n+++ b/vllm/utils/hpc.py\n",
        f"--- a/vllm/{REGISTRY}\n+++ b/vllm/{REGISTRY}\n",
        "--- /dev/null\n+++ b/tests/kernels/hpc/test_ops.py\n",
        "--- /dev/null\n+++ b/benchmarks/kernels/benchmark_ops.py\n",
    ):
        assert header in out
    assert "+" + tool.SETUP_SIGN in out
    assert "test_apply_patchset" not in out

    assert run(*args, "--revert") == 0
    assert snapshot(src) == before


def test_vllm_src_link_mode(tree: Path, src: Path) -> None:
    before = snapshot(src)
    assert run("--tree", tree, "--vllm-src", src, "--link") == 0
    assert (src / "csrc/hpc/ops.cu").is_symlink()
    assert not (src / "setup.py").is_symlink()
    assert run("--tree", tree, "--vllm-src", src, "--revert") == 0
    assert snapshot(src) == before


def test_vllm_src_without_anchor_changes_nothing(tree: Path, src: Path, capsys) -> None:
    (src / "setup.py").write_text("from setuptools import setup\n\nsetup()\n")
    before = snapshot(src)
    assert run("--tree", tree, "--vllm-src", src) == 1
    assert "setup.py has no vllm._C extension" in capsys.readouterr().err
    assert snapshot(src) == before


def test_vllm_src_wrong_version(tree: Path, src: Path, capsys) -> None:
    version_py = src / "vllm" / "_version.py"
    version_py.write_text(version_py.read_text().replace("0.33.0", "0.34.1"))
    assert run("--tree", tree, "--vllm-src", src) == 2
    assert "found 0.34.1" in capsys.readouterr().err


def test_wire_cmake_appends_without_flash_attn() -> None:
    wired = tool.wire_cmake("project(x)")
    assert wired.startswith("project(x)\n\n")
    assert wired.endswith(tool.CMAKE_BLOCK)


def test_repository_tree_round_trip(tmp_path: Path, installed: Path) -> None:
    """The real patch set, through the command line, on a copy of vLLM."""
    package = tmp_path / "vllm"
    package.mkdir()
    _copy_upstream(installed, package, _needed(installed, REPO_ROOT))
    before = snapshot(package)

    def cli(*extra: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, str(TOOL_PATH), "--target", str(package), *extra]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)

    assert cli("--check").returncode == 1
    assert cli().returncode == 0
    result = cli("--check")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "+++ b/vllm/_hpc_ops.py" in cli("--diff").stdout
    assert cli("--revert").returncode == 0
    assert snapshot(package) == before
