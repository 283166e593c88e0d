# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The import structure of the patch set's Python modules, read from their
sources (no import runs, so no GPU, library or vLLM installation is needed).

* No import cycle among the modules: every import counts, at module level,
  inside functions and under ``TYPE_CHECKING`` alike, and so does
  ``importlib.import_module`` with a literal name. The walk is checked on
  modules that do import each other, so it is seen to fail on a cycle.
* The op layer (``vllm._hpc_ops``) imports torch and the standard library
  only, and its validation (``vllm._hpc_ops_validation``) the op layer
  besides: they work on a machine with the library and no vLLM. It is the
  only module that names the library's op namespace.
* Every Python module of the sparse tree is one of ``MODULES``, so a module
  added later is checked too.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

from tests.kernels.hpc.utils import REPO_ROOT

# The Python modules the patch set adds to vLLM or replaces in it.
MODULES = (
    "vllm._hpc_ops",
    "vllm._hpc_ops_validation",
    "vllm.utils.hpc",
    "vllm.v1.attention.ops.hpc_attn_workspace",
    "vllm.v1.attention.backends.hpc_attn",
    "vllm.model_executor.layers.hpc.rope_norm",
    "vllm.model_executor.layers.fused_moe.hpc_moe",
)
# What each of the two bottom modules may import besides the standard
# library.
ALLOWED_IMPORTS = {
    "vllm._hpc_ops": {"torch"},
    "vllm._hpc_ops_validation": {"torch", "vllm._hpc_ops"},
}


def module_path(root: Path, name: str) -> Path:
    return root.joinpath(*name.split(".")).with_suffix(".py")


def imported_names(source: str, name: str) -> set[str]:
    """Every module name ``source`` (the module ``name``) imports, anywhere
    in it. ``from a import b`` gives both ``a`` and ``a.b`` (``b`` may be a
    module or a name in ``a``)."""
    package = name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0]
                base = f"{parent}.{base}" if base else parent
            if base == "__future__":
                continue
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(node.args[0].value)
    return found


def import_graph(root: Path, names: Iterable[str]) -> dict[str, set[str]]:
    """For each of ``names`` present under ``root``, the others it imports."""
    present = [n for n in names if module_path(root, n).is_file()]
    return {
        name: imported_names(module_path(root, name).read_text(), name)
        & set(present) - {name}
        for name in present
    }


def find_cycle(graph: Mapping[str, Iterable[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as the modules along it (the first one
    repeated at the end), or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        if name in path:
            return path[path.index(name) :] + [name]
        if name in done:
            return None
        path.append(name)
        for imported in sorted(graph.get(name, ())):
            cycle = visit(imported)
            if cycle is not None:
                return cycle
        path.pop()
        done.add(name)
        return None

    for name in sorted(graph):
        cycle = visit(name)
        if cycle is not None:
            return cycle
    return None


def test_no_import_cycle() -> None:
    graph = import_graph(REPO_ROOT, MODULES)
    assert "vllm._hpc_ops" in graph, "the op layer's source was not found"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_graph_sees_imports() -> None:
    graph = import_graph(REPO_ROOT, MODULES)
    assert graph["vllm._hpc_ops"] == set()
    assert "vllm._hpc_ops" in graph["vllm._hpc_ops_validation"]
    workspace = "vllm.v1.attention.ops.hpc_attn_workspace"
    assert {"vllm._hpc_ops", "vllm._hpc_ops_validation"} <= graph[workspace]


@pytest.mark.parametrize(
    "sources",
    [
        # The cycle the op layer once had: a TYPE_CHECKING import back.
        {
            "vllm.ops": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from vllm.ws import Workspace\n",
            "vllm.ws": "from vllm.ops import run\n",
        },
        # Through a function-level import and a third module.
        {
            "vllm.a": "import vllm.b\n",
            "vllm.b": "from vllm import c\n",
            "vllm.c": "def f():\n    from vllm.a import g\n",
        },
        # Through importlib.
        {
            "vllm.pkg.a": "import importlib\n"
            "def f():\n    return importlib.import_module('vllm.pkg.b')\n",
            "vllm.pkg.b": "from . import a\n",
        },
    ],
    ids=["type-checking", "function-level", "importlib"],
)
def test_a_cycle_is_found(tmp_path: Path, sources: dict[str, str]) -> None:
    for name, source in sources.items():
        path = module_path(tmp_path, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    cycle = find_cycle(import_graph(tmp_path, sources))
    assert cycle is not None and cycle[0] == cycle[-1]
    assert set(cycle) == set(sources)


@pytest.mark.parametrize("name", sorted(ALLOWED_IMPORTS))
def test_op_layer_imports(name: str) -> None:
    source = module_path(REPO_ROOT, name).read_text()
    top_level = {
        imported
        for imported in imported_names(source, name)
        if imported.split(".")[0] not in sys.stdlib_module_names
    }
    allowed = ALLOWED_IMPORTS[name]
    # "from vllm._hpc_ops import X" also gives "vllm._hpc_ops.X"; "from
    # vllm import _hpc_ops" gives "vllm".
    extra = {
        imported
        for imported in top_level
        if imported != "vllm"
        and not any(imported == a or imported.startswith(f"{a}.") for a in allowed)
    }
    assert not extra, f"{name} imports {sorted(extra)}; allowed: {sorted(allowed)}"


def test_only_the_op_layer_names_the_library() -> None:
    naming = [
        name
        for name in MODULES
        if module_path(REPO_ROOT, name).is_file()
        and "ops._hpc_C" in module_path(REPO_ROOT, name).read_text()
    ]
    assert naming == ["vllm._hpc_ops"]


def test_every_module_of_the_tree_is_listed() -> None:
    vllm_dir = REPO_ROOT / "vllm"
    if (vllm_dir / "__init__.py").is_file():
        pytest.skip("a vLLM checkout: its other modules are vLLM's own")
    found = {
        ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)
        for path in vllm_dir.rglob("*.py")
    }
    assert found == set(MODULES)
