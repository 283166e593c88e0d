# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tests for tools/apply_patchset.py, on small copies of the installed vLLM.

The tests of the whole PR (``--vllm-src``, its ``--diff`` under ``git apply``,
the ``_hpc_C`` target under vLLM's CMake helpers) need vLLM 0.33.0's sources:
``VLLM_SDIST`` names its source distribution or the unpacked directory; they
skip without it.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import regex as re
from patchset_tool import REPO_ROOT, TOOL_PATH, load_tool
from patchset_tool import git as _git

tool = load_tool()

# Upstream files the relied-on checks read, relative to the vllm package.
CHECKED = [rel for rel, _, _ in tool.UPSTREAM_CHECKS]
REGISTRY, ATTENTION, FP8_ORACLE = CHECKED
# Upstream files edited in place, relative to the vllm package.
EDITED = [r.rel for r in tool.PACKAGE_EDITS]
COMPILATION, QK_NORM_PASS, HY3_MODEL = EDITED

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
        "tests/kernels/hpc/conftest.py": "# shared setup\n",
        "tests/kernels/hpc/test_ops.py": "def test_ops(): pass\n",
        "tests/kernels/moe/test_hpc_moe_layer.py": "MOE = 1\n",
        "tests/v1/attention/test_hpc_attn_backend.py": "ATTN = 1\n",
        "tools/tests/test_apply_patchset.py": "TOOL = 1\n",
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
        elif entry["kind"] in ("replaced", "edited"):
            source = installed / tool.STATE_DIR / rel
        else:
            continue
        if source.is_file():
            (package / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, package / rel)


def _needed(installed: Path, tree: Path) -> list[str]:
    return ["_version.py", *CHECKED, *EDITED, *tool.tree_files(tree / "vllm")]


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
    # vLLM's backend test, as far as the edits of it need: each text once.
    backend_tests = root / tool.BACKEND_TESTS
    backend_tests.parent.mkdir(parents=True)
    backend_tests.write_text("\n\n".join(r.old for r in tool.SOURCE_EDITS))
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


def test_walk_skips_bytecode_and_hidden_files(tree: Path) -> None:
    (tree / "vllm/hpc_extra/.kernels.py.swp").write_bytes(b"\0")
    (tree / "vllm/.pytest_cache").mkdir()
    (tree / "vllm/.pytest_cache/README.md").write_text("cache\n")
    files = tool.tree_files(tree / "vllm")
    assert "_hpc_C.abi3.so" in files
    assert "hpc_extra/kernels.py" in files
    assert not any("__pycache__" in rel for rel in files)
    assert not any("/." in f"/{rel}" for rel in files)


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
    files = len(tool.tree_files(tree / "vllm")) + len(EDITED)
    assert f"(0 of {files} files updated)" in capsys.readouterr().out
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
    assert not (src / "tools").exists()

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


def test_package_edits_apply_check_diff_revert(
    tree: Path, target: Path, capsys
) -> None:
    before = snapshot(target)
    assert run(*apply_args(tree, target)) == 0
    for r in tool.PACKAGE_EDITS:
        text = (target / r.rel).read_text()
        assert r.old not in text and text.count(r.new) == 1
        assert text == before[r.rel][0].decode().replace(r.old, r.new)
        assert not (target / r.rel).is_symlink()
        assert manifest(target)["files"][r.rel]["kind"] == "edited"
        assert (target / tool.STATE_DIR / r.rel).read_bytes() == before[r.rel][0]
    compilation = (target / COMPILATION).read_text()
    for flag in ("fuse_rope_kvcache", "fuse_qk_norm_rope_kvcache"):
        assert f"if self.{flag} and not current_platform.is_rocm()" not in compilation
        assert f"if self.{flag} and not current_platform.is_cuda_alike()" in compilation
    assert "quant_forms = [False, True] if current_platform.is_rocm()" in (
        (target / QK_NORM_PASS).read_text()
    )

    applied = snapshot(target)
    assert run(*apply_args(tree, target)) == 0
    assert snapshot(target) == applied
    assert run(*apply_args(tree, target, "--copy")) == 0
    for rel in [*EDITED, tool.STATE_DIR + "/" + COMPILATION]:
        assert snapshot(target)[rel] == applied[rel]

    capsys.readouterr()
    assert run(*apply_args(tree, target, "--check")) == 0
    out = capsys.readouterr().out
    for rel in EDITED:
        assert f"applied as edit  vllm/{rel}\n" in out

    assert run(*apply_args(tree, target, "--diff")) == 0
    out = capsys.readouterr().out
    for r in tool.PACKAGE_EDITS:
        assert f"--- a/vllm/{r.rel}\n+++ b/vllm/{r.rel}\n" in out
        assert f"+{r.sign}" in out
    assert "+        if self.fuse_qk_norm_rope_kvcache and not current_platform" in out

    assert run(*apply_args(tree, target, "--revert")) == 0
    assert snapshot(target) == before


def test_package_edit_undone_by_hand_is_reported(
    tree: Path, target: Path, capsys
) -> None:
    upstream = (target / COMPILATION).read_bytes()
    assert run(*apply_args(tree, target)) == 0
    (target / COMPILATION).write_bytes(upstream)
    capsys.readouterr()
    assert run(*apply_args(tree, target, "--check")) == 1
    assert f"upstream         vllm/{COMPILATION}\n" in capsys.readouterr().out
    assert run(*apply_args(tree, target)) == 0
    assert run(*apply_args(tree, target, "--check")) == 0


@pytest.mark.parametrize("copies", [0, 2])
def test_package_edit_without_its_text_is_refused(
    tree: Path, target: Path, capsys, copies: int
) -> None:
    path = target / COMPILATION
    gate = tool.PACKAGE_EDITS[0].old
    text = path.read_text()
    path.write_text(text.replace(gate, gate * copies))
    before = snapshot(target)
    assert run(*apply_args(tree, target)) == 1
    err = capsys.readouterr().err
    where = "not found" if copies == 0 else "found 2 times"
    assert f"vllm/{COMPILATION}: the vLLM 0.33.0 text of" in err
    assert f"{where}; refusing" in err
    assert snapshot(target) == before


def test_package_edit_without_backup_is_refused(
    tree: Path, target: Path, capsys
) -> None:
    path = target / COMPILATION
    path.write_text(tool.PACKAGE_EDITS[0](path.read_text()))
    before = snapshot(target)
    assert run(*apply_args(tree, target)) == 1
    assert "is already wired but has no backup" in capsys.readouterr().err
    assert snapshot(target) == before


def test_package_edit_signs_are_new_lines(installed: Path, tmp_path: Path) -> None:
    package = tmp_path / "vllm"
    _copy_upstream(installed, package, EDITED)
    for r in tool.PACKAGE_EDITS:
        upstream = (package / r.rel).read_text().splitlines(keepends=True)
        assert r.sign not in upstream
        assert r.sign not in r.old.splitlines(keepends=True)
        assert r.sign.strip()


def test_replace_sign_is_the_first_new_line() -> None:
    r = tool.Replace(
        "x.py", "a list", "L = [\n    A,\n]\n", "L = [\n    A,\n    B,\n]\n"
    )
    assert r.sign == "    B,\n"
    assert r.path == "vllm/x.py"
    assert tool.Replace("t/x.py", "w", "a\n", "b\n", base="").path == "t/x.py"


def test_source_edit_without_its_text_is_refused(tree: Path, src: Path, capsys) -> None:
    path = src / tool.BACKEND_TESTS
    path.write_text(path.read_text().replace("AttentionBackendEnum.TRITON_ATTN", "X"))
    before = snapshot(src)
    assert run("--tree", tree, "--vllm-src", src) == 1
    err = capsys.readouterr().err
    assert f"{tool.BACKEND_TESTS}: the vLLM 0.33.0 text of the " in err
    assert "is not found; refusing" in err
    assert snapshot(src) == before


# --- the whole PR against the real tree ----------------------------------


def _fake_checkout(root: Path) -> Path:
    """The three things that make a directory a vLLM checkout to the tool."""
    (root / "vllm").mkdir(parents=True)
    (root / "CMakeLists.txt").write_text(FAKE_CMAKE)
    (root / "setup.py").write_text(FAKE_SETUP)
    return root


def _tracked(pattern: str) -> list[str]:
    if shutil.which("git") is None or not (REPO_ROOT / ".git").exists():
        pytest.skip("needs git and this repository's history")
    out = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "ls-files", pattern],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return out.split()


def test_source_layout_covers_the_tree(tmp_path: Path) -> None:
    layout = tool.source_layout(_fake_checkout(tmp_path / "src"), REPO_ROOT)
    for rel in tool.tree_files(REPO_ROOT / "vllm"):
        if not rel.endswith(".so"):
            assert f"vllm/{rel}" in layout.files
    for rel in tool.tree_files(REPO_ROOT / "csrc" / "hpc"):
        assert f"csrc/hpc/{rel}" in layout.files
    for rel in tool.tree_files(REPO_ROOT / tool.BENCHMARKS):
        assert f"{tool.BENCHMARKS}/{rel}" in layout.files
    for rel in tool.BENCHMARK_SCRIPTS:
        assert (REPO_ROOT / rel).is_file(), rel
        assert rel in layout.files
    assert not set(layout.files) & set(layout.edits)
    assert not any(rel.endswith(".so") for rel in layout.files)

    # every test at its own path, none of this repository's tool tests
    for rel, path in tool.tree_files(REPO_ROOT / "tests").items():
        assert layout.files[f"tests/{rel}"] == path
    assert "tests/kernels/hpc/conftest.py" in layout.files
    assert not [rel for rel in layout.files if rel.startswith("tools/")]

    # the generated target lists every translation unit, the tracked ones too
    fragment = layout.edits[tool.CMAKE_FRAGMENT].make(None)
    lines = fragment.splitlines()
    listed = [line.strip().strip(')"') for line in lines if "csrc/hpc/" in line]
    assert listed == tool.kernel_sources(layout.files)
    assert set(_tracked("csrc/hpc/*.cu") + _tracked("csrc/hpc/*.cpp")) <= set(listed)
    assert "csrc/hpc/torch_bindings.cpp" in listed
    assert tool.SOURCES_PLACEHOLDER not in fragment


def test_tests_import_helpers_by_their_vllm_path(tmp_path: Path) -> None:
    """The tests import the tree's helpers as modules of the ``tests``
    package (``tests.kernels.hpc.utils``), which the PR carries at those
    paths, and none by bare module name."""
    layout = tool.source_layout(_fake_checkout(tmp_path / "src"), REPO_ROOT)
    tests = {
        rel: path for rel, path in layout.files.items() if rel.startswith("tests/")
    }
    helpers = {
        Path(rel).stem for rel in tests if not Path(rel).stem.startswith("test_")
    }
    for rel, path in tests.items():
        if path.suffix != ".py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
                modules += [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for module in modules:
                assert module not in helpers, f"{rel} imports {module} by bare name"
                if module.split(".")[0] != "tests":
                    continue
                as_file = module.replace(".", "/")
                carried = f"{as_file}.py" in tests or any(
                    other.startswith(f"{as_file}/") for other in tests
                )
                # "from tests.x import name" may name a function, not a module.
                is_name = isinstance(node, ast.ImportFrom) and module != node.module
                assert carried or is_name, f"{rel} imports {module}, not in the PR"


def test_files_vllm_has_are_not_replaced(tree: Path, src: Path, capsys) -> None:
    upstream = src / "tests/kernels/moe/test_hpc_moe_layer.py"
    upstream.parent.mkdir(parents=True)
    upstream.write_text("# vLLM's own\n")
    before = snapshot(src)
    for extra in ((), ("--diff",)):
        assert run("--tree", tree, "--vllm-src", src, *extra) == 1
        err = capsys.readouterr().err
        assert "vLLM already has tests/kernels/moe/test_hpc_moe_layer.py" in err
        assert snapshot(src) == before


def test_describe_backend_replaces_only_its_comment() -> None:
    text = (
        "class AttentionBackendEnum:\n"
        "    # Flex attention\n"
        '    FLEX = "flex"\n'
        "    # HPC Attention Backend:\n"
        "    # requires a block size of 64.\n"
        '    HPC_ATTN = "hpc"\n'
        '    CPU_ATTN = "cpu"\n'
    )
    described = tool.describe_backend(text)
    assert described == text.replace(
        "    # HPC Attention Backend:\n    # requires a block size of 64.\n",
        tool.REGISTRY_COMMENT,
    )
    with pytest.raises(tool.PatchSetError, match="no single HPC_ATTN"):
        tool.describe_backend("class E:\n    FLEX = 1\n")


# --- a real vLLM 0.33.0 source tree ---------------------------------------


def _src_cli(root: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(TOOL_PATH), "--vllm-src", str(root), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_diff_applies_to_vllm_sources(pristine: Path, tmp_path: Path) -> None:
    root = pristine
    result = _src_cli(root, "--diff")
    assert result.returncode == 0, result.stderr
    patch = tmp_path / "hpc.patch"
    patch.write_text(result.stdout)

    # nothing of vLLM's own is overwritten but the files the patch set replaces
    layout = tool.source_layout(root, REPO_ROOT)
    for rel in layout.files:
        if not rel.startswith("vllm/"):
            assert not (root / rel).exists(), f"{rel} exists in vLLM"

    _git(root, "apply", "--check", str(patch))
    _git(root, "apply", str(patch))
    _git(root, "add", "-A")
    applied = _git(root, "write-tree").strip()
    _git(root, "reset", "-q", "--hard")
    _git(root, "clean", "-fdxq")

    # --vllm-src writes the same tree as the patch, and reverts to vLLM's
    assert _src_cli(root).returncode == 0
    assert tool.STATE_DIR not in _git(root, "status", "--porcelain", "--ignored=no")
    result = _src_cli(root, "--check")
    assert result.returncode == 0, result.stdout + result.stderr
    assert _src_cli(root, "--diff").stdout == patch.read_text()
    _git(root, "add", "-A")
    assert _git(root, "write-tree").strip() == applied
    _git(root, "reset", "-q")
    assert _src_cli(root, "--revert").returncode == 0
    assert _git(root, "status", "--porcelain") == ""


def test_vllm_files_are_wired_without_markers(pristine: Path) -> None:
    root = pristine
    result = _src_cli(root, "--diff")
    assert result.returncode == 0, result.stderr
    assert "# >>>" not in result.stdout and "# <<<" not in result.stdout
    assert _src_cli(root).returncode == 0
    for rel in tool.source_layout(root, REPO_ROOT).edits:
        text = (root / rel).read_text()
        assert "# >>>" not in text and "# <<<" not in text, rel
        assert "patch set" not in text.lower(), rel

    cmake = (root / "CMakeLists.txt").read_text()
    block = cmake.index(tool.CMAKE_BLOCK)
    assert cmake.index("FetchContent_MakeAvailable(cutlass)") < block
    assert block < cmake.index("include(cmake/external_projects/vllm_flash_attn")
    setup_py = (root / "setup.py").read_text()
    compile(setup_py, "setup.py", "exec")
    assert setup_py.index("vllm._moe_C_stable_libtorch") < setup_py.index(
        tool.SETUP_SIGN
    )
    registry = (root / "vllm" / REGISTRY).read_text()
    assert tool.REGISTRY_COMMENT + "    HPC_ATTN = " in registry
    fragment = (root / tool.CMAKE_FRAGMENT).read_text()
    for rel in tool.kernel_sources(tool.source_files(REPO_ROOT)):
        assert f'"{rel}"' in fragment
        assert (root / rel).is_file()


# --- the change as a series of patches ------------------------------------


def test_series_table_assigns_each_file_once(tmp_path: Path) -> None:
    layout = tool.source_layout(_fake_checkout(tmp_path / "src"), REPO_ROOT)
    paths = [*layout.files, *layout.edits]
    groups = tool.assign_steps(paths)
    assert sorted(rel for group in groups for rel in group) == sorted(paths)
    assert all(groups)
    # vLLM's backend test gets HPC_ATTN with the backend
    slugs = [step.slug for step in tool.SERIES]
    assert tool.BACKEND_TESTS in groups[slugs.index("hpc-attn-backend")]
    with pytest.raises(tool.PatchSetError, match="no step claims tests/new.py"):
        tool.assign_steps([*paths, "tests/new.py"])
    # "*decode*" and "*prefill*" both claim a file named after both
    both = "tests/kernels/hpc/test_decode_prefill.py"
    with pytest.raises(tool.PatchSetError, match="more than one step claims"):
        tool.assign_steps([*paths, both])


def _runtime_imports(path: Path) -> set[str]:
    """The modules a Python file imports when run, candidates for a name
    imported from a module included; ``if TYPE_CHECKING:`` blocks left out."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith(
            "TYPE_CHECKING"
        ):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def _module_files(module: str, where: Path) -> list[str]:
    """Where ``module`` would be as a file of the change, relative to the
    checkout: under its root, or (a bare name) beside the importing file or
    the benchmark scripts, whose directories the benchmarks and their tests
    put on sys.path. The change adds no package of its own."""
    as_path = module.replace(".", "/")
    bases = [""] if "." in module else ["", "benchmarks/", f"{BENCHMARKS}/"]
    bases += [f"{where.as_posix()}/"] if "." not in module else []
    return [f"{base}{as_path}.py" for base in bases]


BENCHMARKS = tool.BENCHMARKS
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
_BOXED = re.compile(r"TORCH_BOX\(&hpc::(\w+)\)")


def _check_step(root: Path, present: list[str], step: list[str]) -> None:
    """What can be checked of a step without building it."""
    everything = set(tool.source_layout(root, REPO_ROOT).files)
    ours = [rel for rel in present if (root / rel).is_file()]
    assert sorted(ours) == sorted(present)

    # its Python files compile, and import nothing of a later step
    later = everything - set(present)
    for rel in step:
        if rel.endswith(".py"):
            compile((root / rel).read_text(), rel, "exec", dont_inherit=True)
    for rel in present:
        if not rel.endswith(".py"):
            continue
        for module in _runtime_imports(root / rel):
            hits = later.intersection(_module_files(module, Path(rel).parent))
            assert not hits, f"{rel} imports {module}, added later ({hits})"

    # the CMake fragment lists exactly the kernel sources present
    kernels = [rel for rel in present if rel.startswith("csrc/hpc/")]
    fragment = root / tool.CMAKE_FRAGMENT
    if not kernels:
        assert not fragment.exists()
        return
    listed = re.findall(r'^\s*"(csrc/hpc/[^"]+)"', fragment.read_text(), re.M)
    assert listed == tool.kernel_sources(present)
    for rel in listed:
        assert (root / rel).is_file(), rel

    # every header of the change a kernel file includes is there
    for rel in kernels:
        for name in _INCLUDE.findall((root / rel).read_text()):
            candidates = {
                (Path(rel).parent / name).as_posix(),
                f"csrc/hpc/{name}",
            }
            wanted = candidates & everything
            assert not wanted or wanted & set(present), f"{rel} includes {name}"

    # and every op the library registers is defined in its sources: the
    # shared object would not load with one missing
    units = [
        (root / rel).read_text()
        for rel in tool.kernel_sources(present)
        if not rel.endswith("torch_bindings.cpp")
    ]
    bindings = (root / "csrc/hpc/torch_bindings.cpp").read_text()
    for op in sorted(set(_BOXED.findall(bindings))):
        definition = re.compile(rf"^[\w:<>, ]+[ &*]{op}\(", re.M)
        assert any(definition.search(text) for text in units), op


def test_series_applies_step_by_step(pristine: Path, tmp_path: Path) -> None:
    """Each patch of ``--series`` applies with ``git apply`` on the ones
    before it, each step is consistent as far as can be told without a
    build, and the last step's tree is what ``--vllm-src`` writes."""
    root = pristine
    out = tmp_path / "series"
    result = _src_cli(root, "--series", str(out))
    assert result.returncode == 0, result.stderr
    assert _git(root, "status", "--porcelain") == ""
    patches = sorted(out.glob("*.patch"))
    names = [f"{i:04d}-{step.slug}.patch" for i, step in enumerate(tool.SERIES, 1)]
    assert [p.name for p in patches] == names
    # a second run does not mix its patches with these
    again = _src_cli(root, "--series", str(out))
    assert again.returncode == 1 and "already holds patches" in again.stderr

    steps = [p.files for p in tool.series(tool.source_layout(root, REPO_ROOT))]
    present: list[str] = []
    for number, (patch, files) in enumerate(zip(patches, steps, strict=True), 1):
        header = patch.read_text().split("\ndiff --git ", 1)[0]
        assert header.startswith(f"Subject: [PATCH {number}/{len(patches)}] ")
        _git(root, "apply", "--check", str(patch))
        _git(root, "apply", str(patch))
        present += files
        _check_step(root, present, list(files))
    _git(root, "add", "-A")
    stepped = _git(root, "write-tree").strip()
    _git(root, "reset", "-q", "--hard")
    _git(root, "clean", "-fdxq")

    assert _src_cli(root).returncode == 0
    _git(root, "add", "-A")
    assert _git(root, "write-tree").strip() == stepped
    _git(root, "reset", "-q")
    assert _src_cli(root, "--revert").returncode == 0


def test_package_edits_in_vllm_sources(pristine: Path) -> None:
    root = pristine
    for r in tool.PACKAGE_EDITS:
        assert (root / "vllm" / r.rel).read_text().count(r.old) == 1
    result = _src_cli(root, "--diff")
    assert result.returncode == 0, result.stderr
    for rel in EDITED:
        assert f"--- a/vllm/{rel}\n+++ b/vllm/{rel}\n" in result.stdout
    assert _src_cli(root).returncode == 0
    applied = _git(root, "diff")
    assert set(_git(root, "diff", "--name-only").split()) >= {
        f"vllm/{rel}" for rel in EDITED
    }
    assert _src_cli(root).returncode == 0
    assert _git(root, "diff") == applied
    result = _src_cli(root, "--check")
    for rel in EDITED:
        assert f"applied as edit  vllm/{rel}\n" in result.stdout
    assert _src_cli(root, "--revert").returncode == 0
    assert _git(root, "status", "--porcelain") == ""


# --- vLLM's backend-correctness test, edited ------------------------------

# The shape of Qwen/Qwen3-0.6B, the model of vLLM's causal backend test
# (a config.json only: nothing is downloaded or loaded).
QWEN3_SHAPE = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "num_attention_heads": 16,
    "num_hidden_layers": 2,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
}


def _backend_lists(text: str) -> dict[tuple[str, int], list[str]]:
    """Each list literal assigned to a ``*BACKENDS_TO_TEST`` name, by name and
    line, as the names of its members (``AttentionBackendEnum.X`` -> X)."""
    found: dict[tuple[str, int], list[str]] = {}
    for node in ast.walk(ast.parse(text)):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.List)
            and len(node.targets) == 1
            and isinstance(target := node.targets[0], ast.Name)
            and target.id.endswith("BACKENDS_TO_TEST")
        ):
            found[target.id, node.lineno] = [
                element.attr if isinstance(element, ast.Attribute) else "?"
                for element in node.value.elts
                if not isinstance(element, ast.Constant)
            ]
    return found


def test_backend_tests_edit_in_vllm_sources(pristine: Path) -> None:
    """The edit applies to vLLM's file, puts HPC_ATTN in the causal list and
    the CUDA sliding-window list and changes no other list."""
    root = pristine
    upstream = (root / tool.BACKEND_TESTS).read_text()
    for r in tool.SOURCE_EDITS:
        assert r.path == tool.BACKEND_TESTS
        assert upstream.count(r.old) == 1, r.what
        assert r.sign not in upstream.splitlines(keepends=True), r.what
    assert _src_cli(root).returncode == 0
    edited = (root / tool.BACKEND_TESTS).read_text()
    assert edited == tool.source_edits()[tool.BACKEND_TESTS].make(upstream)

    before, after = _backend_lists(upstream), _backend_lists(edited)
    assert [name for name, _ in before] == [name for name, _ in after]
    got: dict[str, list[bool]] = {}
    for (name, _), old, new in zip(
        before, before.values(), after.values(), strict=True
    ):
        assert "HPC_ATTN" not in old
        assert [b for b in new if b != "HPC_ATTN"] == old, name
        got.setdefault(name, []).append("HPC_ATTN" in new)
    # the CUDA sliding-window list is the second (the first is ROCm's)
    assert got == {
        "BACKENDS_TO_TEST": [True],
        "SLIDING_WINDOW_BACKENDS_TO_TEST": [False, True],
        "NON_CAUSAL_BACKENDS_TO_TEST": [False],
    }

    result = _src_cli(root, "--check")
    assert f"applied as edit  {tool.BACKEND_TESTS}\n" in result.stdout
    assert _src_cli(root, "--revert").returncode == 0
    assert _git(root, "status", "--porcelain") == ""


def test_edited_backend_tests_collect_and_refuse(
    pristine: Path, tmp_path: Path
) -> None:
    """vLLM's edited test module, imported from the checkout with the patch
    set applied: pytest collects it, and its backends are compared only
    where their selection hooks accept the configuration, the others left
    out with their reasons (see backend_tests_probe.py)."""
    root = pristine
    assert _src_cli(root).returncode == 0
    env = {**os.environ, "PYTHONPATH": str(root)}
    collect = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "--noconftest"]
        + ["-p", "no:cacheprovider", tool.BACKEND_TESTS],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert collect.returncode == 0, (collect.stdout + collect.stderr)[-4000:]
    assert "test_causal_backend_correctness[" in collect.stdout
    assert "test_sliding_window_backend_correctness[" in collect.stdout

    models = []
    for name, heads, kv_heads in (("qwen3", 16, 8), ("gqa32", 32, 1)):
        (tmp_path / name).mkdir()
        shape = {**QWEN3_SHAPE, "num_attention_heads": heads}
        shape.update(num_key_value_heads=kv_heads, hidden_size=128 * heads)
        (tmp_path / name / "config.json").write_text(json.dumps(shape))
        models.append(str(tmp_path / name))
    probe = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("backend_tests_probe.py"))]
        + models,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert probe.returncode == 0, probe.stderr[-4000:]
    found = json.loads(probe.stdout.strip().splitlines()[-1])
    assert found["lists"] == {
        "BACKENDS_TO_TEST": True,
        "SLIDING_WINDOW_BACKENDS_TO_TEST": True,
        "SLIDING_WINDOW_ENCODER_BACKENDS_TO_TEST": True,
        "NON_CAUSAL_BACKENDS_TO_TEST": False,
    }
    refusals = found["refusals"]
    assert refusals["hopper-causal"] == []
    assert refusals["hopper-non-causal"] == ["non-causal attention not supported"]
    assert refusals["hopper-encoder"] == [
        "attention type AttentionType.ENCODER_ONLY not supported"
    ]
    # the backend reads the model's heads off the current config
    (gqa,) = refusals["hopper-gqa32"]
    assert "GQA ratio 32" in gqa
    assert refusals["ampere-causal"] == ["compute capability not supported"]
    assert refusals["ampere-triton-encoder"] == []
    assert found["skip"] == (
        "Refused at backend selection: AttentionBackendEnum.HPC_ATTN: "
        "compute capability not supported"
    )


def test_kernel_headers_win_over_vllms(vllm_checkout: Path) -> None:
    """A header name both csrc/ and csrc/hpc/ have resolves to csrc/hpc's."""
    included = set()
    for path in tool.tree_files(REPO_ROOT / "csrc" / "hpc").values():
        included |= set(re.findall(r'#include "([^"]+)"', path.read_text()))
    shared = sorted(rel for rel in included if (vllm_checkout / "csrc" / rel).exists())
    fragment = tool.source_layout(vllm_checkout, REPO_ROOT).edits[tool.CMAKE_FRAGMENT]
    text = " ".join(fragment.make(None).split())
    if shared:
        assert (
            "target_include_directories(_hpc_C BEFORE PRIVATE "
            "${CMAKE_CURRENT_SOURCE_DIR}/csrc/hpc)" in text
        ), shared


GATE_PROJECT = """\
cmake_minimum_required(VERSION 3.26)
project(hpc_gate LANGUAGES CXX)
include(${VLLM_ROOT}/cmake/utils.cmake)
set(VLLM_GPU_LANG CUDA)
set(VLLM_GPU_FLAGS -DENABLE_FP8)
# define_extension_target as vLLM's, minus Python and torch
function(define_extension_target MOD_NAME)
  cmake_parse_arguments(PARSE_ARGV 1 ARG "WITH_SOABI" "DESTINATION;LANGUAGE;USE_SABI"
    "SOURCES;ARCHITECTURES;COMPILE_FLAGS;INCLUDE_DIRECTORIES;LIBRARIES")
  add_library(${MOD_NAME} MODULE ${CMAKE_SOURCE_DIR}/stub.cpp)
  list(LENGTH ARG_SOURCES count)
  message(STATUS "gate: ${MOD_NAME} from ${count} sources, USE_SABI ${ARG_USE_SABI}")
endfunction()
include(${VLLM_ROOT}/cmake/hpc_extension.cmake)
get_target_property(kind _hpc_C TYPE)
message(STATUS "gate: _hpc_C is ${kind}")
"""


def _cmake() -> str:
    for candidate in (Path(sys.executable).parent / "cmake", shutil.which("cmake")):
        if candidate and Path(candidate).is_file():
            out = subprocess.run(
                [str(candidate), "--version"], capture_output=True, text=True
            ).stdout.split()
            if len(out) > 2 and tuple(map(int, out[2].split(".")[:2])) >= (3, 26):
                return str(candidate)
    pytest.skip("needs cmake 3.26 or later")


@pytest.mark.parametrize(
    "archs, nvcc, built",
    [
        ("9.0", "13.0", True),
        ("8.0;8.9;9.0;10.0;12.0", "13.0", True),
        ("9.0a", "13.0", True),
        ("8.0;8.6;8.9", "13.0", False),
        ("10.0;12.0", "13.0", False),
        ("9.0", "12.8", False),
    ],
)
def test_hpc_target_only_with_sm90a(
    pristine: Path, tmp_path: Path, archs: str, nvcc: str, built: bool
) -> None:
    """The vLLM-side target, configured with vLLM's own arch helpers."""
    cmake = _cmake()
    if shutil.which("c++") is None:
        pytest.skip("needs a C++ compiler for the stand-in target")
    project = tmp_path / "gate"
    (project / "cmake").mkdir(parents=True)
    shutil.copy2(pristine / "cmake" / "utils.cmake", project / "cmake")
    fragment = tool.source_layout(pristine, REPO_ROOT).edits[tool.CMAKE_FRAGMENT]
    (project / tool.CMAKE_FRAGMENT).write_text(fragment.make(None))
    (project / "CMakeLists.txt").write_text(GATE_PROJECT)
    (project / "stub.cpp").write_text("int hpc_gate_stub;\n")
    result = subprocess.run(
        [
            cmake,
            "-S",
            str(project),
            "-B",
            str(project / "build"),
            f"-DVLLM_ROOT={project}",
            f"-DCUDA_ARCHS={archs}",
            f"-DCMAKE_CUDA_COMPILER_VERSION={nvcc}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    gate = [line for line in result.stdout.splitlines() if "gate:" in line]
    count = len(tool.kernel_sources(tool.source_files(REPO_ROOT)))
    if built:
        assert gate == [
            f"-- gate: _hpc_C from {count} sources, USE_SABI 3",
            "-- gate: _hpc_C is MODULE_LIBRARY",
        ]
        assert "Building _hpc_C for archs: 9.0a" in result.stdout
    else:
        assert gate == ["-- gate: _hpc_C is UTILITY"]
        assert "Not building _hpc_C" in result.stdout
