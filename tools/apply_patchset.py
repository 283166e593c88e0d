# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Apply the HPC patch set to vLLM 0.33.0, check it, diff it or revert it.

The patch set is every file under this repository's ``vllm/`` directory. By
default it goes into the installed vLLM package, found without importing it,
as symbolic links so that edits here are live (``--copy`` copies instead).
Each upstream file it replaces is backed up once into
``<target>/.hpc_patchset/`` next to a manifest, from which ``--revert``
restores it byte for byte. A few upstream functions are edited in place
instead (``PACKAGE_EDITS``: exact vLLM 0.33.0 text replaced, refused when
that text is not found), with the same backup.

With ``--vllm-src DIR`` the whole change goes into a vLLM source checkout
instead, as a pull request would carry it: the ``vllm/`` files, the kernels
(``csrc/hpc/``), the ``_hpc_C`` target written for vLLM's CMake helpers
(``cmake/hpc_extension.cmake``, generated from
``cmake/hpc_extension.vllm.cmake.in`` with the kernel sources listed),
its wiring into CMakeLists.txt and setup.py, the attention registry's
description of the backend, the tests (``tests/``, at the same paths), the
kernel benchmarks and the end-to-end benchmark, and HPC_ATTN in vLLM's
backend-correctness test (``SOURCE_EDITS``: exact text replaced, as in
``PACKAGE_EDITS``). Outside ``vllm/`` the change otherwise only adds files: it
refuses to overwrite one the checkout has.

    python tools/apply_patchset.py                       # apply (links)
    python tools/apply_patchset.py --check               # exit 0 when all good
    python tools/apply_patchset.py --revert              # back to upstream
    python tools/apply_patchset.py --vllm-src DIR        # apply to a checkout
    python tools/apply_patchset.py --vllm-src DIR --diff # the PR as a patch
    python tools/apply_patchset.py --vllm-src DIR --series OUTDIR

Without ``--vllm-src``, ``--diff`` covers the ``vllm/`` files and edits only.

``--series OUTDIR`` writes the same change as numbered patches for review
(``0001-<slug>.patch``, ...), each with a ``git format-patch``-like header
that ``git apply`` skips and each applying on the ones before it; after the
last, the tree is what ``--vllm-src`` writes. ``SERIES`` assigns every file
to one step by path globs. It has the six steps of the review (the
``_hpc_C`` library with the RoPE+norm prologue; decode; prefill; the
HPC_ATTN backend; the FP8 MoE experts; the CUDA fusion passes), coarser
than one kernel per step in one respect: all kernels are in the first,
since the op registration references each of them (see ``SERIES``).

Exit codes: 0 success, 1 failure, 2 unsupported or unknown vLLM version.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import fnmatch
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BASE_VERSION = "0.33.0"
REPO_ROOT = Path(__file__).resolve().parents[1]
STATE_DIR = ".hpc_patchset"
MANIFEST = "manifest.json"
HPC_ATTN_BACKEND = "vllm.v1.attention.backends.hpc_attn.HpcAttentionBackend"

# What goes into vLLM's own files. Each carries a sign, a line only the wired
# file has, by which a checkout wired without a backup is recognised.
CMAKE_SIGN = "  include(${CMAKE_CURRENT_LIST_DIR}/cmake/hpc_extension.cmake)\n"
CMAKE_BLOCK = (
    "#\n"
    "# _hpc_C extension: the Hopper kernels of the HPC_ATTN attention backend\n"
    "# and the hpc MoE backend (cmake/hpc_extension.cmake).\n"
    "#\n"
    'if(VLLM_GPU_LANG STREQUAL "CUDA")\n'
    f"{CMAKE_SIGN}"
    "endif()\n"
)
SETUP_SIGN = (
    '    ext_modules.append(CMakeExtension(name="vllm._hpc_C", optional=True))\n'
)
SETUP_BLOCK = (
    "if _is_cuda():\n"
    "    # Hopper kernels of the HPC_ATTN and hpc MoE backends; CMake skips\n"
    "    # them unless 9.0a is among the CUDA target architectures.\n"
    f"{SETUP_SIGN}"
)
REGISTRY = "vllm/v1/attention/backends/registry.py"
REGISTRY_SIGN = "    # HPC attention backend: Hopper kernels built into vllm._hpc_C.\n"
REGISTRY_COMMENT = (
    f"{REGISTRY_SIGN}"
    "    # Any decoder model with head size 64, 128 or 256 and 1 to 16 query\n"
    "    # heads per KV head; bfloat16 or float16 activations; KV cache auto,\n"
    "    # bfloat16, float16, fp8 or fp8_e4m3; kernel block sizes 16, 32 and 64;\n"
    "    # sliding window and logits soft-cap. Compute capability 9.x only; no\n"
    "    # attention sinks, MLA, encoder attention or ALiBi.\n"
)

# Exact replacements in vLLM's own Python files, by path below the vllm
# package: each is applied to an installed vLLM and to a checkout alike.
# See PACKAGE_EDITS below.
FUSION_GATE_OLD = """\
        if self.fuse_rope_kvcache and not current_platform.is_rocm():
            logger.warning_once(
                "KV cache fusion currently only enabled on ROCm. "
                "The fusion will be disabled."
            )
            self.fuse_rope_kvcache = False
        if self.fuse_qk_norm_rope_kvcache and not current_platform.is_rocm():
            logger.warning_once(
                "QK-Norm+RoPE+KVCache fusion requires ROCm with AITER. "
                "The fusion will be disabled."
            )
            self.fuse_qk_norm_rope_kvcache = False
"""
FUSION_GATE_NEW = """\
        # On CUDA the two passes fuse only the attention layers whose
        # implementation reports support for them (e.g. HPC_ATTN); every
        # other layer keeps its unfused ops.
        if self.fuse_rope_kvcache and not current_platform.is_cuda_alike():
            logger.warning_once(
                "KV cache fusion currently only enabled on ROCm and CUDA. "
                "The fusion will be disabled."
            )
            self.fuse_rope_kvcache = False
        if self.fuse_qk_norm_rope_kvcache and not current_platform.is_cuda_alike():
            logger.warning_once(
                "QK-Norm+RoPE+KVCache fusion requires ROCm with AITER or CUDA. "
                "The fusion will be disabled."
            )
            self.fuse_qk_norm_rope_kvcache = False
"""
QUANT_FORMS_OLD = """\
            if supports_rope:
                for epsilon in [1e-5, 1e-6]:
                    for neox in [True, False]:
                        for quant_q in [False, True]:
"""
QUANT_FORMS_NEW = """\
            # The FP8-query form quantizes Q per tensor with an AITER op that
            # only ROCm registers.
            quant_forms = [False, True] if current_platform.is_rocm() else [False]
            if supports_rope:
                for epsilon in [1e-5, 1e-6]:
                    for neox in [True, False]:
                        for quant_q in quant_forms:
"""

# The vLLM-side _hpc_C target: a template whose @HPC_SOURCES@ line becomes
# the kernel sources, one quoted path a line, as vLLM's lists are written.
CMAKE_TEMPLATE = "cmake/hpc_extension.vllm.cmake.in"
CMAKE_FRAGMENT = "cmake/hpc_extension.cmake"
SOURCES_PLACEHOLDER = "@HPC_SOURCES@"
KERNEL_SUFFIXES = (".cu", ".cpp")

BENCHMARKS = "benchmarks/kernels"
# Benchmark scripts outside it that the PR carries to the same path.
BENCHMARK_SCRIPTS = ("benchmarks/benchmark_e2e.py",)

Manifest = dict[str, Any]
PLURAL = {"link": "links", "copy": "copies"}


class PatchSetError(Exception):
    """A refusal or failure, reported as one line with an exit code."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Edit:
    """A file of the checkout the patch set writes, not links or copies.

    ``make`` turns the upstream text (None: there is no such file) into the
    patch set's; ``sign`` is a line that only the result has.
    """

    make: Callable[[str | None], str]
    sign: str


@dataclass(frozen=True)
class Replace:
    """An exact replacement in an upstream file: ``old``, vLLM 0.33.0's
    text, must occur in it once. The first line of ``new`` that ``old``
    does not have serves as the edit's sign."""

    rel: str  # path below ``base``
    what: str
    old: str
    new: str
    base: str = "vllm/"  # where ``rel`` starts, in a vLLM checkout

    @property
    def path(self) -> str:
        """The file's path in a vLLM checkout."""
        return self.base + self.rel

    @property
    def sign(self) -> str:
        before = set(self.old.splitlines(keepends=True))
        return next(
            line for line in self.new.splitlines(keepends=True) if line not in before
        )

    def __call__(self, text: str) -> str:
        found = text.count(self.old)
        if found != 1:
            where = "not found" if found == 0 else f"found {found} times"
            raise PatchSetError(
                f"{self.path}: the vLLM {BASE_VERSION} text of {self.what} "
                f"is {where}; refusing to edit it"
            )
        return text.replace(self.old, self.new)


@dataclass
class Layout:
    """Where the patch set goes; file paths are relative to ``root``."""

    root: Path  # holds the backup directory
    package: Path  # the vllm package directory
    label: str  # prefix turning a root-relative path into a vLLM repo path
    files: dict[str, Path]  # destination -> patch-set file
    edits: dict[str, Edit] = field(default_factory=dict)
    source: bool = False
    # Files the patch set adds and must not find upstream (outside vllm/).
    new_only: frozenset[str] = frozenset()
    # The CMake fragment's template (checkouts only), for the series' steps.
    template: str = ""

    def repo_path(self, rel: str) -> str:
        return self.label + rel


# --- locating things ------------------------------------------------------


def tree_files(base: Path) -> dict[str, Path]:
    """Files under ``base`` by relative POSIX path, without bytecode and
    hidden files (an editor's swap files, a test cache)."""
    found: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [
            d for d in dirnames if d != "__pycache__" and not d.startswith(".")
        ]
        for name in filenames:
            if not name.endswith(".pyc") and not name.startswith("."):
                path = Path(dirpath, name)
                found[path.relative_to(base).as_posix()] = path
    return dict(sorted(found.items()))


def find_installed_vllm(tree: Path = REPO_ROOT) -> Path:
    """The installed vllm package directory, located without importing it.

    The tree is kept off the search path so that its ``vllm/`` directory (a
    namespace package, it has no ``__init__.py``) is never taken for vLLM.
    """
    saved = sys.path[:]
    tree = tree.resolve()
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != tree]
    try:
        spec = importlib.util.find_spec("vllm")
    finally:
        sys.path[:] = saved
    if spec is None or not spec.origin or not spec.origin.endswith("__init__.py"):
        raise PatchSetError(
            f"vLLM is not installed for {sys.executable}; pass --target DIR"
        )
    return Path(spec.origin).parent


def installed_layout(target: Path, tree: Path) -> Layout:
    if not target.is_dir():
        raise PatchSetError(f"{target} is not a directory")
    files = tree_files(tree / "vllm")
    if not files:
        raise PatchSetError(f"no patch-set files under {tree / 'vllm'}")
    edits = package_edits("")
    if clash := sorted(set(files) & set(edits)):
        raise PatchSetError(f"the tree replaces the edited file(s) {clash}")
    return Layout(root=target, package=target, label="vllm/", files=files, edits=edits)


def package_edits(prefix: str) -> dict[str, Edit]:
    """PACKAGE_EDITS as edits of the files at ``prefix`` + their path."""
    return {
        prefix + r.rel: Edit(_upstream(r, f"vllm/{r.rel}"), r.sign)
        for r in PACKAGE_EDITS
    }


def source_files(tree: Path) -> dict[str, Path]:
    """The tree's files by their path in a vLLM checkout."""
    files = {
        f"vllm/{rel}": path
        for rel, path in tree_files(tree / "vllm").items()
        # The checkout builds its own library, so a prebuilt one is not copied.
        if not rel.endswith(".so")
    }
    kernels = tree_files(tree / "csrc" / "hpc")
    if not kernels or not (tree / CMAKE_TEMPLATE).is_file():
        raise PatchSetError(f"{tree} lacks csrc/hpc/ or {CMAKE_TEMPLATE}")
    files.update({f"csrc/hpc/{rel}": path for rel, path in kernels.items()})
    files.update(
        {f"tests/{rel}": path for rel, path in tree_files(tree / "tests").items()}
    )
    for rel, path in tree_files(tree / BENCHMARKS).items():
        files[f"{BENCHMARKS}/{rel}"] = path
    for rel in BENCHMARK_SCRIPTS:
        if (tree / rel).is_file():
            files[rel] = tree / rel
    return dict(sorted(files.items()))


def kernel_sources(files: Iterable[str]) -> list[str]:
    """The translation units of ``_hpc_C``, by their path in the checkout."""
    return sorted(
        rel
        for rel in files
        if rel.startswith("csrc/hpc/") and rel.endswith(KERNEL_SUFFIXES)
    )


def vllm_cmake_fragment(template: str, sources: list[str]) -> str:
    """The vLLM-side ``_hpc_C`` target with its sources listed."""
    lines = template.splitlines(keepends=True)
    at = [i for i, line in enumerate(lines) if SOURCES_PLACEHOLDER in line]
    if len(at) != 1 or not sources:
        raise PatchSetError(
            f"{CMAKE_TEMPLATE} needs one {SOURCES_PLACEHOLDER} line and sources"
        )
    listed = "\n".join(f'  "{rel}"' for rel in sources)
    lines[at[0]] = lines[at[0]].replace(SOURCES_PLACEHOLDER, listed)
    return "".join(lines)


def source_layout(src: Path, tree: Path) -> Layout:
    for name in ("vllm", "CMakeLists.txt", "setup.py"):
        if not (src / name).exists():
            raise PatchSetError(f"{src} is not a vLLM source checkout: no {name}")
    files = source_files(tree)
    template = (tree / CMAKE_TEMPLATE).read_text()
    fragment = vllm_cmake_fragment(template, kernel_sources(files))
    edits = {
        "CMakeLists.txt": Edit(_upstream(wire_cmake, "CMakeLists.txt"), CMAKE_SIGN),
        "setup.py": Edit(_upstream(wire_setup, "setup.py"), SETUP_SIGN),
        CMAKE_FRAGMENT: Edit(lambda _: fragment, fragment.splitlines()[1] + "\n"),
        REGISTRY: Edit(_upstream(describe_backend, REGISTRY), REGISTRY_SIGN),
        **package_edits("vllm/"),
        **source_edits(),
    }
    new_only = frozenset(rel for rel in files if not rel.startswith("vllm/"))
    return Layout(src, src / "vllm", "", files, edits, True, new_only, template)


def source_edits() -> dict[str, Edit]:
    """SOURCE_EDITS as one edit per file, its replacements made in order;
    the first one's sign is the file's."""
    by_file: dict[str, list[Replace]] = {}
    for r in SOURCE_EDITS:
        by_file.setdefault(r.path, []).append(r)

    def chain(replaces: list[Replace]) -> Callable[[str], str]:
        def edit(text: str) -> str:
            for r in replaces:
                text = r(text)
            return text

        return edit

    return {
        rel: Edit(_upstream(chain(replaces), rel), replaces[0].sign)
        for rel, replaces in by_file.items()
    }


def _upstream(edit: Callable[[str], str], rel: str) -> Callable[[str | None], str]:
    """``edit`` for a file that upstream has; refuses when it is missing."""

    def make(text: str | None) -> str:
        if text is None:
            raise PatchSetError(f"vLLM has no {rel} to edit")
        return edit(text)

    return make


# --- versions -------------------------------------------------------------

_VERSION_PY = re.compile(
    r"^__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]", re.M
)
_METADATA_VERSION = re.compile(r"^Version:\s*(\S+)", re.M)


def read_version(package: Path) -> str | None:
    """vLLM's version from ``_version.py`` or package metadata, no import."""
    version_py = package / "_version.py"
    if version_py.is_file() and (m := _VERSION_PY.search(version_py.read_text())):
        return m.group(1)
    metadata = sorted(package.parent.glob("vllm-*.dist-info/METADATA"))
    for path in [*metadata, package.parent / "PKG-INFO"]:
        if path.is_file() and (m := _METADATA_VERSION.search(path.read_text())):
            return m.group(1)
    return None


def _git_version(src: Path) -> str | None:
    if not (src / ".git").exists():
        return None
    try:
        out = subprocess.run(
            ["git", "-C", str(src), "describe", "--tags", "--match", "v[0-9]*"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out.removeprefix("v") or None


def require_version(layout: Layout) -> str:
    found = read_version(layout.package)
    if found is None and layout.source:
        found = _git_version(layout.root)
    if found is None:
        raise PatchSetError(
            f"cannot determine the vLLM version of {layout.package}; refusing", 2
        )
    if found.split("+")[0] != BASE_VERSION:
        raise PatchSetError(
            f"this patch set is for vLLM {BASE_VERSION}, found {found} "
            f"at {layout.package}",
            2,
        )
    return found


# --- build wiring (source checkouts) --------------------------------------

_FLASH_ATTN_INCLUDE = re.compile(r"\s*include\(.*vllm_flash_attn\.cmake")
_SETUP_ANCHOR = re.compile(
    r'^[ \t]*ext_modules\.append\(CMakeExtension\(name="vllm\._C\w*"', re.M
)


def wire_cmake(text: str) -> str:
    """Add the ``_hpc_C`` include block to vLLM's CMakeLists.txt.

    It goes right before the block that includes vllm-flash-attn, which must
    stay last because it redefines vLLM's CMake helpers; else at the end.
    """
    lines = text.splitlines(keepends=True)
    at = next((i for i, s in enumerate(lines) if _FLASH_ATTN_INCLUDE.match(s)), None)
    if at is None:
        body = text if not text or text.endswith("\n") else text + "\n"
        return f"{body}\n{CMAKE_BLOCK}"
    start = at
    for i in range(at - 1, -1, -1):
        line = lines[i]
        if line.strip() and not line[0].isspace() and not line.startswith("#"):
            if re.match(r"if\s*\(", line):
                start = i  # the include sits inside this top-level if()
            break
    while start > 0 and lines[start - 1].startswith("#"):
        start -= 1
    return "".join(lines[:start]) + CMAKE_BLOCK + "\n" + "".join(lines[start:])


def wire_setup(text: str) -> str:
    """Add the ``vllm._hpc_C`` extension to vLLM's setup.py.

    The block follows the top-level statement that adds the last
    ``vllm._C*`` extension and builds ``_hpc_C`` for CUDA only.
    """
    anchors = list(_SETUP_ANCHOR.finditer(text))
    if not anchors or not re.search(r"^def _is_cuda\(", text, re.M):
        raise PatchSetError("setup.py has no vllm._C extension to add _hpc_C next to")
    lines = text.splitlines(keepends=True)
    anchor = text.count("\n", 0, anchors[-1].start())
    end = anchor + 1
    while end < len(lines) and (not lines[end].strip() or lines[end][0] in " \t#"):
        end += 1
    while end > anchor + 1 and (
        not lines[end - 1].strip() or lines[end - 1].startswith("#")
    ):
        end -= 1
    wired = "".join(lines[:end]) + "\n" + SETUP_BLOCK + "".join(lines[end:])
    try:
        ast.parse(wired)
    except SyntaxError as e:
        raise PatchSetError(f"wiring setup.py would break it: {e}") from e
    return wired


def describe_backend(text: str) -> str:
    """Replace the registry's comment on ``HPC_ATTN`` with what it supports."""
    lines = text.splitlines(keepends=True)
    at = [i for i, line in enumerate(lines) if re.match(r"\s*HPC_ATTN\s*=", line)]
    if len(at) != 1:
        raise PatchSetError(f"{REGISTRY} has no single HPC_ATTN entry")
    start = at[0]
    while start > 0 and lines[start - 1].lstrip().startswith("#"):
        start -= 1
    return "".join(lines[:start]) + REGISTRY_COMMENT + "".join(lines[at[0] :])


# PassConfig.__post_init__ forces both flags off outside ROCm, although the
# passes ask each layer's attention implementation whether it supports the
# fusion and skip it otherwise (no CUDA backend of vLLM 0.33.0 does). The
# QK-norm pass also registers an FP8-query form that calls an op only ROCm
# registers, which would fail on the first layer that supports the fusion.
# Hy3 calls attention with K and V that HpcRopeNorm already wrote into the
# cache: vLLM's KV-cache write bypass (key=None, value=None), which HPC_ATTN
# supports, instead of the raw K/V that the backend would write again.
HY3_ATTN_CALL_OLD = """\
            q = self.hpc_rope_norm(qkv, self.attn.layer_name)
            q = q.view(-1, self.num_heads * self.head_dim)
            attn_output = self.attn(q, k, v, output_shape, self.dtype)
"""
HY3_ATTN_CALL_NEW = """\
            q = self.hpc_rope_norm(qkv, self.attn.layer_name)
            q = q.view(-1, self.num_heads * self.head_dim)
            # K/V are in the cache already: attention reads them there.
            attn_output = self.attn(q, None, None, output_shape, self.dtype)
"""

PACKAGE_EDITS: tuple[Replace, ...] = (
    Replace(
        "config/compilation.py",
        "the ROCm-only RoPE+KV-cache fusion gates of PassConfig.__post_init__",
        FUSION_GATE_OLD,
        FUSION_GATE_NEW,
    ),
    Replace(
        "compilation/passes/fusion/qk_norm_rope_kvcache_fusion.py",
        "the FP8-query patterns of QkNormRopeKvCacheFusionPass",
        QUANT_FORMS_OLD,
        QUANT_FORMS_NEW,
    ),
    Replace(
        "model_executor/models/hy_v3.py",
        "Hy3's attention call after HpcRopeNorm",
        HY3_ATTN_CALL_OLD,
        HY3_ATTN_CALL_NEW,
    ),
)


# vLLM's generic backend-correctness test gets HPC_ATTN in its backend lists,
# as a PR adding a backend does. The backends of one list are compared in one
# test case, so a backend that refuses the case's configuration through its
# selection hooks (validate_configuration: compute capability, attention
# type, non-causal attention, ...) is left out of that comparison and named
# with its reasons: as a warning when others were compared, as the case's
# skip reason when none was. HPC_ATTN joins the causal and the decoder
# sliding-window lists, not the non-causal one, which it refuses throughout.
BACKEND_TESTS = "tests/v1/attention/test_attention_backends.py"
BACKEND_LIST_OLD = """\
BACKENDS_TO_TEST = [
    AttentionBackendEnum.FLASH_ATTN,
    AttentionBackendEnum.FLASHINFER,
    AttentionBackendEnum.FLEX_ATTENTION,
    AttentionBackendEnum.TRITON_ATTN,
    "FLEX_ATTENTION_SLOW",
]
"""
BACKEND_LIST_NEW = """\
BACKENDS_TO_TEST = [
    AttentionBackendEnum.FLASH_ATTN,
    AttentionBackendEnum.FLASHINFER,
    AttentionBackendEnum.FLEX_ATTENTION,
    AttentionBackendEnum.TRITON_ATTN,
    AttentionBackendEnum.HPC_ATTN,
    "FLEX_ATTENTION_SLOW",
]
"""
WINDOW_LIST_OLD = """\
else:
    SLIDING_WINDOW_BACKENDS_TO_TEST = [
        AttentionBackendEnum.FLASH_ATTN,
        AttentionBackendEnum.FLEX_ATTENTION,
        AttentionBackendEnum.TRITON_ATTN,
        "FLEX_ATTENTION_SLOW",
    ]
"""
WINDOW_LIST_NEW = """\
else:
    SLIDING_WINDOW_BACKENDS_TO_TEST = [
        AttentionBackendEnum.FLASH_ATTN,
        AttentionBackendEnum.FLEX_ATTENTION,
        AttentionBackendEnum.TRITON_ATTN,
        AttentionBackendEnum.HPC_ATTN,
        "FLEX_ATTENTION_SLOW",
    ]
"""
STDLIB_IMPORTS_OLD = """\
from dataclasses import replace
from functools import partial
"""
STDLIB_IMPORTS_NEW = """\
import warnings
from dataclasses import replace
from functools import partial
"""
SELECTOR_IMPORT_OLD = """\
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import (
"""
SELECTOR_IMPORT_NEW = """\
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.selector import AttentionSelectorConfig
from vllm.v1.kv_cache_interface import (
"""
REFUSALS_OLD = """\
    return output


def _test_backend_correctness(
"""
REFUSALS_NEW = '''\
    return output


def _selection_refusals(
    backend: AttentionBackendEnum | str,
    vllm_config,
    attn_type: AttentionType,
    causal: bool,
    use_sinks: bool,
) -> list[str]:
    """Why the attention selector would not pick ``backend`` for the test's
    configuration, in the backend's own words; empty when it would (or when
    the platform has no device capability to select by)."""
    device_capability = current_platform.get_device_capability()
    if device_capability is None:
        return []
    model_config = vllm_config.model_config
    selector_config = AttentionSelectorConfig(
        head_size=model_config.get_head_size(),
        dtype=_convert_dtype_to_torch(model_config.dtype),
        kv_cache_dtype=vllm_config.cache_config.cache_dtype,
        block_size=vllm_config.cache_config.block_size,
        has_sink=use_sinks,
        attn_type=attn_type,
        has_sliding_window=model_config.get_sliding_window() is not None,
        use_non_causal=not causal and attn_type == AttentionType.DECODER,
    )
    backend_cls = _actual_backend(backend).get_class()
    # Some backends read the model's head counts off the current config.
    with set_current_vllm_config(vllm_config):
        return backend_cls.validate_configuration(
            device_capability=device_capability, **selector_config._asdict()
        )


def _test_backend_correctness(
'''
COMPARE_OLD = """\
    for backend_name in backend_to_test:
        backend_cls = _actual_backend(backend_name).get_class()

        if is_quantized_kv_cache(kv_cache_dtype) and (
            not backend_cls.supports_kv_cache_dtype(kv_cache_dtype)
        ):
            continue
"""
COMPARE_NEW = """\
    refused: dict[str, list[str]] = {}
    for backend_name in backend_to_test:
        backend_cls = _actual_backend(backend_name).get_class()

        if is_quantized_kv_cache(kv_cache_dtype) and (
            not backend_cls.supports_kv_cache_dtype(kv_cache_dtype)
        ):
            continue
        # A backend is compared only on configurations it accepts at selection.
        reasons = _selection_refusals(
            backend_name, vllm_config, attn_type, causal, use_sinks
        )
        if reasons:
            refused[str(backend_name)] = reasons
            continue
"""
REPORT_OLD = """\
            msg=partial(error_msg, backend_name=backend_name),
        )


@pytest.mark.parametrize("layout", ["BLHNC", "BHLNC"])
"""
REPORT_NEW = """\
            msg=partial(error_msg, backend_name=backend_name),
        )

    if refused:
        reasons = "; ".join(
            f"{name}: {', '.join(why)}" for name, why in refused.items()
        )
        if len(refused) == len(backend_to_test):
            pytest.skip(f"Refused at backend selection: {reasons}")
        warnings.warn(
            f"Not compared, refused at backend selection: {reasons}", stacklevel=2
        )


@pytest.mark.parametrize("layout", ["BLHNC", "BHLNC"])
"""

# Exact replacements in vLLM's files outside the vllm package (checkouts
# only), by path in the checkout. The first of a file signs its edit.
SOURCE_EDITS: tuple[Replace, ...] = tuple(
    Replace(BACKEND_TESTS, what, old, new, base="")
    for what, old, new in (
        ("the BACKENDS_TO_TEST list", BACKEND_LIST_OLD, BACKEND_LIST_NEW),
        ("its standard-library imports", STDLIB_IMPORTS_OLD, STDLIB_IMPORTS_NEW),
        ("its attention registry import", SELECTOR_IMPORT_OLD, SELECTOR_IMPORT_NEW),
        ("the end of run_attention_backend", REFUSALS_OLD, REFUSALS_NEW),
        ("the loop of _test_backend_correctness", COMPARE_OLD, COMPARE_NEW),
        ("the end of _test_backend_correctness", REPORT_OLD, REPORT_NEW),
        ("the CUDA sliding-window backend list", WINDOW_LIST_OLD, WINDOW_LIST_NEW),
    )
)


# --- upstream pieces the patch set relies on ------------------------------


def _has_hpc_attn_entry(module: ast.Module) -> bool:
    return any(
        isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "HPC_ATTN" for t in node.targets)
        and isinstance(node.value, ast.Constant)
        and node.value.value == HPC_ATTN_BACKEND
        for node in ast.walk(module)
    )


def _forward_takes_output_dtype(module: ast.Module) -> bool:
    for cls in module.body:
        if isinstance(cls, ast.ClassDef) and cls.name == "Attention":
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "forward":
                    params = [*fn.args.args, *fn.args.kwonlyargs]
                    return any(p.arg == "output_dtype" for p in params)
    return False


def _fp8_oracle_maps_hpc(module: ast.Module) -> bool:
    for node in ast.walk(module):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if (
                    isinstance(key, ast.Constant)
                    and key.value == "hpc"
                    and isinstance(value, ast.Attribute)
                    and value.attr == "HPC"
                    and isinstance(value.value, ast.Name)
                    and value.value.id == "Fp8MoeBackend"
                ):
                    return True
    return False


UPSTREAM_CHECKS: tuple[tuple[str, str, Callable[[ast.Module], bool]], ...] = (
    (
        "v1/attention/backends/registry.py",
        "HPC_ATTN attention backend entry",
        _has_hpc_attn_entry,
    ),
    (
        "model_executor/layers/attention/attention.py",
        "output_dtype parameter of Attention.forward",
        _forward_takes_output_dtype,
    ),
    (
        "model_executor/layers/fused_moe/oracle/fp8.py",
        '"hpc" -> Fp8MoeBackend.HPC in the FP8 MoE oracle',
        _fp8_oracle_maps_hpc,
    ),
)


def upstream_checks(package: Path) -> list[tuple[str, str, bool]]:
    """(file, description, passed) for each upstream piece, by inspection."""
    results = []
    for rel, what, predicate in UPSTREAM_CHECKS:
        path = package / rel
        try:
            passed = predicate(ast.parse(path.read_text(), str(path)))
        except (OSError, SyntaxError, UnicodeDecodeError):
            passed = False
        results.append((rel, what, passed))
    return results


# --- manifest and files ---------------------------------------------------


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def load_manifest(root: Path) -> Manifest | None:
    path = root / STATE_DIR / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise PatchSetError(f"unreadable manifest {path}: {e}") from e


def save_manifest(root: Path, manifest: Manifest) -> None:
    path = root / STATE_DIR / MANIFEST
    path.parent.mkdir(parents=True, exist_ok=True)
    # Git leaves the backups out of a checkout's commit (`git add -A`).
    ignore = path.parent / ".gitignore"
    if not ignore.is_file():
        ignore.write_text("*\n")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


def _exists(path: Path) -> bool:
    return path.is_symlink() or path.exists()


def _verified_backup(root: Path, rel: str, entry: dict[str, str]) -> bytes:
    backup = root / STATE_DIR / rel
    if not backup.is_file() or _sha256(backup.read_bytes()) != entry["sha256"]:
        raise PatchSetError(f"backup of {rel} is missing or altered; not restoring")
    return backup.read_bytes()


def _restore(root: Path, rel: str, entry: dict[str, str]) -> None:
    dest = root / rel
    if entry["kind"] == "new":
        if _exists(dest):
            dest.unlink()
        if dest.suffix == ".py":
            for pyc in (dest.parent / "__pycache__").glob(f"{dest.stem}.*.pyc"):
                pyc.unlink()
        return
    _verified_backup(root, rel, entry)
    if _exists(dest):
        dest.unlink()
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(root / STATE_DIR / rel, dest)
    if _sha256(dest.read_bytes()) != entry["sha256"]:
        raise PatchSetError(f"restoring {dest} failed: sha256 mismatch")


def _place(src: Path, dest: Path, mode: str) -> bool:
    """Put ``src`` at ``dest`` as a link or a copy; False if already there."""
    if mode == "link" and dest.is_symlink() and os.readlink(dest) == str(src):
        return False
    if (
        mode == "copy"
        and not dest.is_symlink()
        and dest.is_file()
        and dest.read_bytes() == src.read_bytes()
    ):
        return False
    if _exists(dest):
        dest.unlink()
    dest.parent.mkdir(parents=True, exist_ok=True)
    if mode == "link":
        dest.symlink_to(src)
    else:
        shutil.copy2(src, dest)
    return True


def _text(path: Path) -> str | None:
    """A file's text, or None for a binary file."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode()
    except UnicodeDecodeError:
        return None


def _original_text(
    layout: Layout, rel: str, entry: dict[str, str] | None
) -> str | None:
    """Upstream text of a file the patch set writes; None: upstream has none."""
    if entry is not None:
        if entry["kind"] == "new":
            return None
        return _verified_backup(layout.root, rel, entry).decode()
    path = layout.root / rel
    if not path.is_file():
        return None
    text = path.read_bytes().decode()
    if layout.edits[rel].sign in text.splitlines(keepends=True):
        raise PatchSetError(f"{path} is already wired but has no backup")
    return text


# --- actions --------------------------------------------------------------


def refuse_replacing(layout: Layout, entries: dict[str, dict[str, str]]) -> None:
    """Refuses when a file the patch set only adds is one upstream has.

    Outside vllm/ the change adds tests, kernels and benchmarks beside
    vLLM's; replacing one of vLLM's files there would drop upstream's.
    """
    taken = sorted(
        layout.repo_path(rel)
        for rel in layout.new_only
        if (
            entries[rel]["kind"] != "new"
            if rel in entries
            else _exists(layout.root / rel)
        )
    )
    if taken:
        raise PatchSetError(
            f"vLLM already has {', '.join(taken)}; the patch set only adds "
            "files outside vllm/, refusing to replace them"
        )


def apply(layout: Layout, mode: str, verbose: bool = False) -> None:
    version = require_version(layout)
    root = layout.root
    manifest = load_manifest(root) or {"base_version": version, "files": {}}
    manifest.setdefault("dirs", [])
    entries: dict[str, dict[str, str]] = manifest["files"]
    # Everything that can fail is worked out before anything changes.
    refuse_replacing(layout, entries)
    for rel in layout.files:
        if rel not in entries and (root / rel).is_symlink():
            raise PatchSetError(f"{root / rel} is a link with no backup record")
    edited = {
        rel: edit.make(_original_text(layout, rel, entries.get(rel)))
        for rel, edit in layout.edits.items()
    }
    for rel, entry in entries.items():
        if entry["kind"] != "new":
            _verified_backup(root, rel, entry)

    for rel in sorted(set(entries) - set(layout.files) - set(layout.edits)):
        _restore(root, rel, entries.pop(rel))
        (root / STATE_DIR / rel).unlink(missing_ok=True)
        if verbose:
            print(f"restored {layout.repo_path(rel)} (no longer in the patch set)")
    for rel in [*layout.files, *layout.edits]:
        if rel in entries:
            continue
        dest = root / rel
        if dest.exists():
            backup = root / STATE_DIR / rel
            backup.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(dest, backup)
            kind = "edited" if rel in layout.edits else "replaced"
            entries[rel] = {"kind": kind, "sha256": _sha256(backup.read_bytes())}
        else:
            entries[rel] = {"kind": "new"}
            parent = dest.parent
            while parent != root and not parent.exists():
                if (d := parent.relative_to(root).as_posix()) not in manifest["dirs"]:
                    manifest["dirs"].append(d)
                parent = parent.parent
    save_manifest(root, manifest)

    changed = 0
    for rel, src in layout.files.items():
        if _place(src, root / rel, mode):
            changed += 1
            if verbose:
                print(f"{mode} {layout.repo_path(rel)}")
    for rel, text in edited.items():
        dest = root / rel
        if not dest.is_file() or dest.is_symlink() or dest.read_text() != text:
            dest.unlink(missing_ok=True)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(text.encode())
            changed += 1
            if verbose:
                print(f"wired {layout.repo_path(rel)}")
    manifest["mode"] = mode
    save_manifest(root, manifest)
    total = len(layout.files) + len(layout.edits)
    print(
        f"applied the patch set to {root} as {PLURAL[mode]} "
        f"({changed} of {total} files updated)"
    )


def revert(layout: Layout, verbose: bool = False) -> None:
    require_version(layout)
    root = layout.root
    manifest = load_manifest(root)
    if manifest is None:
        print(f"nothing to revert: no patch set recorded in {root}")
        return
    entries: dict[str, dict[str, str]] = manifest["files"]
    for rel, entry in entries.items():
        if entry["kind"] != "new":
            _verified_backup(root, rel, entry)
    for rel, entry in sorted(entries.items()):
        _restore(root, rel, entry)
        if verbose:
            done = "removed" if entry["kind"] == "new" else "restored"
            print(f"{done} {layout.repo_path(rel)}")
    for rel in sorted(manifest.get("dirs", []), key=len, reverse=True):
        path = root / rel
        for d in (path / "__pycache__", path):
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()
    shutil.rmtree(root / STATE_DIR)
    new = sum(entry["kind"] == "new" for entry in entries.values())
    print(
        f"reverted {root}: {len(entries) - new} upstream files restored, "
        f"{new} new files removed"
    )


def file_state(dest: Path, src: Path, entry: dict[str, str] | None) -> str:
    if dest.is_symlink():
        return "applied as link" if os.readlink(dest) == str(src) else "stale link"
    if not dest.exists():
        return "not applied"
    data = dest.read_bytes()
    if data == src.read_bytes():
        return "applied as copy"
    if entry is None or entry.get("sha256") == _sha256(data):
        return "upstream"
    return "stale copy"


def _edit_state(layout: Layout, rel: str, entry: dict[str, str] | None) -> str:
    path = layout.root / rel
    current = path.read_bytes().decode() if path.is_file() else None
    edit = layout.edits[rel]
    if entry is None:
        wired = current is not None and edit.sign in current.splitlines(True)
        return "stale edit" if wired else "not applied"
    original = _original_text(layout, rel, entry)
    if current is None:
        return "not applied"
    if current == edit.make(original):
        return "applied as edit"
    return "upstream" if current == original else "stale edit"


def check(layout: Layout) -> bool:
    """Print the state of the patch set; True when applied and all checks pass."""
    version = require_version(layout)
    manifest = load_manifest(layout.root)
    entries = manifest["files"] if manifest else {}
    mode = manifest.get("mode") if manifest else None
    recorded = f", applied as {PLURAL[mode]}" if mode in PLURAL else ""
    print(f"vLLM {version} at {layout.package}{recorded}")
    states = [
        (file_state(layout.root / rel, src, entries.get(rel)), layout.repo_path(rel))
        for rel, src in layout.files.items()
    ]
    states += [
        (_edit_state(layout, rel, entries.get(rel)), layout.repo_path(rel))
        for rel in layout.edits
    ]
    states += [
        ("left over", layout.repo_path(rel))
        for rel in sorted(set(entries) - set(layout.files) - set(layout.edits))
    ]
    for state, path in states:
        print(f"{state:<16} {path}")
    results = upstream_checks(layout.package)
    for rel, what, passed in results:
        print(f"{'ok' if passed else 'missing':<16} {what} (vllm/{rel})")
    not_applied = sum(not state.startswith("applied") for state, _ in states)
    failed = sum(not passed for *_, passed in results)
    if not_applied or failed:
        print(
            f"patch set not in order: {not_applied} of {len(states)} files not "
            f"applied, {failed} upstream checks failed"
        )
        return False
    print(f"patch set applied ({len(states)} files), all upstream checks passed")
    return True


def _unified(old: str | None, new: str, path: str, mode: str) -> str:
    lines = difflib.unified_diff(
        (old or "").splitlines(keepends=True),
        new.splitlines(keepends=True),
        "/dev/null" if old is None else f"a/{path}",
        f"b/{path}",
    )
    body = "".join(
        line if line.endswith("\n") else line + "\n\\ No newline at end of file\n"
        for line in lines
    )
    if old is None:
        return f"diff --git a/{path} b/{path}\nnew file mode {mode}\n{body}"
    return f"diff --git a/{path} b/{path}\n{body}" if body else ""


def _changes(layout: Layout) -> dict[str, tuple[str | None, str, str]]:
    """Each text file the patch set writes: (upstream text or None, its
    text, git mode). Binary files are left out, as a patch cannot carry them."""
    require_version(layout)
    manifest = load_manifest(layout.root)
    entries = manifest["files"] if manifest else {}
    refuse_replacing(layout, entries)
    changes: dict[str, tuple[str | None, str, str]] = {}
    for rel, src in layout.files.items():
        new = _text(src)
        if new is None:
            continue
        entry = entries.get(rel)
        dest = layout.root / rel
        if entry is not None:
            old = (
                None if entry["kind"] == "new" else _text(layout.root / STATE_DIR / rel)
            )
        else:
            old = _text(dest) if dest.is_file() and not dest.is_symlink() else None
        mode = "100755" if os.access(src, os.X_OK) else "100644"
        changes[rel] = (old, new, mode)
    for rel, edit in layout.edits.items():
        old = _original_text(layout, rel, entries.get(rel))
        changes[rel] = (old, edit.make(old), "100644")
    return dict(sorted(changes.items()))


def diff(layout: Layout) -> str:
    """The patch set as a unified diff against upstream (text files only)."""
    return "".join(
        _unified(old, new, layout.repo_path(rel), mode)
        for rel, (old, new, mode) in _changes(layout).items()
    )


# --- the change as a series of patches ------------------------------------


@dataclass(frozen=True)
class Step:
    """One patch of the series: the files whose repo paths match ``paths``
    (``fnmatch`` globs, ``*`` also crossing ``/``) arrive whole in it."""

    slug: str
    title: str
    about: str
    paths: tuple[str, ...]


# The series, in dependency order. Every file of the change is claimed by
# exactly one step; an unclaimed file or one claimed twice is refused, so a
# file added to the tree needs a line here.
#
# Why the kernels of all families arrive in step 1: the _hpc_C library is
# one shared object whose torch_bindings.cpp registers every op (RoPE+norm,
# decode, prefill, MoE) by address. Without the implementations of them all
# it links with undefined symbols and fails to load, and the list of ops is
# not split by hunk. The only other consistent cut would add the kernel
# sources uncompiled and wire the build in after the MoE kernel (step 5),
# leaving steps 1 to 4 without a library to run their GPU tests against. So
# step 1 carries the whole library, built and loadable; steps 2 and 3 carry
# what checks the decode and prefill kernels (references, tests,
# benchmarks), step 5 the Python MoE backend. The attention workspaces
# (hpc_attn_workspace.py, op module only) are in step 1 too: the kernel
# tests' conftest imports them. The FP8 oracle's "hpc" entry is vLLM
# 0.33.0's own (an upstream check, not an edit), so step 5 edits nothing
# there. The layer test of the prologue checks the backend's metadata and
# so comes with the backend (step 4).
SERIES: tuple[Step, ...] = (
    Step(
        "hpc-c-library-and-rope-norm-prologue",
        "[Kernel] _hpc_C: Hopper kernels, build wiring, op module and the "
        "fused QK-norm + RoPE + KV-cache prologue",
        "Adds the _hpc_C extension (csrc/hpc/: shared helpers, the fused "
        "QK-norm + RoPE + KV-cache store, the paged decode kernel and its "
        "planner, the paged prefill kernel, the FP8 MoE kernel, the op "
        "schemas), its CMake target (built only for 9.0a with nvcc >= 13.0) "
        "and its wiring into CMakeLists.txt and setup.py; the typed op module "
        "vllm/_hpc_ops.py and its validation, vllm/utils/hpc.py, the "
        "attention workspaces; the kernel tests' "
        "set-up and the prologue's tests and benchmark. All kernels come "
        "together because the op "
        "registration references each of them.",
        (
            "CMakeLists.txt",
            "setup.py",
            "cmake/*",
            "csrc/hpc/*",
            "vllm/_hpc_ops.py",
            "vllm/_hpc_ops_validation.py",
            "vllm/utils/hpc.py",
            "vllm/v1/attention/ops/hpc_attn_workspace.py",
            "tests/kernels/hpc/conftest.py",
            "tests/kernels/hpc/utils.py",
            "tests/kernels/hpc/sanitizer_runner.py",
            "tests/kernels/hpc/test_module_imports.py",
            "tests/kernels/hpc/test_kernel_limits.py",
            "tests/kernels/hpc/*rope_norm*",
            "benchmarks/kernels/bench_utils.py",
            "benchmarks/kernels/check_hopper.py",
            "benchmarks/kernels/benchmark_rope_norm.py",
            "tests/benchmarks/test_benchmark_utils.py",
        ),
    ),
    Step(
        "hpc-decode-tests-and-benchmarks",
        "[Kernel] _hpc_C decode: reference, planner and kernel tests, "
        "benchmark and calibration",
        "The checks of the split-KV paged decode kernel and its planner: a "
        "PyTorch reference, CPU tests of the plan and the ops, GPU tests "
        "against the reference, a compute-sanitizer driver, the decode "
        "benchmark, its profiler and the split calibration.",
        (
            "tests/kernels/hpc/*decode*",
            "benchmarks/kernels/*decode*",
            "tests/benchmarks/*decode*",
        ),
    ),
    Step(
        "hpc-prefill-tests-and-benchmarks",
        "[Kernel] _hpc_C prefill: reference, kernel tests and benchmark",
        "The checks of the paged prefill kernel: a PyTorch reference, CPU "
        "tests of the ops, GPU tests, a compute-sanitizer driver, the prefill "
        "benchmark and its profiler.",
        (
            "tests/kernels/hpc/*prefill*",
            "benchmarks/kernels/*prefill*",
        ),
    ),
    Step(
        "hpc-attn-backend",
        "[Attention] HPC_ATTN backend on the _hpc_C kernels",
        "The HPC_ATTN attention backend (vllm/v1/attention/backends/"
        "hpc_attn.py), the registry's description of what it supports, the "
        "HpcRopeNorm prologue layer, which calls the backend's prologue, and "
        "Hy3's attention call reading K/V from the cache the prologue wrote "
        "(vLLM's KV-cache write bypass); their CPU and GPU tests. vLLM's "
        "backend-correctness test compares it "
        "with the other backends on the causal and sliding-window cases, "
        "each backend only on what it accepts at selection.",
        (
            "vllm/v1/attention/backends/*",
            "vllm/model_executor/layers/hpc/*",
            "vllm/model_executor/models/hy_v3.py",
            BACKEND_TESTS,
            "tests/v1/attention/conftest.py",
            "tests/v1/attention/test_hpc_attn_backend*",
            "tests/model_executor/layers/test_hpc_rope_norm_layer.py",
        ),
    ),
    Step(
        "hpc-fp8-moe-experts",
        "[MoE] HPCExperts: the FP8 MoE backend on the _hpc_C kernel",
        "HPCExperts (vllm/model_executor/layers/fused_moe/hpc_moe.py), the "
        "modular experts that vLLM's FP8 oracle selects for --moe-backend "
        "hpc, with the MoE reference, CPU and GPU tests, the oracle test, a "
        "compute-sanitizer driver and the MoE benchmark.",
        (
            "vllm/model_executor/layers/fused_moe/*",
            "tests/kernels/hpc/*moe*",
            "tests/kernels/moe/*",
            "benchmarks/kernels/*moe*",
            "tests/benchmarks/*moe*",
        ),
    ),
    Step(
        "cuda-rope-kvcache-fusion-passes",
        "[Compile] RoPE + KV-cache fusion passes on CUDA",
        "Lets PassConfig keep fuse_rope_kvcache and fuse_qk_norm_rope_kvcache "
        "on CUDA (the passes fuse only the layers whose attention "
        "implementation supports it, HPC_ATTN's) and registers the FP8-query "
        "pattern only on ROCm, which alone has its op; with the fusion tests "
        "and the end-to-end benchmark, which turns the fusion on.",
        (
            "vllm/config/compilation.py",
            "vllm/compilation/*",
            "tests/v1/attention/test_hpc_fusion_passes.py",
            "benchmarks/benchmark_e2e.py",
            "tests/benchmarks/test_benchmark_e2e.py",
        ),
    ),
)


@dataclass(frozen=True)
class SeriesPatch:
    step: Step
    files: tuple[str, ...]  # the files the step adds or changes, all of them
    text: str  # header and diff


def assign_steps(paths: list[str]) -> list[list[str]]:
    """``paths`` split over SERIES by its globs, one list per step."""
    groups: list[list[str]] = [[] for _ in SERIES]
    unclaimed, twice = [], []
    for rel in sorted(paths):
        claims = [
            i
            for i, step in enumerate(SERIES)
            if any(fnmatch.fnmatchcase(rel, glob) for glob in step.paths)
        ]
        if not claims:
            unclaimed.append(rel)
        elif len(claims) > 1:
            twice.append(f"{rel} ({', '.join(SERIES[i].slug for i in claims)})")
        else:
            groups[claims[0]].append(rel)
    if unclaimed or twice:
        raise PatchSetError(
            "the series table (SERIES) does not assign every file to one step: "
            + "; ".join(
                [f"no step claims {rel}" for rel in unclaimed]
                + [f"more than one step claims {what}" for what in twice]
            )
        )
    if empty := [
        step.slug for step, files in zip(SERIES, groups, strict=True) if not files
    ]:
        raise PatchSetError(f"series step(s) with no files: {', '.join(empty)}")
    return groups


def _series_header(number: int, step: Step, chunks: list[str]) -> str:
    """A ``git format-patch``-like header; ``git apply`` skips it, as it
    skips everything before the first ``diff --git`` line."""
    added = removed = 0
    for chunk in chunks:
        for line in chunk.splitlines():
            if line.startswith("+") and not line.startswith("+++ "):
                added += 1
            elif line.startswith("-") and not line.startswith("--- "):
                removed += 1
    about = textwrap.fill(step.about, 72)
    return (
        f"Subject: [PATCH {number}/{len(SERIES)}] {step.title}\n\n{about}\n\n---\n"
        f" {len(chunks)} files changed, {added} insertions(+), "
        f"{removed} deletions(-)\n\n"
    )


def series(layout: Layout) -> list[SeriesPatch]:
    """The change as SERIES' patches, each applying on the ones before.

    A file arrives whole in its step, except the generated CMake fragment:
    at each step it lists the kernel sources present then, so it is
    rewritten in any later step that adds sources.
    """
    changes = _changes(layout)
    groups = assign_steps([*layout.files, *layout.edits])
    present: list[str] = []
    fragment = changes[CMAKE_FRAGMENT][0] if CMAKE_FRAGMENT in changes else None
    patches = []
    for number, (step, files) in enumerate(zip(SERIES, groups, strict=True), 1):
        present += files
        chunks = [
            _unified(*changes[rel][:2], layout.repo_path(rel), changes[rel][2])
            for rel in files
            if rel in changes and rel != CMAKE_FRAGMENT
        ]
        sources = kernel_sources(present)
        if CMAKE_FRAGMENT in present:
            text = vllm_cmake_fragment(layout.template, sources)
            if text != fragment:
                chunks.append(_unified(fragment, text, CMAKE_FRAGMENT, "100644"))
                fragment = text
        elif sources:
            raise PatchSetError(
                f"series step {step.slug} adds kernel sources before "
                f"{CMAKE_FRAGMENT}, which builds them"
            )
        chunks = sorted(filter(None, chunks), key=lambda c: c.split(" ", 3)[2])
        text = _series_header(number, step, chunks) + "".join(chunks)
        patches.append(SeriesPatch(step, tuple(files), text))
    return patches


def write_series(layout: Layout, outdir: Path) -> None:
    """Writes SERIES' patches as ``NNNN-<slug>.patch`` into ``outdir``."""
    if not layout.source:
        raise PatchSetError("--series needs --vllm-src")
    patches = series(layout)
    if outdir.exists() and any(outdir.glob("*.patch")):
        raise PatchSetError(f"{outdir} already holds patches; not mixing series")
    outdir.mkdir(parents=True, exist_ok=True)
    for number, patch in enumerate(patches, 1):
        path = outdir / f"{number:04d}-{patch.step.slug}.patch"
        path.write_text(patch.text)
        print(path)
    print(f"wrote {len(patches)} patches to {outdir}")


# --- command line ---------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=f"Apply the HPC patch set to vLLM {BASE_VERSION}.",
        epilog="exit codes: 0 success, 1 failure, 2 unsupported vLLM version",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--target",
        type=Path,
        metavar="DIR",
        help="vllm package directory to patch (default: the installed vLLM)",
    )
    where.add_argument(
        "--vllm-src",
        type=Path,
        metavar="DIR",
        help="vLLM source checkout to patch, wiring _hpc_C into its build",
    )
    action = parser.add_mutually_exclusive_group()
    action.add_argument(
        "--check", action="store_true", help="report the state; change nothing"
    )
    action.add_argument(
        "--revert", action="store_true", help="restore the upstream files"
    )
    action.add_argument(
        "--diff", action="store_true", help="print the patch set as a unified diff"
    )
    action.add_argument(
        "--series",
        type=Path,
        metavar="OUTDIR",
        help="write the change as numbered patches into OUTDIR (--vllm-src)",
    )
    how = parser.add_mutually_exclusive_group()
    how.add_argument(
        "--copy",
        dest="mode",
        action="store_const",
        const="copy",
        help="copy files (default for --vllm-src)",
    )
    how.add_argument(
        "--link",
        dest="mode",
        action="store_const",
        const="link",
        help="symlink files (default for an installed vLLM)",
    )
    parser.add_argument(
        "--tree",
        type=Path,
        default=REPO_ROOT,
        metavar="DIR",
        help="patch-set tree (default: this repository)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="say more")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    tree = args.tree.resolve()
    try:
        if args.vllm_src is not None:
            layout = source_layout(args.vllm_src.resolve(), tree)
        else:
            target = args.target or find_installed_vllm(tree)
            layout = installed_layout(target.resolve(), tree)
        if args.check:
            return 0 if check(layout) else 1
        if args.revert:
            revert(layout, args.verbose)
        elif args.diff:
            sys.stdout.write(diff(layout))
        elif args.series is not None:
            write_series(layout, args.series.resolve())
        else:
            apply(
                layout, args.mode or ("copy" if layout.source else "link"), args.verbose
            )
    except PatchSetError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.code
    except BrokenPipeError:
        raise
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:
        # The reader went away (e.g. `--diff | head`); that is not an error.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
